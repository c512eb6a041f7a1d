"""A batched evaluation through the offline engine: multiple choice, exact-match generation, perplexity.

    python scripts/eval_tasks.py --model=DIR --tasks=tests/data/tiny_task.jsonl [--json_out=results.json]

The task file is JSONL, one item a line, of three types:

  {"type": "loglikelihood", "context": "...", "choices": ["...", ...], "answer": 1}
      Multiple choice by log-likelihood: one request per choice, prompt = context + choice, scored by the
      sum of the prompt logprobs of the choice's tokens (acc); acc_norm divides by the choice's UTF-8 bytes.
      As lm-eval-harness, trailing whitespace of the context moves to the choice, and context and choice
      are encoded separately (context with BOS, choice without) and their ids concatenated, so the
      choice's tokens are exactly its own encoding whatever merges the joined text would have.
  {"type": "generate", "prompt": "...", "target": "...", "max_tokens": 16, "stop": ["\\n"]}
      Greedy generation; exact match of the text and the target after strip().
  {"type": "perplexity", "text": "..."}
      The negative log-likelihood of every token after the first (the first is BOS where the tokenizer
      adds one); the type's perplexity is exp(total nll / total tokens) over all its items.

Every request of the file goes through one LLM.generate call, so they are continuously batched together.
The table gives, per type, the metric and the throughput: requests/s and tokens/s (prompt + generated)
over the type's wall time (start of the call to its last request's finish; types overlap in time, so
their rates do not add up), and the same for the whole call. --json_out writes the summary and
per-item results (scores, token counts, texts).
"""

import dataclasses
import json
import math
import time

from absl import app, flags

from engine.entrypoints import cli_flags
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

FLAGS = flags.FLAGS

cli_flags.define_model_flags()
cli_flags.define_engine_flags()
cli_flags.define_progress_flag()
flags.adopt_module_key_flags(cli_flags)
flags.DEFINE_string("tasks", None, "JSONL task file (see the module docstring)")
flags.DEFINE_string("json_out", None, "write the results here as JSON")
flags.DEFINE_integer("max_gen_tokens", 16, "max_tokens of generate items that give none", lower_bound=1)

TASK_TYPES = ("loglikelihood", "generate", "perplexity")
METRIC = {"loglikelihood": "acc", "generate": "exact_match", "perplexity": "perplexity"}
# Scoring requests only need their prompt's logprobs; the one token they must generate is thrown away.
# prompt_logprobs=1 also returns each position's top token, which tells whether the choice is greedy.
SCORING = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)


class TaskError(ValueError):
    """A task line that cannot be evaluated; the message names the file and line."""


@dataclasses.dataclass(slots=True)
class Task:
    kind: str
    line: int
    spec: dict


@dataclasses.dataclass(slots=True)
class EvalRequest:
    """One engine request: which task it serves and where its scored tokens start."""

    task: int                   # index into the task list
    prompt: str | list[int]
    params: SamplingParams
    score_from: int = 0         # first prompt position whose logprob counts (scoring requests)


# ------------------------------------------------------------------ reading tasks

def read_tasks(path: str) -> list[Task]:
    return [parse_task(spec, number, where)
            for where, number, spec in cli_flags.read_jsonl_objects(path, "tasks", TaskError)]


def parse_task(spec: dict, number: int, where: str) -> Task:
    if spec.get("type") not in TASK_TYPES:
        raise TaskError(f"{where}: expected an object with \"type\" one of {', '.join(TASK_TYPES)}")
    _check_fields(spec, where)
    return Task(spec["type"], number, spec)


def _check_fields(spec: dict, where: str):
    kind = spec["type"]

    def require(ok: bool, message: str):
        if not ok:
            raise TaskError(f"{where}: {kind}: {message}")

    if kind == "loglikelihood":
        choices = spec.get("choices")
        require(isinstance(spec.get("context"), str), "\"context\" must be a string")
        require(isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices),
                "\"choices\" must be a list of two or more non-empty strings")
        answer = spec.get("answer")
        require(isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices),
                "\"answer\" must be the index of the right choice")
    elif kind == "generate":
        require(isinstance(spec.get("prompt"), str) and spec["prompt"], "\"prompt\" must be a non-empty string")
        require(isinstance(spec.get("target"), str), "\"target\" must be a string")
    else:
        require(isinstance(spec.get("text"), str) and spec["text"], "\"text\" must be a non-empty string")


# ------------------------------------------------------------------ building requests

