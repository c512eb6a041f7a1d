"""A request (generation, or an embedding's prefill) and the lifecycle state the scheduler keeps on it."""

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()   # queued, holds no blocks: new, or preempted by recompute
    RUNNING = enum.auto()   # holds device blocks: prefilling or decoding
    SWAPPED = enum.auto()   # preempted by swap: its K/V sits in host blocks
    FINISHED = enum.auto()


# eq=False: requests are compared (and hashed) by identity, so list.remove and sets are exact and cheap.
@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0                       # lower value = more important
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    arrival: int = -1                       # monotonic, set by Scheduler.add
    group_id: str = ""                      # the user request this is one of the n samples of (the engine's)
    sample_index: int = 0                   # which of them
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0            # tokens whose K/V are in the device cache
    block_ids: list[int] = field(default_factory=list)       # device blocks, append-only while running
    host_block_ids: list[int] = field(default_factory=list)  # host blocks while swapped
    finish_reason: str | None = None        # "stop", "length", "abort", "error"
    num_preemptions: int = 0
    params: SamplingParams | None = None    # None: greedy
    seed: int = 0                           # the request's seed (drawn by the engine when not given)
    cache_salt: str | None = None           # prefix-cache namespace: only requests with the same salt share
    # An embedding request's pooling type ("last" or "mean", engine/pooling_params.py): its prefill target is its
    # prompt, and it finishes once that is computed, generating nothing (max_tokens 0)
    pooling: str | None = None
    # Structured outputs (engine.structured.GrammarMatcher): masks each sampled token, follows the outputs
    grammar: Any = None
    # Hashes of the full blocks of all_token_ids, computed lazily by the KV cache manager: [n_hashed] x 32 bytes
    block_hashes: list[bytes] = field(default_factory=list)
    # len(prompt) + len(outputs), kept by append_output: read for every running request several times a step,
    # where a property's two len() calls and its call cost add up (Scheduler.check_invariants checks it)
    num_tokens: int = field(init=False)

    def __post_init__(self):
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output(self, token: int, max_model_len: int) -> str | None:
        """Add an output token (the one way one is added, but for a decode batch's in Scheduler.update_from_output),
        finishing the request if it stops there; returns check_stop's finish reason or None."""
        self.output_token_ids.append(token)
        self.num_tokens += 1
        return self.stop_after_append(token, max_model_len)

    def stop_after_append(self, token: int, max_model_len: int) -> str | None:
        """check_stop on the output token just appended, finishing the request if it stops there.
        Scheduler.update_from_output appends a decode batch's tokens itself and asks this only of the rows whose
        token may stop (the others' check_stop surely returns None)."""
        reason = self.check_stop(token, max_model_len)
        if reason is not None:
            self.finish(reason)
        return reason

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The next decode input, without building all_token_ids (a hot-path call)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens whose K/V must be cached before this request can decode: all but the last sampled token,
        which is the next decode input. A recompute-preempted request thus re-prefills prompt + outputs[:-1]
        and then decodes on, token-identical to a run that was never preempted."""
        return self.num_tokens - 1 if self.output_token_ids else self.num_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill scores the prompt (prompt_logprobs): sample 0 of its group only, once for the
        group (the samples forked from it share its prompt, and may share its cached blocks)."""
        return self.sample_index == 0 and self.params is not None and self.params.prompt_logprobs is not None

    @property
    def reads_every_prompt_row(self) -> bool:
        """Whether its prefill needs the output of every prompt position, so no cached prefix may stand in for
        computing them: a scored prompt (prompt_logprobs), or an embedding pooled over the whole prompt."""
        return self.scores_prompt or self.pooling == "mean"

    @property
    def in_prefill(self) -> bool:
        # prefill_target, inlined: asked for every running request every step
        return self.num_computed_tokens < (self.num_tokens - 1 if self.output_token_ids else self.num_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop(self, token: int, max_model_len: int) -> str | None:
        """Finish reason after `token` was appended to the outputs, or None to go on. Token-level only: stop
        strings are matched on the text, by the output side (engine/output_processor.py)."""
        if self.grammar is not None:
            # A complete grammar ends the output even before min_tokens: its mask would allow only EOS.
            grammar_stop = self.grammar.advance(self.output_token_ids)
            if grammar_stop is not None:
                return grammar_stop
        if len(self.output_token_ids) >= self.min_tokens:
            if token in self.stop_token_ids or (token in self.eos_token_ids and not self.ignore_eos):
                return "stop"
        if len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Ids that must not be sampled now: the tokens that would stop the request (EOS unless ignored,
        and stop_token_ids) while min_tokens is not reached."""
        if len(self.output_token_ids) >= self.min_tokens:
            return ()
        return self.stop_token_ids + (() if self.ignore_eos else self.eos_token_ids)

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
