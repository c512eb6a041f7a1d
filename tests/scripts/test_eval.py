"""scripts/eval_tasks.py on tests/data/tiny_task.jsonl: its log-likelihoods and perplexities equal
transformers' log_softmax over the same token ids; exact match equals LLM.generate's greedy text against
the targets; every request goes through one LLM.generate call; the JSON has every field."""

import importlib.util
import json
import math

import numpy as np
import pytest
import torch
from absl import flags

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from helpers.hf_models import hf_logits, make_text_model
from helpers.repo import ROOT as REPO_ROOT
from models.tokenizers.load import load_tokenizer

ROOT = REPO_ROOT
TASKS = ROOT / "tests" / "data" / "tiny_task.jsonl"
FLAGS = flags.FLAGS
CONFIG = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=128)
SUMMARY_FIELDS = {
    "loglikelihood": {"count", "acc", "acc_norm"},
    "generate": {"count", "exact_match"},
    "perplexity": {"count", "tokens", "nll", "perplexity"},
    "all": {"count"},
}
THROUGHPUT_FIELDS = {"requests", "prompt_tokens", "generated_tokens", "wall_s", "requests_per_s", "tokens_per_s"}
ITEM_FIELDS = {
    "loglikelihood": {"type", "line", "context", "choices", "answer", "scores", "num_tokens", "is_greedy",
                      "prediction", "correct", "prediction_norm", "correct_norm"},
    "generate": {"type", "line", "prompt", "target", "text", "finish_reason", "correct"},
    "perplexity": {"type", "line", "num_tokens", "nll", "perplexity"},
}


@pytest.fixture(scope="module")
def eval_tasks():
    spec = importlib.util.spec_from_file_location("eval_tasks", ROOT / "scripts" / "eval_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(model dir, torch model): a random llama over the byte-level BPE test tokenizer."""
    return make_text_model(tmp_path_factory, seed=5)


def _task_lines() -> list[dict]:
    return [json.loads(line) for line in TASKS.read_text(encoding="utf-8").splitlines() if line.strip()]


def _run_main(eval_tasks, *args) -> int:
    """The script's absl main in-process; the global flags go back to unparsed defaults afterwards."""
    FLAGS.unparse_flags()
    try:
        eval_tasks.main(["eval_tasks.py", "--noprogress", *args])
        return 0
    except SystemExit as e:
        return e.code or 0
    finally:
        FLAGS.unparse_flags()


@pytest.fixture(scope="module")
def greedy_texts(model):
    """LLM.generate's greedy text for every generate task, in file order."""
    llm = LLM(model[0], EngineConfig(**CONFIG))
    lines = [t for t in _task_lines() if t["type"] == "generate"]
    params = [SamplingParams(temperature=0.0, max_tokens=t.get("max_tokens", 16), stop=t.get("stop", []))
              for t in lines]
    return [o.outputs[0].text for o in llm.generate([t["prompt"] for t in lines], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def results(eval_tasks, model, greedy_texts, tmp_path_factory):
    """The eval on tiny_task.jsonl plus one generate line whose target is the model's own greedy text
    (padded with spaces: the match is after strip()), so exact match is 1 somewhere."""
    tmp = tmp_path_factory.mktemp("eval")
    first = next(t for t in _task_lines() if t["type"] == "generate")
    extra = {**first, "target": f"  {greedy_texts[0]} "}
    tasks = tmp / "tasks.jsonl"
    tasks.write_text(TASKS.read_text(encoding="utf-8") + json.dumps(extra, ensure_ascii=False) + "\n",
                     encoding="utf-8")
    calls = []
    original = LLM.generate

    def counting_generate(self, *args, **kwargs):
        calls.append(len(args[0]))
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLM, "generate", counting_generate)
        code = _run_main(eval_tasks, f"--model={model[0]}", f"--tasks={tasks}", f"--json_out={tmp / 'out.json'}",
                         *[f"--{k}={v}" for k, v in CONFIG.items()])
    assert code == 0
    return json.loads((tmp / "out.json").read_text(encoding="utf-8")), calls


def _reference_logprobs(torch_model, ids: list[int]) -> np.ndarray:
    return torch.log_softmax(torch.tensor(hf_logits(torch_model, ids), dtype=torch.float64), dim=-1).numpy()


def _continuation_logprob(torch_model, ids: list[int], start: int) -> float:
    """Sum of log p(ids[p] | ids[:p]) for p >= start, from transformers."""
    ref = _reference_logprobs(torch_model, ids)
    return float(sum(ref[p - 1, ids[p]] for p in range(start, len(ids))))


def test_one_generate_call_for_every_request(results):
    _, calls = results
    lines = _task_lines()
    expected = sum(len(t["choices"]) if t["type"] == "loglikelihood" else 1 for t in lines) + 1  # + the extra line
    assert calls == [expected]


def test_loglikelihood_scores_match_transformers(results, model):
    out, _ = results
    model_dir, torch_model = model
    tok = load_tokenizer(model_dir)
    items = [i for i in out["items"] if i["type"] == "loglikelihood"]
    assert len(items) == sum(t["type"] == "loglikelihood" for t in _task_lines())
    for item in items:
        # lm-eval-harness: the context's trailing whitespace goes with the choice; encoded apart, ids joined.
        context = item["context"].rstrip()
        context_ids = tok.encode(context)
        for choice, score, num_tokens in zip(item["choices"], item["scores"], item["num_tokens"]):
            choice_ids = tok.encode(item["context"][len(context):] + choice, add_special_tokens=False)
            assert num_tokens == len(choice_ids)
            ref = _continuation_logprob(torch_model, context_ids + choice_ids, len(context_ids))
            assert abs(score - ref) < 1e-4, (item["context"], choice, score, ref)
        assert item["prediction"] == int(np.argmax(item["scores"]))
        assert item["correct"] == (item["prediction"] == item["answer"])
    assert out["summary"]["loglikelihood"]["acc"] == pytest.approx(np.mean([i["correct"] for i in items]))


def test_trailing_context_space_moves_to_the_choice(eval_tasks, model):
    tok = load_tokenizer(model[0])
    context_ids, choice_ids = eval_tasks.encode_pair(tok, "hello ", "world", "test")
    assert context_ids == tok.encode("hello")
    assert choice_ids == tok.encode(" world", add_special_tokens=False)
    assert tok.decode(choice_ids) == " world"


def test_perplexity_matches_transformers(results, model):
    out, _ = results
    model_dir, torch_model = model
    tok = load_tokenizer(model_dir)
    texts = [t["text"] for t in _task_lines() if t["type"] == "perplexity"]
    items = [i for i in out["items"] if i["type"] == "perplexity"]
    total_nll = total_tokens = 0
    for text, item in zip(texts, items, strict=True):
        ids = tok.encode(text)
        nll = -_continuation_logprob(torch_model, ids, 1)
        assert item["num_tokens"] == len(ids) - 1
        assert item["perplexity"] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-4)
        total_nll, total_tokens = total_nll + nll, total_tokens + len(ids) - 1
    summary = out["summary"]["perplexity"]
    assert summary["tokens"] == total_tokens
    assert summary["perplexity"] == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-4)


