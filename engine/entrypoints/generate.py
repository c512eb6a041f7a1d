"""ferry-generate: offline generation from the command line.

    python -m engine.entrypoints.generate --model=DIR --prompt="def fib(n):" --prompt="The" --temperature=0 \
        --max_tokens=32
    python -m engine.entrypoints.generate --model=DIR --prompt="Once upon a time" --stream
    python -m engine.entrypoints.generate --model=DIR --input=prompts.jsonl --output=out.jsonl

--prompt (repeatable) prints each completion to stdout: the bare text for a single completion, else each
under a "--- prompt i, sample j (finish_reason) ---" header. --stream prints one prompt's text as it is
generated. --input reads JSONL, one request a line: {"prompt": "..."} or {"prompt_token_ids": [...]} or
{"messages": [...]} (always chat-templated), plus any SamplingParams field as a per-line override
({"max_tokens": 8, "temperature": 0, "seed": 3, "stop": ["\\n"]}) and an optional "id" echoed back.
--output (or stdout when --input is given without it) gets one JSON line per request, in input order:
{"id"?, "prompt", "prompt_token_ids", "outputs": [{"index", "text", "token_ids", "finish_reason",
"stop_reason", "logprobs"?}], "prompt_logprobs"?}; logprobs are {token id: logprob} per token.
--chat wraps text prompts in the tokenizer's chat template as a single user message.

Every engine and sampling setting is a flag (engine/entrypoints/cli_flags.py); bad flags or values exit with status 2.
"""

import dataclasses
import json
import sys

from absl import app, flags

from engine.entrypoints import cli_flags
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError

FLAGS = flags.FLAGS

cli_flags.define_model_flags()
cli_flags.define_engine_flags()
cli_flags.define_progress_flag()
cli_flags.define_sampling_flags()
flags.adopt_module_key_flags(cli_flags)  # --help lists the shared flags too
flags.DEFINE_multi_string("prompt", [], "a prompt to complete (repeatable)")
flags.DEFINE_boolean("stream", False, "print a single --prompt's completion as it is generated")
flags.DEFINE_string("input", None, "JSONL file of requests (see the module docstring)")
flags.DEFINE_string("output", None, "write JSONL results here (default with --input: stdout)")
flags.DEFINE_boolean("chat", False, "wrap text prompts in the tokenizer's chat template (one user message)")

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


class InputError(ValueError):
    """A request line that cannot be run; the message names the file and line."""


@dataclasses.dataclass(slots=True)
class GenerationRequest:
    """One prompt with its sampling parameters, as read from a flag or an input line."""

    params: SamplingParams
    prompt: str | None = None                  # text, as given (before any chat template)
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    request_id: object = None                  # an input line's "id", echoed back


# ------------------------------------------------------------------ reading requests

def requests_from_flags(params: SamplingParams) -> list[GenerationRequest]:
    if FLAGS.input is not None:
        return read_jsonl_requests(FLAGS.input, params)
    return [GenerationRequest(params, prompt=p) for p in FLAGS.prompt]


def read_jsonl_requests(path: str, defaults: SamplingParams) -> list[GenerationRequest]:
    return [parse_request(obj, defaults, where)
            for where, _, obj in cli_flags.read_jsonl_objects(path, "input", InputError)]


def parse_request(obj: dict, defaults: SamplingParams, where: str) -> GenerationRequest:
    """One JSONL object -> a request; unknown keys are an error (a misspelt override must not pass silently)."""
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise InputError(f"{where}: give exactly one of {', '.join(PROMPT_KEYS)}")
    unknown = set(obj) - SAMPLING_FIELDS - set(PROMPT_KEYS) - {"id"}
    if unknown:
        raise InputError(f"{where}: unknown keys {sorted(unknown)} (allowed: {', '.join(PROMPT_KEYS)}, id, and "
                         f"SamplingParams fields)")
    overrides = {k: v for k, v in obj.items() if k in SAMPLING_FIELDS}
    try:
        params = dataclasses.replace(defaults, **overrides)
    except SamplingParamsError as e:
        raise InputError(f"{where}: {e.field}: {e}") from None
    request = GenerationRequest(params, request_id=obj.get("id"))
    _set_prompt(request, given[0], obj[given[0]], where)
    return request


def _set_prompt(request: GenerationRequest, key: str, value, where: str):
    if key == "prompt" and isinstance(value, str):
        request.prompt = value
    elif key == "prompt_token_ids" and isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        request.prompt_token_ids = value
    elif key == "messages" and isinstance(value, list) and all(isinstance(m, dict) for m in value):
        request.messages = value
    else:
        expected = {"prompt": "a string", "prompt_token_ids": "a non-empty list of integers",
                    "messages": "a list of {role, content} objects"}[key]
        raise InputError(f"{where}: {key} must be {expected}")


# ------------------------------------------------------------------ prompts for the engine

