"""ferry-serve: the OpenAI-compatible server (engine/server.py) on a model directory.

    python -m engine.serve --model=DIR [--host=127.0.0.1 --port=8000 --api_key=KEY --max_waiting=256]

Every EngineConfig field is a flag (engine/cli_flags.py; EngineConfig.seed is --engine_seed). Server flags:
--host, --port, --served_model_name, --api_key (default $FERRY_API_KEY), --max_waiting and
--log_interval_s; the engine flag --warmup defaults to lazy here. Once listening it prints the URL and a
curl line to try. Bad flags or values exit with status 2.
"""

import json
import logging
import os
import shlex

import uvicorn
from absl import app, flags

from engine import cli_flags
from engine.engine import LLMEngine
from engine.server import ServerConfig, build_app

FLAGS = flags.FLAGS

cli_flags.define_model_flags()
cli_flags.define_engine_flags()
flags.adopt_module_key_flags(cli_flags)  # --help lists the shared flags too
flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)")
flags.DEFINE_integer("port", 8000, "port to listen on", lower_bound=0, upper_bound=65535)
flags.DEFINE_string("served_model_name", None, "the model's name in the API; unset: the directory's name")
flags.DEFINE_string("api_key", None, "require `Authorization: Bearer <key>` on every endpoint but /health and "
                    "/metrics; unset: $FERRY_API_KEY if set, else no authentication")
flags.DEFINE_integer("max_waiting", None, "most requests admitted but not yet generating; past it 503 with "
                     "Retry-After; unset: unbounded", lower_bound=1)
# Greedy programs before listening, the sampling ones (slower to compile: ~2.5x) in the background.
FLAGS.set_default("warmup", "lazy")
flags.DEFINE_float("log_interval_s", 5.0, "seconds between throughput log lines", lower_bound=0.1)

log = logging.getLogger("ferry.serve")


def server_config_from_flags(model_dir: str) -> ServerConfig:
    name = FLAGS.served_model_name or os.path.basename(os.path.normpath(model_dir))
    # The environment variable is read here, not as the flag's default, so --help never prints the key.
    api_key = FLAGS.api_key or os.environ.get("FERRY_API_KEY") or None
    return ServerConfig(served_model_name=name, api_key=api_key, max_waiting=FLAGS.max_waiting,
                        log_interval_s=FLAGS.log_interval_s)


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


class _AnnouncingServer(uvicorn.Server):
    """Prints the banner once the socket is listening, not before."""

    def __init__(self, config: uvicorn.Config, message: str):
        super().__init__(config)
        self._message = message

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            print(self._message, flush=True)


def run(argv: list[str]):
    if len(argv) > 1:
        cli_flags.exit_usage_error(f"unexpected arguments {argv[1:]}")
    cli_flags.quiet_absl_logging()  # JAX's backend probing stays quiet; Ferry's own lines do not
    logging.getLogger("ferry").setLevel(logging.INFO)
    try:
        model_dir = cli_flags.resolve_model_dir(FLAGS.model)
        engine = LLMEngine(model_dir, cli_flags.engine_config_from_flags())
    except (ValueError, FileNotFoundError) as e:
        cli_flags.exit_usage_error(str(e))
    log.info("engine ready: max_model_len=%d, %d KV blocks of %d tokens", engine.max_model_len,
                engine.scheduler.block_pool.num_total, engine.config.block_size)
    config = server_config_from_flags(model_dir)
    uvicorn_config = uvicorn.Config(build_app(engine, config), host=FLAGS.host, port=FLAGS.port, log_level="info",
                                    timeout_graceful_shutdown=5)
    try:
        _AnnouncingServer(uvicorn_config, banner(config, FLAGS.host, FLAGS.port)).run()
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the Ctrl-C: exit quietly
        pass


def main(argv: list[str] | None = None):
    """The `ferry-serve` console script (argv: sys.argv when None)."""
    app.run(run, argv=argv, flags_parser=cli_flags.parse_flags_or_exit)


if __name__ == "__main__":
    main()