def test_exact_match_is_llm_generate_greedy_text_against_targets(results, greedy_texts):
    out, _ = results
    targets = [t["target"] for t in _task_lines() if t["type"] == "generate"]
    targets.append(f"  {greedy_texts[0]} ")
    texts = greedy_texts + greedy_texts[:1]
    items = [i for i in out["items"] if i["type"] == "generate"]
    assert [i["text"] for i in items] == texts
    expected = [text.strip() == target.strip() for text, target in zip(texts, targets, strict=True)]
    assert [i["correct"] for i in items] == expected and expected[-1]
    assert out["summary"]["generate"]["exact_match"] == pytest.approx(np.mean(expected))


def test_json_has_every_field(results):
    out, _ = results
    assert {"model", "tasks", "engine_config", "summary", "items"} <= set(out)
    assert out["engine_config"]["block_size"] == CONFIG["block_size"]
    assert set(out["summary"]) == set(SUMMARY_FIELDS)
    for kind, fields in SUMMARY_FIELDS.items():
        summary = out["summary"][kind]
        assert fields | THROUGHPUT_FIELDS == set(summary), kind
        assert summary["wall_s"] > 0 and summary["requests_per_s"] > 0 and summary["tokens_per_s"] > 0
    assert out["summary"]["all"]["requests"] == sum(out["summary"][k]["requests"] for k in ITEM_FIELDS)
    for item in out["items"]:
        assert set(item) == ITEM_FIELDS[item["type"]]


def test_bad_task_line_exits_2(eval_tasks, tmp_path, capsys):
    tasks = tmp_path / "bad.jsonl"
    tasks.write_text('{"type": "loglikelihood", "context": "a", "choices": ["b", "c"], "answer": 2}\n')
    assert _run_main(eval_tasks, f"--tasks={tasks}") == 2
    assert f"{tasks}:1: loglikelihood: \"answer\"" in capsys.readouterr().err