def build_requests(tasks: list[Task], tokenizer, max_gen_tokens: int) -> list[EvalRequest]:
    requests = []
    for i, task in enumerate(tasks):
        where = f"line {task.line}"
        if task.kind == "loglikelihood":
            requests += choice_requests(i, task.spec, tokenizer, where)
        elif task.kind == "generate":
            requests.append(generation_request(i, task.spec, max_gen_tokens, where))
        else:
            requests.append(perplexity_request(i, task.spec["text"], tokenizer, where))
    return requests


def choice_requests(task: int, spec: dict, tokenizer, where: str) -> list[EvalRequest]:
    requests = []
    for choice in spec["choices"]:
        context_ids, choice_ids = encode_pair(tokenizer, spec["context"], choice, where)
        requests.append(EvalRequest(task, context_ids + choice_ids, SCORING, score_from=len(context_ids)))
    return requests


def encode_pair(tokenizer, context: str, continuation: str, where: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval-harness: the context's trailing whitespace moves to the
    continuation (BPE vocabularies hold " word", not "word"), then each part is encoded on its own."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    context_ids = tokenizer.encode(stripped)  # with BOS where the tokenizer adds one
    if not context_ids:  # an empty context and no BOS: something must predict the first choice token
        context_ids = [_prefix_token(tokenizer, where)]
    return context_ids, tokenizer.encode(continuation, add_special_tokens=False)


def _prefix_token(tokenizer, where: str) -> int:
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise TaskError(f"{where}: an empty context needs a BOS or EOS token to condition on; the tokenizer "
                        f"has neither")
    return token


def generation_request(task: int, spec: dict, max_gen_tokens: int, where: str) -> EvalRequest:
    try:
        params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", max_gen_tokens),
                                stop=spec.get("stop", []))
    except ValueError as e:
        raise TaskError(f"{where}: generate: {e}") from None
    return EvalRequest(task, spec["prompt"], params)


def perplexity_request(task: int, text: str, tokenizer, where: str) -> EvalRequest:
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise TaskError(f"{where}: perplexity: the text is {len(ids)} token(s); at least 2 are needed")
    return EvalRequest(task, ids, SCORING, score_from=1)


# ------------------------------------------------------------------ scoring

def prompt_logprob_sum(output: RequestOutput, score_from: int) -> tuple[float, int, bool]:
    """(sum of the logprobs of the prompt tokens from `score_from` on, how many, all of them greedy?)"""
    ids, entries = output.prompt_token_ids, output.prompt_logprobs
    total, greedy = 0.0, True
    for position in range(score_from, len(ids)):
        entry = entries[position]
        logprob = entry[ids[position]]
        total += logprob
        greedy = greedy and logprob >= max(entry.values())
    return total, len(ids) - score_from, greedy


def score_items(tasks: list[Task], requests: list[EvalRequest], outputs: list[RequestOutput]) -> list[dict]:
    by_task: dict[int, list[tuple[EvalRequest, RequestOutput]]] = {}
    for request, output in zip(requests, outputs):
        by_task.setdefault(request.task, []).append((request, output))
    scorers = {"loglikelihood": score_choices, "generate": score_generation, "perplexity": score_perplexity}
    return [scorers[task.kind](task, by_task[i]) for i, task in enumerate(tasks)]


def score_choices(task: Task, pairs) -> dict:
    spec = task.spec
    sums = [prompt_logprob_sum(output, request.score_from) for request, output in pairs]
    scores = [s for s, _, _ in sums]
    normalised = [s / len(choice.encode("utf-8")) for s, choice in zip(scores, spec["choices"])]
    prediction = _argmax(scores)
    prediction_norm = _argmax(normalised)
    return {"type": task.kind, "line": task.line, "context": spec["context"], "choices": spec["choices"],
            "answer": spec["answer"], "scores": scores, "num_tokens": [n for _, n, _ in sums],
            "is_greedy": [g for _, _, g in sums], "prediction": prediction, "correct": prediction == spec["answer"],
            "prediction_norm": prediction_norm, "correct_norm": prediction_norm == spec["answer"]}


def score_generation(task: Task, pairs) -> dict:
    (_, output), = pairs
    completion = output.outputs[0]
    target = task.spec["target"]
    return {"type": task.kind, "line": task.line, "prompt": task.spec["prompt"], "target": target,
            "text": completion.text, "finish_reason": completion.finish_reason,
            "correct": completion.text.strip() == target.strip()}