def engine_prompt(request: GenerationRequest, tokenizer, chat: bool):
    """What LLM.generate takes: token ids, or text the engine encodes itself (BOS included)."""
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    if request.messages is None and not chat:
        return request.prompt
    if tokenizer is None:
        raise InputError("chat prompts need a tokenizer, and this model has none")
    messages = request.messages or [{"role": "user", "content": request.prompt}]
    return tokenizer.encode_chat(messages, add_generation_prompt=True)[1]


# ------------------------------------------------------------------ writing results

def result_record(request: GenerationRequest, output: RequestOutput) -> dict:
    record = {} if request.request_id is None else {"id": request.request_id}
    record["prompt"] = request.prompt if request.prompt is not None else output.prompt
    if request.messages is not None:
        record["messages"] = request.messages
    record["prompt_token_ids"] = output.prompt_token_ids
    record["outputs"] = [completion_record(c) for c in output.outputs]
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = [None if e is None else _json_logprobs(e) for e in output.prompt_logprobs]
    return record


def completion_record(completion) -> dict:
    record = {"index": completion.index, "text": completion.text, "token_ids": completion.token_ids,
              "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
    if completion.logprobs is not None:
        record["logprobs"] = [_json_logprobs(e) for e in completion.logprobs]
    return record


def _json_logprobs(entry: dict[int, float]) -> dict[str, float]:
    return {str(token): logprob for token, logprob in entry.items()}  # JSON keys are strings


def write_jsonl(records: list[dict], path: str | None):
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if path is None:
        sys.stdout.write(lines)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(lines)


def print_completions(outputs: list[RequestOutput]):
    """A single completion prints bare (pipe-friendly); several get a header each."""
    with_headers = len(outputs) > 1 or len(outputs[0].outputs) > 1
    for i, output in enumerate(outputs):
        for completion in output.outputs:
            if with_headers:
                print(f"--- prompt {i}, sample {completion.index} ({completion.finish_reason}) ---")
            print(completion.text)
            if completion.logprobs is not None:
                print("logprobs: " + json.dumps([_json_logprobs(e) for e in completion.logprobs]))


def stream_completion(llm: LLM, prompt, params: SamplingParams):
    """Drive the engine step by step, printing each text delta as it arrives."""
    engine = llm.engine
    engine.add_request(None, prompt, params)
    while engine.has_unfinished():
        for delta in engine.step():
            sys.stdout.write(delta.outputs[0].text)
            sys.stdout.flush()
    sys.stdout.write("\n")


# ------------------------------------------------------------------ main

def check_mode(argv: list[str], params: SamplingParams):
    """The flags that choose what to do must agree; say which do not."""
    if len(argv) > 1:
        cli_flags.exit_usage_error(f"unexpected arguments {argv[1:]} (prompts go in --prompt)")
    if FLAGS.input is None and not FLAGS.prompt:
        cli_flags.exit_usage_error("nothing to generate: pass --prompt=TEXT (repeatable) or --input=FILE.jsonl")
    if FLAGS.input is not None and FLAGS.prompt:
        cli_flags.exit_usage_error("pass either --prompt or --input, not both")
    if FLAGS.stream and (FLAGS.input is not None or FLAGS.output is not None or len(FLAGS.prompt) != 1
                         or params.n != 1):
        cli_flags.exit_usage_error("--stream takes exactly one --prompt, with --n=1 and no --input/--output")


def run(argv: list[str]):
    cli_flags.quiet_absl_logging()
    try:
        params = cli_flags.sampling_params_from_flags()
    except SamplingParamsError as e:
        cli_flags.exit_usage_error(f"--{e.field}: {e}")
    check_mode(argv, params)
    # Everything below fails on what the user gave (a file, a model directory, a prompt too long for the
    # model): ValueError and its kin (SamplingParamsError, ChatTemplateError, InputError) are usage errors.
    try:
        config = cli_flags.engine_config_from_flags()
        requests = requests_from_flags(params)
        llm = LLM(cli_flags.resolve_model_dir(FLAGS.model), config)
        prompts = [engine_prompt(r, llm.tokenizer, FLAGS.chat) for r in requests]
        if FLAGS.stream:
            stream_completion(llm, prompts[0], requests[0].params)
            return
        outputs = llm.generate(prompts, [r.params for r in requests], use_tqdm=FLAGS.progress)
    except (ValueError, FileNotFoundError) as e:
        cli_flags.exit_usage_error(str(e))
    if FLAGS.input is not None or FLAGS.output is not None:
        write_jsonl([result_record(r, o) for r, o in zip(requests, outputs)], FLAGS.output)
    else:
        print_completions(outputs)


def main(argv: list[str] | None = None):
    """The `ferry-generate` console script (argv: sys.argv when None)."""
    app.run(run, argv=argv, flags_parser=cli_flags.parse_flags_or_exit)


if __name__ == "__main__":
    main()
