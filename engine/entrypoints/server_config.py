"""The server's settings, apart from engine/entrypoints/server.py: `ferry-serve` reads their defaults for its flags
before
it imports the server (FastAPI and the API models take about a second), which then loads beside the model."""

import dataclasses


@dataclasses.dataclass(slots=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None         # None: no authentication
    max_waiting: int | None = None     # requests admitted but not yet generating; None: unbounded
    log_interval_s: float = 5.0
    max_request_bytes: int = 16 << 20  # request bodies past this are a 413
    # checked before tokenizing; None: engine.entrypoints.server's PROMPT_CHARS_PER_TOKEN x max_model_len
    max_prompt_chars: int | None = None
    max_stop_strings: int = 64         # each is matched against every streamed token's text
    max_stop_chars: int = 1024         # per stop string
    shutdown_timeout_s: float = 30.0   # on SIGTERM, how long running requests may go on finishing
    # chat: a name in engine/entrypoints/reasoning.py's REASONING_PARSERS; None: the reasoning stays in content
    reasoning_parser: str | None = None
    # chat "auto" tool calls: a name in engine/entrypoints/tool_calls.py's TOOL_PARSERS; None: by the template
    tool_call_parser: str | None = None
    # CORS (Starlette's CORSMiddleware): origins allowed, or ("*",); None: no CORS headers at all
    allowed_origins: tuple[str, ...] | None = None
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    profiler_dir: str | None = None    # POST /start_profile, /stop_profile write jax.profiler traces here
