"""The OpenAI-compatible API's wire protocol: request schemas (pydantic, strict JSON types) and errors.

Every request field is checked at the door: a boolean or a string is not a number, strings must be valid
Unicode, and a bad value is a 400 naming the field in OpenAI's `{"error": {message, type, param, code}}`.
Nothing here touches the engine.
"""

import logging
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.entrypoints.tool_calls import forced_schema, function_parameters
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams, is_valid_unicode

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


class JsonSchemaFormat(_StrictModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_StrictModel):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


class StructuredOutputsRequest(_StrictModel):
    """vLLM's structured_outputs: exactly one of json (a schema), json_object, regex, choice, grammar (Lark)."""

    model_config = ConfigDict(strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def params(self) -> StructuredOutputsParams:
        try:
            return StructuredOutputsParams(json=self.json_, json_object=bool(self.json_object), regex=self.regex,
                                           choice=self.choice, grammar=self.grammar)
        except SamplingParamsError as e:
            raise bad_request(str(e), "structured_outputs") from None


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's constrained decoding

    def structured_spec(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the constraint, the request field it came from), or (None, None)."""
        from_format = self.response_format.structured_outputs() if self.response_format is not None else None
        if from_format is not None and self.structured_outputs is not None:
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        if from_format is not None:
            return from_format, "response_format"
        if self.structured_outputs is not None:
            return self.structured_outputs.params(), "structured_outputs"
        return None, None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        param_names: dict[str, str], structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams from the request; null fields take SamplingParams' defaults. A bad value is a 400
        naming the API field (`param_names` maps SamplingParams names that differ from the API's)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured,
                                  prompt_logprobs=prompt_logprobs)
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

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated. As vLLM, the engine
        still generates one token, which the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def generated_token_limit(self) -> int | None:
        """SamplingParams.max_tokens: at least 1 (echo_only)."""
        return 1 if self.echo_only else self.max_tokens

    @property
    def prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too: the same number of top logprobs per prompt token."""
        return self.logprobs if self.echo else None

    def check_supported(self):
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens")
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


class FunctionDefinition(_StrictModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_StrictModel):
    name: str


class NamedToolChoice(_StrictModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None   # false: a "required" output holds exactly one call
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

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice "none"), "auto", "required" or "named" (engine/entrypoints/tool_calls.py)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        if choice == "none":
            return None
        if choice is None or choice == "auto":
            return "auto"
        return "required" if choice == "required" else "named"

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the chat template shows the model (none with tool_choice "none")."""
        return None if self.tool_mode is None else [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def tool_name(self) -> str | None:
        return self.tool_choice.function.name if self.tool_mode == "named" else None

    def structured_spec(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """A forced tool call ("required" or a named function) constrains the output to the call's schema."""
        spec, field = super().structured_spec()
        mode = self.tool_mode
        if mode not in ("required", "named"):
            return spec, field
        if spec is not None:
            raise bad_request(f"a forced tool call (tool_choice) cannot be combined with {field}", "tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if mode == "required":
            return StructuredOutputsParams(json=forced_schema(tools, self.parallel_tool_calls is not False)), "tools"
        named = [t for t in tools if t["function"]["name"] == self.tool_name]
        if not named:
            raise bad_request(f"tool_choice names function {self.tool_name!r}, which is not in tools", "tool_choice")
        return StructuredOutputsParams(json=function_parameters(named[0])), "tools"


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


class EmbeddingRequest(_RequestModel):
    """OpenAI's embeddings request, with vLLM's per-request pooling overrides (pooling_type, normalize)."""

    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None              # no matryoshka truncation: refused when set (PoolingParams)
    user: str | None = None
    pooling_type: str | None = None            # None: the server's default
    normalize: bool | None = None              # None: L2-normalized

    def pooling_params(self, default_pooling_type: str = "last") -> PoolingParams:
        """PoolingParams from the request; a bad value is a 400 naming the field."""
        try:
            return PoolingParams(pooling_type=self.pooling_type or default_pooling_type,
                                 normalize=True if self.normalize is None else self.normalize,
                                 dimensions=self.dimensions)
        except SamplingParamsError as e:
            raise bad_request(str(e), e.field) from None
