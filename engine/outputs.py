"""What users get back: RequestOutput, one per request (a step's delta, or the whole output), with a
CompletionOutput per sample (as vLLM's `vllm.outputs`)."""

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
