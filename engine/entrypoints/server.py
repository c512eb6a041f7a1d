"""An OpenAI-compatible HTTP server over LLMEngine (FastAPI; run it with `python -m engine.entrypoints.serve`).

The pieces: `api_protocol` (request schemas, errors), `engine_loop` (the engine's own thread, commands in,
output streams out), `api_responses` (OpenAI response and SSE shapes), and this file: the routes.

Lifecycle of a request: the body is capped (413) -> strict validation (a 400 naming the field) -> limits
(prompt characters before tokenizing, stop strings) -> tokenizing and chat templating on a worker thread, so
no request stalls the event loop -> admission (a bounded count of requests not yet generating; past it 503
+ Retry-After; a batch that could never fit is a 400) -> the engine thread accepts or rejects it (a rejection
becomes a 400) -> deltas until finished. However the handler ends (done, error, client disconnect, server
shutdown) `OutputStream.close` aborts what is unfinished, so nothing a client does can leave blocks behind.
A request that fails inside the engine gets a 500 (an SSE error event then [DONE] when streaming) while the
others go on; a fault the engine cannot isolate ends the process non-zero (`on_fatal`).

Shutdown (`drain`): stop accepting (503), let running requests finish for up to `shutdown_timeout_s`, then
end every open stream with an error event and [DONE] and every waiting non-streamed request with JSON.

Endpoints: POST /v1/completions, /v1/chat/completions (both with `stream`, and vLLM's `cache_salt`),
/v1/embeddings, GET /v1/models, /health, /metrics, and vLLM's POST /tokenize, /detokenize, /reset_prefix_cache,
GET /tokenizer_info.
With --profiler_dir, vLLM's POST /start_profile and /stop_profile. --allowed_origins adds CORS (outermost, so
preflights need no API key).
"""

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax.profiler
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from engine.entrypoints.api_protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    EngineUnavailable,
    RequestFailed,
    TokenizeRequest,
    as_api_error,
    bad_request,
    validation_error,
)
from engine.entrypoints.api_responses import (
    ChatBuilder,
    CompletionBuilder,
    EventStreamResponse,
    ResponseBuilder,
    embedding_response,
    sse_events,
)
from engine.entrypoints.engine_loop import AdmissionControl, EngineLoop, OutputStream
from engine.entrypoints.metrics import ServerMetrics
from engine.entrypoints.reasoning import REASONING_PARSERS
from engine.entrypoints.server_config import ServerConfig  # noqa: F401 (re-exported: engine.entrypoints.server.ServerConfig)
from engine.entrypoints.tool_calls import TOOL_PARSERS, detect_tool_parser, drops_tags
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, SamplingParamsError
from models.tokenizers.tokenizer import ChatTemplateError

log = logging.getLogger("ferry.server")

MAX_CHOICES = 128              # n x prompts per API request: bounds what one request can queue
RETRY_AFTER_S = 1              # advertised to clients turned away by admission control
UNAUTHENTICATED_PATHS = frozenset({"/health", "/metrics"})
# apply_chat_template's own arguments: chat_template_kwargs may not override them (a client-chosen template).
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "chat_template", "tools"})
PROMPT_CHARS_PER_TOKEN = 64    # default --max_prompt_chars = this x max_model_len: longer can never fit
TEXT_WORKERS = 2               # threads that tokenize and render chat templates off the event loop


def _prompt_batch(prompt) -> list:
    """A request's prompt field (a string, token ids, or a list of either) as a list of prompts."""
    return prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, handler) -> Response:
    """Run the handler, cancelling it if the client disconnects first (as vLLM's `with_cancellation`): a
    cancelled handler closes its OutputStream, which aborts its engine requests."""
    task = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()


