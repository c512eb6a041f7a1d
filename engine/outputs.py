"""What users get back: RequestOutput, one per request (a step's delta, or the whole output), with a
CompletionOutput per sample, and EmbeddingRequestOutput, one per embedding request (as vLLM's `vllm.outputs`)."""

import dataclasses


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int                             # which of the request's n samples
    text: str                              # in a step's delta: the new text; in a final output: all of it
    token_ids: list[int]
    finish_reason: str | None = None       # "stop", "length", "abort", "error"
    logprobs: list[dict[int, float]] | None = None  # per token: {id: logprob} of the sampled and top ids
    stop_reason: str | int | None = None   # the stop string or token id that ended it


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict = dataclasses.field(default_factory=dict)
    error: str | None = None               # set when the request failed (finish_reason "error"); others go on


@dataclasses.dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]                 # the pooled (and, by default, L2-normalized) final hidden state


@dataclasses.dataclass(slots=True)
class EmbeddingRequestOutput:
    """An embedding request's one output, when it finishes (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None               # set when the request failed; `outputs.embedding` is then empty
