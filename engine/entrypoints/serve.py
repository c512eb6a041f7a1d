"""ferry-serve: the OpenAI-compatible server (engine/entrypoints/server.py) on a model directory.

    python -m engine.entrypoints.serve --model=DIR [--host=127.0.0.1 --port=8000 --api_key=KEY --max_waiting=256]

Every EngineConfig field is a flag (engine/entrypoints/cli_flags.py; EngineConfig.seed is --engine_seed). Server flags:
--host, --port, --served_model_name, --api_key (default $FERRY_API_KEY), --max_waiting,
--log_interval_s, the request limits (--max_request_bytes, --max_prompt_chars, --max_stop_strings,
--max_stop_chars), --shutdown_timeout, chat's --reasoning_parser and --tool_call_parser, CORS's
--allowed_origins (--allowed_methods, --allowed_headers) and --profiler_dir. The engine flag --warmup
defaults to lazy here. Multi-host (engine/worker/multihost.py): --coordinator_address, --num_processes,
--process_id on every host; process 0 serves. Once listening it prints the URL and a curl line to try.

Exit status: 0 after a graceful shutdown (SIGTERM or Ctrl-C: stop accepting, let running requests finish
for up to --shutdown_timeout seconds, end the rest with an error; a second signal stops at once), 1 if the
engine died (so a supervisor restarts it), 2 for bad flags or values.
"""

import gc

if __name__ == "__main__":
    # Start-up (the imports below, the model) keeps nearly everything it allocates, so the cyclic collections
    # it would trigger find little and cost a share of a warm start. freeze_startup_heap turns it back on.
    gc.disable()

import asyncio  # noqa: E402 (the imports come after the line above, on purpose)
import concurrent.futures  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import uvicorn  # noqa: E402
from absl import app, flags  # noqa: E402

from engine.data_parallel import make_engine  # noqa: E402
from engine.entrypoints import cli_flags  # noqa: E402
from engine.entrypoints.reasoning import REASONING_PARSERS  # noqa: E402
from engine.entrypoints.server_config import ServerConfig  # noqa: E402
from engine.entrypoints.tool_calls import TOOL_PARSERS  # noqa: E402
from engine.llm_engine import freeze_startup_heap  # noqa: E402
from engine.worker import multihost  # noqa: E402
from models import hub  # noqa: E402

FLAGS = flags.FLAGS

cli_flags.define_model_flags()
cli_flags.define_engine_flags()
cli_flags.define_distributed_flags()
flags.adopt_module_key_flags(cli_flags)  # --help lists the shared flags too
flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)")
flags.DEFINE_integer("port", 8000, "port to listen on", lower_bound=0, upper_bound=65535)
flags.DEFINE_string("served_model_name", None, "the model's name in the API; unset: the directory's name")
flags.DEFINE_string("api_key", None, "require `Authorization: Bearer <key>` on every endpoint but /health and "
                    "/metrics; unset: $FERRY_API_KEY if set, else no authentication")
flags.DEFINE_integer("max_waiting", None, "most requests admitted but not yet generating; past it 503 with "
                     "Retry-After; unset: unbounded", lower_bound=1)
# Before listening, each sampler's largest decode and prefill program (any step can pad up to them); the
# rest in the background.
FLAGS.set_default("warmup", "lazy")
flags.DEFINE_float("log_interval_s", 5.0, "seconds between throughput log lines", lower_bound=0.1)
_DEFAULTS = ServerConfig(served_model_name="")  # slots: defaults live on instances, not the class
flags.DEFINE_integer("max_request_bytes", _DEFAULTS.max_request_bytes, "larger request bodies get a 413",
                     lower_bound=1)
flags.DEFINE_integer("max_prompt_chars", None, "longer prompts (or chat messages) get a 400 before tokenizing; "
                     "unset: 64 x max_model_len", lower_bound=1)
flags.DEFINE_integer("max_stop_strings", _DEFAULTS.max_stop_strings, "most stop strings per request",
                     lower_bound=0)
flags.DEFINE_integer("max_stop_chars", _DEFAULTS.max_stop_chars, "longest stop string", lower_bound=1)
flags.DEFINE_float("shutdown_timeout", _DEFAULTS.shutdown_timeout_s, "on SIGTERM/SIGINT, seconds running "
                   "requests may go on finishing before they are ended with an error", lower_bound=0)
flags.DEFINE_enum("reasoning_parser", None, sorted(REASONING_PARSERS), "chat: move the model's thinking out of "
                  "content into reasoning_content (as vLLM's --reasoning-parser); unset: left in content")
flags.DEFINE_enum("tool_call_parser", None, sorted(TOOL_PARSERS), "chat: the format of the model's own tool "
                  "calls (tool_choice auto); unset: chosen from the chat template, else hermes")
flags.DEFINE_list("allowed_origins", None, "CORS: comma-separated origins allowed, or *; unset: no CORS headers")
flags.DEFINE_list("allowed_methods", list(_DEFAULTS.allowed_methods), "CORS: methods allowed (with "
                  "--allowed_origins)")
flags.DEFINE_list("allowed_headers", list(_DEFAULTS.allowed_headers), "CORS: request headers allowed (with "
                  "--allowed_origins)")
flags.DEFINE_string("profiler_dir", None, "serve POST /start_profile and /stop_profile, which write a "
                    "jax.profiler trace into this directory; unset: no such routes")

log = logging.getLogger("ferry.serve")


