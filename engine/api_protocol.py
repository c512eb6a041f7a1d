"""The OpenAI-compatible API's wire protocol: request schemas (pydantic, strict JSON types) and errors.

Every request field is checked at the door: a boolean or a string is not a number, strings must be valid
Unicode, and a bad value is a 400 naming the field in OpenAI's `{"error": {message, type, param, code}}`.
Nothing here touches the engine.
"""

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator

from engine.sampling_params import SamplingParams, SamplingParamsError, is_valid_unicode

log = logging.getLogger("ferry.server")


class APIError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class EngineUnavailable(RuntimeError):
    """The engine loop stopped (shutdown) or died; in-flight and new requests fail with it."""


class RequestFailed(RuntimeError):
    """The engine failed this request alone (finish_reason "error"); the others go on."""


def as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineUnavailable):
        return APIError(503, str(e), type="server_error", code="engine_unavailable")
    if isinstance(e, RequestFailed):
        return APIError(500, f"the request failed in the engine: {e}", type="server_error", code="request_failed")
    if isinstance(e, SamplingParamsError):
        return bad_request(str(e), e.field)
    if isinstance(e, ValueError):
        return bad_request(str(e))
    return APIError(500, f"internal error: {e!r}", type="server_error")


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the top-level field, as OpenAI's `param` does."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = loc[0] if loc else None
    where = f"{'.'.join(loc)}: " if loc else "request body: "
    return bad_request(where + first["msg"], param)


def _invalid_unicode(value) -> str | None:
    """The first string (or dict key) in `value` that is not valid Unicode: JSON's "\\ud800" escapes
    decode to lone surrogates, which no tokenizer (nor UTF-8) can take."""
    if isinstance(value, str):
        return None if is_valid_unicode(value) else value
    if isinstance(value, BaseModel):
        value = [*value.__dict__.values(), *(value.__pydantic_extra__ or {}).items()]
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list | tuple):
        for item in value:
            if (bad := _invalid_unicode(item)) is not None:
                return bad
    return None


class _StrictModel(BaseModel):
    # Strict: `n: true` or `temperature: "0.5"` is a client bug to report, not a value to coerce.
    model_config = ConfigDict(strict=True)


class _RequestModel(_StrictModel):
    # Unknown fields are ignored with a warning, as vLLM does; clients send provider-specific extras.
    model_config = ConfigDict(extra="allow", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value, info):
        if _invalid_unicode(value) is not None:
            raise ValueError(f"{info.field_name} is not valid Unicode (it holds a lone surrogate)")
        return value

    def model_post_init(self, _context):
        if self.model_extra:
            log.warning("ignoring unsupported request fields: %s", sorted(self.model_extra)[:20])


class StreamOptions(_StrictModel):
    include_usage: bool = False


class _GenerationRequest(_RequestModel):
    """The fields completions and chat share: OpenAI's sampling fields and vLLM's extensions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None              # prefix-cache namespace: only equal salts share cached blocks

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        param_names: dict[str, str]) -> SamplingParams:
        """SamplingParams from the request; null fields take SamplingParams' defaults. A bad value is a 400
        naming the API field (`param_names` maps SamplingParams names that differ from the API's)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs)
        except SamplingParamsError as e:
            raise bad_request(str(e), param_names.get(e.field, e.field)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# The request fields passed to SamplingParams as they are (None: SamplingParams' default).
SAMPLING_FIELDS = ("n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
                   "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "priority",
                   "skip_special_tokens", "include_stop_str_in_output")


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

    def check_supported(self):
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of must equal n (only n samples are generated)", "best_of")


class ChatContentPart(_StrictModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_StrictModel):
    # Extra keys (tool_calls, tool_call_id, ...) pass through to the chat template, as transformers does.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ChatContentPart] | None = None

    def for_template(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.type != "text" for part in self.content):
                raise bad_request("only text content parts are supported", "messages")
            message["content"] = "\n".join(part.text or "" for part in self.content)
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None              # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def output_token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_per_token(self) -> int | None:
        """SamplingParams.logprobs: top_logprobs when logprobs is on (0 = the chosen token only)."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(_RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None     # default: true for a prompt, false for messages (the template's)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_RequestModel):
    model: str | None = None
    tokens: list[int]