class OpenAIServer:
    """The HTTP handlers over one EngineLoop. Build the FastAPI app with `build_app`."""

    def __init__(self, engine: LLMEngine, config: ServerConfig,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.config = config
        self.metrics = ServerMetrics(config.served_model_name)
        self.metrics.record_memory(engine.memory)
        self.engine_loop = EngineLoop(engine, self.metrics, config.log_interval_s, on_fatal)
        self.admission = AdmissionControl(config.max_waiting)
        # Read once here: afterwards only the engine thread touches the engine.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_root = engine.model.path
        # the exception: thread-safe, so requests compile off the engine thread
        self.compile_grammar = engine.compile_grammar
        self.max_prompt_chars = config.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * engine.max_model_len
        self.open_streams: set[OutputStream] = set()
        self._text_pool = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="ferry-text")
        self._init_chat_parsers(config)
        self._profile_lock = asyncio.Lock()  # start and stop one at a time
        self._profiling = False

    def _init_chat_parsers(self, config: ServerConfig) -> None:
        """The reasoning and "auto" tool-call parsers, and whether their tags need the special tokens kept."""
        if config.reasoning_parser is not None and config.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got "
                             f"{config.reasoning_parser!r}")
        if config.tool_call_parser is not None and config.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {config.tool_call_parser!r}")
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        self.tool_parser = config.tool_call_parser or detect_tool_parser(template)
        log.info("chat tool calls (tool_choice auto) are read as %s%s", self.tool_parser,
                 "" if config.tool_call_parser else " (from the chat template)")
        self.tool_tags_dropped = drops_tags(self.tokenizer, TOOL_PARSERS[self.tool_parser].tags)
        reasoning = REASONING_PARSERS.get(config.reasoning_parser)
        self.reasoning_tags_dropped = reasoning is not None and drops_tags(self.tokenizer, reasoning.tags)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI):
        self.engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(self.engine_loop.stop)
            self._text_pool.shutdown(wait=False, cancel_futures=True)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Graceful shutdown: refuse new requests (503), give the running ones up to `timeout_s` to finish,
        then fail the rest (streams end with an error event and [DONE]) and let their responses go out."""
        timeout_s = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        self.engine_loop.stop_accepting("the server is shutting down")
        log.info("shutting down: %d requests in flight get up to %.0f s to finish", self.engine_loop.num_in_flight,
                 timeout_s)
        deadline = loop.time() + timeout_s
        while self.engine_loop.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.engine_loop.stop)  # whatever is left gets EngineUnavailable
        deadline = loop.time() + 5.0
        while self.open_streams and loop.time() < deadline:  # their error responses are being written
            await asyncio.sleep(0.02)

    async def _off_loop(self, fn, *args):
        """Run text work (tokenizing, templating) on a worker thread: a huge prompt must not stall /health."""
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    # ------------------------------------------------------------ validation helpers

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves "
                                f"`{self.config.served_model_name}`).", param="model", code="model_not_found")

    def require_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids", param)
        return self.tokenizer

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise bad_request(f"the {param} has {num_chars} characters; this server tokenizes at most "
                              f"{self.max_prompt_chars} (max_model_len is {self.max_model_len} tokens)", param)

    def check_stops(self, params: SamplingParams) -> None:
        c = self.config
        if len(params.stop) > c.max_stop_strings:
            raise bad_request(f"at most {c.max_stop_strings} stop strings, got {len(params.stop)}", "stop")
        if any(len(s) > c.max_stop_chars for s in params.stop):
            raise bad_request(f"stop strings may have at most {c.max_stop_chars} characters", "stop")

    async def prompt_token_ids(self, prompt, param: str = "prompt") -> list[list[int]]:
        """A string, token ids, or a batch of either (a completion's `prompt`, an embedding's `input`) -> one
        list of token ids per prompt; an empty one is a 400 naming `param`."""
        batch = _prompt_batch(prompt)
        if not batch or any(not item for item in batch):
            raise bad_request(f"{param} must not be empty (nor hold an empty item)", param)
        texts = [item for item in batch if isinstance(item, str)]
        if texts:
            self.require_tokenizer(param)
            self.check_prompt_chars(sum(len(t) for t in texts), param)
            encoded = iter(await self._off_loop(lambda: [self.tokenizer.encode(t) for t in texts]))
        return [next(encoded) if isinstance(item, str) else list(item) for item in batch]

    async def echoed_prompts(self, prompt, prompts: list[list[int]]) -> list[str]:
        """The text `echo` returns for each prompt: as sent, or its token ids decoded (as vLLM)."""
        batch = _prompt_batch(prompt)
        if self.tokenizer is None:
            return [item if isinstance(item, str) else "" for item in batch]
        return await self._off_loop(lambda: [item if isinstance(item, str) else self.tokenizer.decode(ids)
                                             for item, ids in zip(batch, prompts)])

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          template_kwargs: dict | None, tools: list[dict] | None = None) -> str:
        tokenizer = self.require_tokenizer("messages")
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        template_kwargs = template_kwargs or {}
        reserved = sorted(RESERVED_TEMPLATE_ARGS & template_kwargs.keys())
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
        messages = [m.for_template() for m in messages]
        self.check_prompt_chars(sum(len(str(m.get("content", ""))) for m in messages), "messages")
        try:
            return await self._off_loop(lambda: tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs))
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # the template choked on what the client sent (a jinja error, a bad type)
            raise bad_request(f"the chat template cannot render these messages: {e!r}", "messages") from None

    def check_lengths(self, prompts: list[list[int]], max_tokens: int | None, n: int, prompt_param: str,
                      max_tokens_param: str) -> None:
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"n x prompts is {len(prompts) * n}; at most {MAX_CHOICES} choices per request", "n")
        if self.config.max_waiting is not None and len(prompts) > self.config.max_waiting:
            # Admission counts prompts; more than max_waiting at once could never be admitted (503s forever).
            raise bad_request(f"{len(prompts)} prompts in one request, but this server queues at most "
                              f"{self.config.max_waiting} (max_waiting): send fewer per request", prompt_param)
        for prompt in prompts:
            if len(prompt) + 1 > self.max_model_len:  # room for at least one generated token
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                  f"your {prompt_param} has {len(prompt)} tokens, leaving no room to generate.",
                                  prompt_param)
            if max_tokens is not None and len(prompt) + max_tokens > self.max_model_len:
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                  f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                                  f"{prompt_param}, {max_tokens} in the completion).", max_tokens_param)

    # ------------------------------------------------------------ submission

    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     arrival_time: float, prompt_param: str, cache_salt: str | None = None) -> OutputStream:
        """Admit and queue the request; returns once the engine thread accepted it (a rejection is a 400)."""
        if not self.admission.admit(len(prompts)):
            raise APIError(503, f"The server is busy: {self.admission.num_waiting} requests are waiting "
                                f"(max_waiting={self.config.max_waiting}). Retry later.", type="server_error",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = OutputStream(ids, self.admission, self.engine_loop.abort)
        self.open_streams.add(stream)
        stream.on_close = self.open_streams.discard
        try:
            self.engine_loop.add(stream, prompts, params, arrival_time, cache_salt)
            await stream.accepted
        except BaseException as e:  # rejected, engine gone, or the client gone while we waited
            stream.close()
            if isinstance(e, Exception):
                error = as_api_error(e)
                if error.param == "prompt":
                    error.param = prompt_param
                raise error from None
            raise
        return stream

    async def respond(self, stream: OutputStream, builder: ResponseBuilder, streaming: bool,
                      include_usage: bool) -> Response:
        if streaming:
            return EventStreamResponse(sse_events(stream, builder, include_usage), stream)
        try:
            async for output in stream:
                builder.add(output)
        finally:
            stream.close()
        return JSONResponse(builder.response())

    async def sampling_params(self, body, max_tokens: int | None, logprobs: int | None,
                              param_names: dict[str, str], prompt_logprobs: int | None = None) -> SamplingParams:
        structured, field = body.structured_spec()
        if structured is not None:
            # Compiled here, on a worker thread (a bad grammar is a 400 naming its field); the engine thread
            # then finds it in the grammar cache.
            try:
                await self._off_loop(self.compile_grammar, structured, field)
            except SamplingParamsError as e:
                raise bad_request(str(e), e.field) from None
        params = body.sampling_params(max_tokens, logprobs, param_names, structured, prompt_logprobs)
        self.check_stops(params)
        return params

    # ------------------------------------------------------------ endpoints

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, self._completions(body))

    async def _completions(self, body: CompletionRequest) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        body.check_supported()
        params = await self.sampling_params(body, body.generated_token_limit, body.logprobs, {},
                                            prompt_logprobs=body.prompt_logprobs)
        prompts = await self.prompt_token_ids(body.prompt)
        self.check_lengths(prompts, body.max_tokens, params.n, "prompt", "max_tokens")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self.submit(request_id, prompts, params, arrival, "prompt", body.cache_salt)
        echo = await self.echoed_prompts(body.prompt, prompts) if body.echo else None
        builder = CompletionBuilder(request_id, self.config.served_model_name, stream, params.n, prompts,
                                    self.tokenizer, params.logprobs, echo=echo, echo_only=body.echo_only)
        return await self.respond(stream, builder, body.stream, body.include_usage)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, self._chat_completions(body))

    async def _chat_completions(self, body: ChatCompletionRequest) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        max_tokens = body.output_token_limit
        params = await self.sampling_params(body, max_tokens, body.logprobs_per_token,
                                            {"max_tokens": body.max_tokens_param, "logprobs": "top_logprobs"})
        text = await self.render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                                      body.template_tools)
        # The template wrote its special tokens.
        prompt = await self._off_loop(lambda: self.tokenizer.encode(text, add_special_tokens=False))
        self.check_lengths([prompt], max_tokens, params.n, "messages", body.max_tokens_param)
        if self.reasoning_tags_dropped or (body.tool_mode == "auto" and self.tool_tags_dropped):
            # The parser reads tags that are special tokens: keep them in the text (as vLLM's mistral parser).
            params.skip_special_tokens = False
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.submit(request_id, [prompt], params, arrival, "messages", body.cache_salt)
        builder = ChatBuilder(request_id, self.config.served_model_name, stream, params.n, [prompt],
                              self.tokenizer, params.logprobs, tool_mode=body.tool_mode, tool_name=body.tool_name,
                              tool_parser=self.tool_parser, reasoning_parser=self.config.reasoning_parser)
        return await self.respond(stream, builder, body.stream, body.include_usage)

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, self._embeddings(body))

    async def _embeddings(self, body: EmbeddingRequest) -> Response:
        """OpenAI's /v1/embeddings: each input's final hidden states pooled (engine/pooling_params.py), through
        the same admission, engine thread and abort-on-disconnect as completions."""
        arrival = time.monotonic()
        self.check_model(body.model)
        params = body.pooling_params()
        prompts = await self.embedding_inputs(body.input)
        request_id = f"embd-{uuid.uuid4().hex}"
        stream = await self.submit(request_id, prompts, params, arrival, "input")
        index = {rid: i for i, rid in enumerate(stream.request_ids)}
        embeddings: list[list[float]] = [[] for _ in prompts]
        try:
            async for output in stream:
                embeddings[index[output.request_id]] = output.outputs.embedding
        finally:
            stream.close()
        return JSONResponse(embedding_response(self.config.served_model_name, embeddings,
                                               sum(len(p) for p in prompts), body.encoding_format))

    async def embedding_inputs(self, inputs) -> list[list[int]]:
        """An embeddings request's `input` as token ids per input, each at most max_model_len tokens (an embedding
        generates nothing: the whole context is the input's), as many as admission can queue; else a 400."""
        prompts = await self.prompt_token_ids(inputs, "input")
        if self.config.max_waiting is not None and len(prompts) > self.config.max_waiting:
            raise bad_request(f"{len(prompts)} inputs in one request, but this server queues at most "
                              f"{self.config.max_waiting} (max_waiting): send fewer per request", "input")
        for prompt in prompts:
            if len(prompt) > self.max_model_len:
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                  f"an input has {len(prompt)} tokens.", "input")
        return prompts

    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "ferry", "root": self.model_root, "max_model_len": self.max_model_len}]}

    async def health(self) -> Response:
        if not self.engine_loop.is_alive:
            return as_api_error(EngineUnavailable("the engine is not running")).response()
        return Response(status_code=200)

    async def reset_prefix_cache(self) -> Response:
        """vLLM's POST /reset_prefix_cache: forget every cached block; refused (409) while requests hold some."""
        if not await self.engine_loop.call(lambda engine: engine.reset_prefix_cache()):
            raise APIError(409, "cached blocks are in use by running requests; retry when they finish",
                           type="invalid_request_error", code="prefix_cache_in_use")
        return Response(status_code=200)

    async def start_profile(self) -> Response:
        """vLLM's POST /start_profile: a jax.profiler trace of the whole process (the engine thread's steps
        included) until /stop_profile; 409 if one is running."""
        async with self._profile_lock:
            if self._profiling:
                raise APIError(409, "a profile is already running: POST /stop_profile first", code="profile_running")
            try:
                await asyncio.to_thread(jax.profiler.start_trace, self.config.profiler_dir)
            except RuntimeError as e:  # one started outside the server
                raise APIError(409, f"cannot start a profile: {e}", code="profile_running") from None
            self._profiling = True
            log.info("profiling into %s", self.config.profiler_dir)
        return Response(status_code=200)

    async def stop_profile(self) -> Response:
        """vLLM's POST /stop_profile: write the trace (under profiler_dir/plugins/profile/); 409 if none runs."""
        async with self._profile_lock:
            if not self._profiling:
                raise APIError(409, "no profile is running: POST /start_profile first", code="profile_not_running")
            try:
                await asyncio.to_thread(jax.profiler.stop_trace)
            finally:
                self._profiling = False
            log.info("profile written to %s", self.config.profiler_dir)
        return Response(status_code=200)

    async def prometheus_metrics(self) -> Response:
        content, content_type = self.metrics.render()
        return Response(content, media_type=content_type)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            text = await self.render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
            add_special_tokens = bool(body.add_special_tokens)  # default off: the template wrote them
        else:
            text = body.prompt
            self.check_prompt_chars(len(text), "prompt")
            add_special_tokens = body.add_special_tokens is not False
        tokenizer = self.require_tokenizer("prompt")
        tokens = await self._off_loop(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
        token_strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                "token_strs": token_strs}

    async def tokenizer_info(self) -> dict:
        """vLLM's GET /tokenizer_info: what a client needs to tokenize as the server does (lm-evaluation-harness's
        remote tokenizer reads it, then calls /tokenize)."""
        tokenizer = self.require_tokenizer("model")
        return {"tokenizer_class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
                "model_max_length": self.max_model_len, "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
                "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id, "chat_template": tokenizer.chat_template}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        tokenizer = self.require_tokenizer("tokens")
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})",
                              "tokens")
        return {"prompt": await self._off_loop(tokenizer.decode, body.tokens)}