def server_config_from_flags(model_dir: str) -> ServerConfig:
    # The name the user gave (`smollm2`, a directory's name, a repo id as vLLM), not the file it resolves to.
    given = FLAGS.model if hub.is_repo_id(FLAGS.model) else os.path.basename(os.path.normpath(FLAGS.model))
    name = FLAGS.served_model_name or given.removesuffix(".gguf")
    # The environment variable is read here, not as the flag's default, so --help never prints the key.
    api_key = FLAGS.api_key or os.environ.get("FERRY_API_KEY") or None
    return ServerConfig(served_model_name=name, api_key=api_key, max_waiting=FLAGS.max_waiting,
                        log_interval_s=FLAGS.log_interval_s, max_request_bytes=FLAGS.max_request_bytes,
                        max_prompt_chars=FLAGS.max_prompt_chars, max_stop_strings=FLAGS.max_stop_strings,
                        max_stop_chars=FLAGS.max_stop_chars, shutdown_timeout_s=FLAGS.shutdown_timeout,
                        reasoning_parser=FLAGS.reasoning_parser, tool_call_parser=FLAGS.tool_call_parser,
                        allowed_origins=tuple(FLAGS.allowed_origins) if FLAGS.allowed_origins else None,
                        allowed_methods=tuple(FLAGS.allowed_methods), allowed_headers=tuple(FLAGS.allowed_headers),
                        profiler_dir=FLAGS.profiler_dir)


def banner(config: ServerConfig, host: str, port: int) -> str:
    """The URL and a curl line to paste (the key by reference: secrets stay out of logs)."""
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # a wildcard is not an address to call
    url_host = f"[{url_host}]" if ":" in url_host else url_host
    base = f"http://{url_host}:{port}"
    body = {"model": config.served_model_name, "prompt": "Hello, my name is", "max_tokens": 16}
    auth = ' -H "Authorization: Bearer $FERRY_API_KEY"' if config.api_key else ""
    return (f"Ferry is serving {config.served_model_name!r} at {base}/v1\n"
            f"Try: curl {base}/v1/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(json.dumps(body))}")


class FerryServer(uvicorn.Server):
    """uvicorn with Ferry's lifecycle: prints the banner once the socket is listening; the first SIGTERM or
    SIGINT drains (OpenAIServer.drain) before uvicorn shuts down, a second one stops at once; an engine that
    died makes it exit with status 1."""

    def __init__(self, config: uvicorn.Config, message: str):
        super().__init__(config)
        self._message = message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.engine_died = False

    async def startup(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            print(self._message, flush=True)

    def handle_exit(self, sig, frame):
        if self._draining or self._loop is None:  # a second signal, or before start-up: uvicorn's own way
            return super().handle_exit(sig, frame)
        self._draining = True  # not recorded as captured: uvicorn would re-raise it at exit (status 143)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self):
        try:
            await self.config.app.state.server.drain()
        finally:
            self.should_exit = True

    def on_engine_death(self, _error: BaseException) -> None:
        """Called on the engine thread: the readers have their errors; stop serving and exit non-zero."""
        self.engine_died = True
        self.should_exit = True


def run(argv: list[str]):
    if len(argv) > 1:
        cli_flags.exit_usage_error(f"unexpected arguments {argv[1:]}")
    cli_flags.quiet_absl_logging()  # JAX's backend probing stays quiet; Ferry's own lines do not
    logging.getLogger("ferry").setLevel(logging.INFO)
    # The server's imports (FastAPI, the API models) load beside the model and the engine.
    importer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="server-import")
    server_module = importer.submit(importlib.import_module, "engine.entrypoints.server")
    importer.shutdown(wait=False)
    try:
        model_dir = cli_flags.resolve_model_dir(FLAGS.model)
        engine_config = cli_flags.engine_config_from_flags()
        distributed = cli_flags.distributed_config_from_flags()
        if multihost.initialize(distributed) and engine_config.data_parallel_size > 1:
            raise ValueError("--data_parallel_size > 1 is not supported across processes: run one job per replica")
        engine = make_engine(model_dir, engine_config)
    except (ValueError, FileNotFoundError) as e:
        cli_flags.exit_usage_error(str(e))
    freeze_startup_heap()  # this process serves this engine to the end
    channel = multihost.CallChannel() if jax.process_count() > 1 else None
    if channel is not None and jax.process_index() > 0:
        log.info("process %d follows process 0 (which serves)", jax.process_index())
        multihost.follow(engine.runner, channel)
        return
    if channel is not None:
        multihost.lead(engine, channel)
    log.info("engine ready: max_model_len=%d, %d KV blocks of %d tokens", engine.max_model_len,
                engine.num_kv_blocks, engine.config.block_size)
    config = server_config_from_flags(model_dir)
    uvicorn_config = uvicorn.Config(None, host=FLAGS.host, port=FLAGS.port, log_level="info",
                                    timeout_graceful_shutdown=5)
    server = FerryServer(uvicorn_config, banner(config, FLAGS.host, FLAGS.port))
    uvicorn_config.app = server_module.result().build_app(engine, config, on_fatal=server.on_engine_death)
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C stopped it at once: exit quietly
        pass
    finally:
        if channel is not None:
            channel.close()  # the followers exit too
    if server.engine_died:
        log.error("the engine died; exiting with status 1 so a supervisor can restart the server")
        sys.exit(1)


def main(argv: list[str] | None = None):
    """The `ferry-serve` console script (argv: sys.argv when None)."""
    app.run(run, argv=argv, flags_parser=cli_flags.parse_flags_or_exit)


if __name__ == "__main__":
    main()
