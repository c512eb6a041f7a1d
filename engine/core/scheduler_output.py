"""The step contract between the scheduler (engine/core) and the worker (engine/worker): plain data only.

Each step the scheduler hands the worker a SchedulerOutput (vLLM v1's name): the requests it sends for the first
time, or anew after a preemption, with everything the worker needs to run and sample them (NewRequestData); for
the requests it already holds only what changed (block ids appended this step); the ids of the requests that
left (finished, aborted, preempted), whose state the worker drops; the block copies of swapping; and the step's
work: prefill chunks and the decode batch, by request id. The worker keeps its own state of every request it
holds (engine/worker/input_batch.py) and answers with a ModelRunnerOutput: the sampled tokens, which both sides
append to their own copies of the request. No live object crosses: nothing on one side is read or changed by the
other.
"""

import dataclasses

import numpy as np

from engine.core.request import Request
from engine.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request as the worker first sees it (or sees it again, resumed after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]       # its outputs so far (a resumed request's; its prefill re-computes them)
    block_ids: list[int]              # its device blocks, in order
    params: SamplingParams | None     # None: greedy
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: tuple[int, ...]   # ids that end it once it has min_tokens outputs, EOS included unless
                                      # ignored: what min_tokens bans before then
    has_grammar: bool                 # structured output: the scheduler sends its mask each step it samples
    scores_prompt: bool               # its prefill scores the prompt (prompt_logprobs)
    pools: bool = False               # an embedding: its chunks pool their final hidden states, sampling nothing

    @classmethod
    def of(cls, r: Request) -> "NewRequestData":
        """A copy of what the worker needs of `r`: nothing it holds is the request's own."""
        return cls(r.request_id, list(r.prompt_token_ids), list(r.output_token_ids), list(r.block_ids), r.params,
                   r.seed, r.max_tokens, r.min_tokens, r.stop_token_ids + (() if r.ignore_eos else r.eos_token_ids),
                   r.grammar is not None, r.scores_prompt, r.pooling is not None)


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`length` prompt (or re-prefilled) tokens of a request from position `start`."""

    req_id: str
    start: int
    length: int
    samples: bool  # reaches the end of the tokens to prefill, with no output yet: its last row samples a token
                   # (never an embedding's chunk: it pools, ModelRunnerOutput.pooler_output)


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    step: int
    new_requests: list[NewRequestData] = dataclasses.field(default_factory=list)
    new_block_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # held requests' new blocks
    # held requests' placeholder entries (a sliding window's, taken chunk by chunk) given blocks: [(entry, block)]
    filled_block_ids: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    # Requests that left since the last step, whose state the worker drops with any host copy of their blocks:
    # finished or aborted, and preempted (a swapped-out one's host copy is made by this step's swap_out, after;
    # a swapped one preempted again, to recompute, loses its copy)
    finished_req_ids: list[str] = dataclasses.field(default_factory=list)
    preempted_req_ids: list[str] = dataclasses.field(default_factory=list)
    # Block copies, run before the step in this order: swap-outs first (those device blocks may be reused by the
    # swap-ins), each request's kept in host memory until its swap-in or its finish.
    swap_out: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)  # (req id, device blocks)
    swap_in: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)   # (req id, device blocks)
    prefills: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    decodes: list[str] = dataclasses.field(default_factory=list)  # feed their last token, sample the next
    # req id -> u32[ceil(V / 32)] allowed-token bitmask, for each row that samples under a grammar
    grammar_bitmasks: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # The scheduler's decisions, for observers (metrics, logs, tests); the worker ignores it
    trace: list[tuple[str, dict]] = dataclasses.field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(c.length for c in self.prefills)

    @property
    def decodes_only(self) -> bool:
        """Nothing but a decode batch to run: no chunk, no block copy (what async scheduling may run ahead)."""
        return not (self.prefills or self.swap_out or self.swap_in)


@dataclasses.dataclass(slots=True)
class ModelRunnerOutput:
    """What the worker sampled for a SchedulerOutput."""

    sampled: dict[str, int] = dataclasses.field(default_factory=dict)  # chunks that sample (and, when the step
                                                                      # ran in parts, decodes): req id -> token
    # One token per SchedulerOutput.decodes row, in its order (None: in `sampled`), and where each may end its
    # request (a stop id, the length, a grammar; elsewhere the scheduler's stop check surely says go on)
    decode_tokens: list[int] | None = None
    may_stop: np.ndarray | None = None
    # req id -> (logprob of the sampled token, [(id, logprob), ...] top-k), for requests that ask for logprobs
    logprobs: dict[str, tuple] = dataclasses.field(default_factory=dict)
    # req id -> (prompt position of the first, [(logprob of that prompt token, top-k), ...]) of its scored rows
    prompt_logprobs: dict[str, tuple[int, list]] = dataclasses.field(default_factory=dict)
    # req id -> why the step failed for it (fault isolation found it makes the step fail); it sampled nothing
    failed: dict[str, Exception] = dataclasses.field(default_factory=dict)
    # An embedding's chunk: req id -> (float32 [hidden] sum of its rows' final hidden states, the last prompt row's
    # [hidden] when the chunk ends the prompt, else None); the engine adds a request's chunks up and pools them
    pooler_output: dict[str, tuple[np.ndarray, np.ndarray | None]] = dataclasses.field(default_factory=dict)