class _ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every path but /health and /metrics. Plain ASGI (not
    BaseHTTPMiddleware) so streaming responses and disconnect detection pass through untouched."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in UNAUTHENTICATED_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                error = APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                                 param=None, code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """A 413 for request bodies over `max_bytes`, declared (Content-Length) or streamed (chunked). The body is
    read here, then replayed to the app; later receive() calls (disconnects) pass straight through."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than {self.max_bytes} bytes (max_request_bytes).",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            error = self._too_large() if declared.isdigit() else bad_request("invalid Content-Length header")
            return await error.response()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large().response()(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def build_app(engine: LLMEngine, config: ServerConfig,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The FastAPI app serving `engine`. Its lifespan starts and stops the engine thread, so run it under
    an ASGI server (uvicorn) that runs lifespans. `on_fatal` is called (on the engine thread) if the engine
    dies; the server should then exit non-zero."""
    server = OpenAIServer(engine, config, on_fatal)
    app = FastAPI(title="Ferry", lifespan=server.lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), param=None, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(EngineUnavailable)
    @app.exception_handler(RequestFailed)
    async def engine_error(_request, exc: Exception):  # logged where it happened
        return as_api_error(exc).response()

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        log.exception("unhandled error")
        return as_api_error(exc).response()

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", server.embeddings, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus_metrics, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", server.tokenizer_info, methods=["GET"])
    app.add_api_route("/reset_prefix_cache", server.reset_prefix_cache, methods=["POST"])
    if config.profiler_dir:  # behind the API key like every route
        app.add_api_route("/start_profile", server.start_profile, methods=["POST"])
        app.add_api_route("/stop_profile", server.stop_profile, methods=["POST"])
    if config.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(_BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.allowed_origins:
        # Outermost: a browser's preflight (OPTIONS, no credentials) is answered before the API key is asked
        # for, and every response (a 401, a 413) carries the CORS headers the browser needs to read it.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers))
    return app