def score_perplexity(task: Task, pairs) -> dict:
    (request, output), = pairs
    logprob, tokens, _ = prompt_logprob_sum(output, request.score_from)
    return {"type": task.kind, "line": task.line, "num_tokens": tokens, "nll": -logprob,
            "perplexity": math.exp(-logprob / tokens)}


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


# ------------------------------------------------------------------ summary

def summarize(items: list[dict], requests: list[EvalRequest], outputs: list[RequestOutput],
              started: float, wall_s: float) -> dict:
    """Per type: its metric and throughput; "all": the whole call's throughput."""
    kinds = [items[r.task]["type"] for r in requests]
    summary = {}
    for kind in TASK_TYPES:
        of_kind = [item for item in items if item["type"] == kind]
        if not of_kind:
            continue
        served = [o for k, o in zip(kinds, outputs) if k == kind]
        finished = max(o.metrics["finished_time"] for o in served)
        summary[kind] = {"count": len(of_kind), **metrics_of(kind, of_kind),
                         **throughput(served, finished - started)}
    summary["all"] = {"count": len(items), **throughput(outputs, wall_s)}
    return summary


def metrics_of(kind: str, items: list[dict]) -> dict:
    if kind == "loglikelihood":
        return {"acc": _mean(i["correct"] for i in items), "acc_norm": _mean(i["correct_norm"] for i in items)}
    if kind == "generate":
        return {"exact_match": _mean(i["correct"] for i in items)}
    tokens = sum(i["num_tokens"] for i in items)
    nll = sum(i["nll"] for i in items)
    return {"tokens": tokens, "nll": nll, "perplexity": math.exp(nll / tokens)}


def throughput(outputs: list[RequestOutput], wall_s: float) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    wall_s = max(wall_s, 1e-9)
    return {"requests": len(outputs), "prompt_tokens": prompt_tokens, "generated_tokens": generated,
            "wall_s": wall_s, "requests_per_s": len(outputs) / wall_s,
            "tokens_per_s": (prompt_tokens + generated) / wall_s}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def format_table(summary: dict) -> str:
    header = f"{'type':<14} {'items':>5} {'metric':<12} {'value':>10} {'requests':>8} {'req/s':>9} " \
             f"{'tok/s':>10} {'wall s':>8}"
    rows = [header, "-" * len(header)]
    for kind, s in summary.items():
        metric = METRIC.get(kind, "")
        value = f"{s[metric]:.4f}" if metric else ""
        rows.append(f"{kind:<14} {s['count']:>5} {metric:<12} {value:>10} {s['requests']:>8} "
                    f"{s['requests_per_s']:>9.2f} {s['tokens_per_s']:>10.1f} {s['wall_s']:>8.2f}")
    return "\n".join(rows)


# ------------------------------------------------------------------ main

def evaluate(llm: LLM, tasks: list[Task], max_gen_tokens: int = 16, use_tqdm: bool = False) -> dict:
    """Run every task through one LLM.generate call; {"summary": ..., "items": [...]}."""
    if llm.tokenizer is None:
        raise TaskError("the model has no tokenizer; tasks are text")
    requests = build_requests(tasks, llm.tokenizer, max_gen_tokens)
    started = time.monotonic()  # the clock of RequestOutput.metrics
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests], use_tqdm=use_tqdm)
    wall_s = time.monotonic() - started
    items = score_items(tasks, requests, outputs)
    return {"summary": summarize(items, requests, outputs, started, wall_s), "items": items}


def run(argv: list[str]):
    cli_flags.quiet_absl_logging()
    if len(argv) > 1:
        cli_flags.exit_usage_error(f"unexpected arguments {argv[1:]}")
    if FLAGS.tasks is None:
        cli_flags.exit_usage_error("pass --tasks=FILE.jsonl")
    try:
        tasks = read_tasks(FLAGS.tasks)
        config = cli_flags.engine_config_from_flags()
        model_dir = cli_flags.resolve_model_dir(FLAGS.model)
        llm = LLM(model_dir, config)
        results = evaluate(llm, tasks, FLAGS.max_gen_tokens, use_tqdm=FLAGS.progress)
    except (ValueError, FileNotFoundError) as e:
        cli_flags.exit_usage_error(str(e))
    print(format_table(results["summary"]))
    if FLAGS.json_out:
        results = {"model": model_dir, "tasks": FLAGS.tasks, "engine_config": dataclasses.asdict(config),
                   **results}
        with open(FLAGS.json_out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, ensure_ascii=False)


def main(argv: list[str] | None = None):
    app.run(run, argv=argv, flags_parser=cli_flags.parse_flags_or_exit)


if __name__ == "__main__":
    main()
