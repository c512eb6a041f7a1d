"""lm-evaluation-harness against Ferry: its `local-completions` (echo + logprobs), `local-chat-completions` and the
offline `ferry` model (engine/entrypoints/eval_harness.py), each on small local tasks (multiple choice, generation,
rolling perplexity), against lm-eval's `hf` model on the same float32 checkpoint: log-likelihoods within 2e-3,
the same accuracy, the same generations."""

import json
import random
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from engine.entrypoints.eval_harness import FerryLM  # noqa: E402
from engine.entrypoints.server import ServerConfig  # noqa: E402
from helpers.hf_models import make_text_model  # noqa: E402
from helpers.repo import ROOT as REPO_ROOT  # noqa: E402
from helpers.server_harness import CHAT_TEMPLATE, ENGINE, MODEL_NAME, WORDS, serve  # noqa: E402

LL_TOL = 2e-3
TASKS = ["ferry_mc", "ferry_gen", "ferry_ppl"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _write_tasks(root) -> str:
    """Three lm-eval tasks over local JSON lines: multiple choice (acc), generation (exact match), perplexity."""
    rng = random.Random(0)
    data = {
        "mc": [{"question": _words(rng, 6), "choices": [" " + _words(rng, rng.randint(1, 3)) for _ in range(4)],
                "answer": rng.randrange(4)} for _ in range(10)],
        "gen": [{"prompt": _words(rng, 5), "target": _words(rng, 2)} for _ in range(4)],
        "ppl": [{"text": _words(rng, 12)} for _ in range(3)],
    }
    for name, rows in data.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "mc.yaml").write_text(
        f"task: ferry_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (root / "gen.yaml").write_text(
        f"task: ferry_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    (root / "ppl.yaml").write_text(
        f"task: ferry_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: '{{text}}'\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    return str(root)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_text_model(tmp_path_factory, seed=3, chat_template=CHAT_TEMPLATE)[0]


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> str:
    return _write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def task_manager(tasks_dir) -> TaskManager:
    return TaskManager(include_path=tasks_dir)


def _evaluate(model, task_manager, tasks=TASKS, **kwargs) -> dict:
    return simple_evaluate(model=model, tasks=tasks, task_manager=task_manager, log_samples=True,
                           batch_size=1, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                           torch_random_seed=0, fewshot_random_seed=0, **kwargs)


def _responses(results: dict, task: str) -> list:
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def _hf(model_dir, task_manager, **model_args) -> dict:
    """lm-eval's own transformers model on the checkpoint."""
    return _evaluate("hf", task_manager, model_args={"pretrained": model_dir, "dtype": "float32", **model_args},
                     device="cpu")


@pytest.fixture(scope="module")
def reference(model_dir, task_manager) -> dict:
    return _hf(model_dir, task_manager)


@pytest.fixture(scope="module")
def reference_without_bos(model_dir, task_manager) -> dict:
    """lm-eval's API models tokenize without the tokenizer's BOS; its hf model adds it unless told not to."""
    return _hf(model_dir, task_manager, add_bos_token=False)


def _assert_matches(results: dict, reference: dict, tasks=TASKS) -> None:
    for task in tasks:
        ours, ref = _responses(results, task), _responses(reference, task)
        assert len(ours) == len(ref) > 0, task
        for got, want in zip(ours, ref):
            if task == "ferry_gen":
                assert got == want, task
                continue
            got_lls = [r[0] if isinstance(r, list | tuple) else r for r in got]
            want_lls = [r[0] if isinstance(r, list | tuple) else r for r in want]
            assert max(abs(float(a) - float(b)) for a, b in zip(got_lls, want_lls)) < LL_TOL, (task, got, want)
        for metric, value in reference["results"][task].items():
            if metric.endswith(",none") and "stderr" not in metric:
                assert results["results"][task][metric] == pytest.approx(value, rel=1e-3), (task, metric)


def test_the_offline_ferry_model_matches_lm_evals_hf_model(model_dir, task_manager, reference):
    lm = FerryLM(pretrained=model_dir, **ENGINE)
    _assert_matches(_evaluate(lm, task_manager), reference)


def test_local_completions_and_chat_against_the_server(model_dir, task_manager, reference_without_bos):
    with serve(model_dir, ServerConfig(MODEL_NAME)) as server:
        # The tokenizer comes from the server (/tokenizer_info, /tokenize): nothing but the URL on the client.
        # lm-eval's remote tokenizer takes `bos_token_id or eos_token_id` as the rolling windows' prefix, which
        # is EOS for this tokenizer's BOS id 0: the prefix is given, as the hf model takes it.
        args = {"model": MODEL_NAME, "base_url": server.url + "/v1/completions", "tokenized_requests": True,
                "num_concurrent": 2, "max_retries": 1, "custom_prefix_token_id": 0}
        _assert_matches(_evaluate("local-completions", task_manager, model_args=args), reference_without_bos)
        chat_args = {"model": MODEL_NAME, "base_url": server.url + "/v1/chat/completions", "num_concurrent": 2,
                     "max_retries": 1}
        chat = _evaluate("local-chat-completions", task_manager, ["ferry_gen"], model_args=chat_args,
                         apply_chat_template=True)
        server.settle()
    offline = _evaluate(FerryLM(pretrained=model_dir, **ENGINE), task_manager, ["ferry_gen"],
                        apply_chat_template=True)
    assert _responses(chat, "ferry_gen") == _responses(offline, "ferry_gen")


def test_the_command_line_runs_a_task_with_the_ferry_model(model_dir, tasks_dir, tmp_path, reference):
    """`python -m engine.entrypoints.eval_harness` (`ferry-lm-eval`) is lm-eval's command line with `--model ferry`."""
    engine_args = ",".join(f"{k}={v}" for k, v in ENGINE.items())
    command = [sys.executable, "-m", "engine.entrypoints.eval_harness", "run", "--model", "ferry",
               "--model_args", f"pretrained={model_dir},{engine_args}", "--tasks", "ferry_mc",
               "--include_path", tasks_dir, "--output_path", str(tmp_path)]
    subprocess.run(command, check=True, cwd=REPO_ROOT, timeout=600, capture_output=True)
    (results,) = tmp_path.rglob("results_*.json")
    acc = json.loads(results.read_text())["results"]["ferry_mc"]["acc,none"]
    assert acc == pytest.approx(reference["results"]["ferry_mc"]["acc,none"])
