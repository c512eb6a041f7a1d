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
