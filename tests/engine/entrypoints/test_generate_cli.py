"""`python -m engine.entrypoints.generate` as a user runs it: its output equals LLM.generate in-process; JSONL files
with
per-line overrides; streaming; bad flags and a missing model exit 2 with a message that names them."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from absl import flags

from engine.config import EngineConfig
from engine.entrypoints import cli_flags, generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from helpers.hf_models import make_text_model
from helpers.repo import ROOT as REPO_ROOT

FLAGS = flags.FLAGS
CONFIG = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=128)
ENGINE_ARGS = [f"--{k}={v}" for k, v in CONFIG.items()]
GREEDY_ARGS = ["--temperature=0", "--max_tokens=12", "--ignore_eos"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random llama over the byte-level BPE test tokenizer (with a chat template), files side by side."""
    return make_text_model(tmp_path_factory, seed=11, chat_template=CHAT_TEMPLATE)[0]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, EngineConfig(**CONFIG))


def run_cli(*args) -> subprocess.CompletedProcess:
    """`python -m engine.entrypoints.generate` in a subprocess. Its output is decoded here, not in text mode: the
    model's
    text may hold \\r, which text mode would turn into \\n."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run([sys.executable, "-m", "engine.entrypoints.generate", "--noprogress", *args],
                          capture_output=True,
                          env=env, timeout=300, cwd=REPO_ROOT)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8"),
                                       proc.stderr.decode("utf-8", "replace"))


@pytest.fixture
def run_main(capsys):
    """Run generate.main in-process (absl parses the global flags); (exit code, stdout, stderr). The flags go
    back to unparsed defaults afterwards, so one run's values cannot leak into the next."""
    def run(*args):
        FLAGS.unparse_flags()
        try:
            generate.main(["ferry-generate", "--noprogress", *args])
            code = 0
        except SystemExit as e:
            code = e.code or 0
        finally:
            FLAGS.unparse_flags()
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_prompts_print_what_llm_generate_returns(model_dir, llm):
    prompts = ["hello world", "the quick brown"]
    proc = run_cli(f"--model={model_dir}", *ENGINE_ARGS, *GREEDY_ARGS, *[f"--prompt={p}" for p in prompts])
    assert proc.returncode == 0, proc.stderr
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = "".join(f"--- prompt {i}, sample 0 (length) ---\n{o.outputs[0].text}\n" for i, o in enumerate(outputs))
    assert proc.stdout == expected


def test_stream_prints_the_same_text(model_dir, llm, run_main):
    code, out, err = run_main(f"--model={model_dir}", *ENGINE_ARGS, *GREEDY_ARGS, "--prompt=hello world",
                              "--stream")
    assert code == 0, err
    text = llm.generate("hello world", GREEDY, use_tqdm=False)[0].outputs[0].text
    assert text and out == text + "\n"


def _stop_string_inside(text: str) -> str:
    """Two characters from the middle of `text` (no replacement characters), so a stop string ends it early."""
    for i in range(1, len(text) - 2):
        if "\ufffd" not in text[i:i + 2]:
            return text[i:i + 2]
    raise AssertionError(f"no usable stop string in {text!r}")


def test_jsonl_round_trip_with_per_line_overrides(model_dir, llm, tmp_path, run_main):
    base = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    stop = _stop_string_inside(llm.generate("fox", base, use_tqdm=False)[0].outputs[0].text)
    tok = llm.tokenizer
    messages = [{"role": "user", "content": "hello"}]
    lines = [
        {"prompt": "hello world", "id": "first"},
        {"prompt_token_ids": [0, 5, 9, 12], "max_tokens": 3, "logprobs": 2},
        {"prompt": "the quick", "temperature": 1.0, "top_k": 20, "seed": 7, "n": 2, "max_tokens": 6},
        {"prompt": "fox", "stop": [stop]},
        {"messages": messages, "max_tokens": 4},
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(line, ensure_ascii=False) for line in lines) + "\n",
                                       encoding="utf-8")
    code, _, err = run_main(f"--model={model_dir}", *ENGINE_ARGS, "--temperature=0", "--max_tokens=10",
                            "--ignore_eos", f"--input={tmp_path / 'in.jsonl'}", f"--output={tmp_path / 'out.jsonl'}")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]

    chat_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    prompts = ["hello world", [0, 5, 9, 12], "the quick", "fox", chat_ids]
    overrides = [{k: v for k, v in line.items() if k not in ("prompt", "prompt_token_ids", "messages", "id")}
                 for line in lines]
    expected = llm.generate(prompts, [dataclasses.replace(base, **o) for o in overrides], use_tqdm=False)
    assert len(records) == len(lines)
    for record, want in zip(records, expected):
        assert record["prompt_token_ids"] == want.prompt_token_ids
        assert len(record["outputs"]) == len(want.outputs)
        for got, ref in zip(record["outputs"], want.outputs):
            assert (got["text"], got["token_ids"], got["finish_reason"]) == (ref.text, ref.token_ids,
                                                                          ref.finish_reason)
            assert ("logprobs" in got) == (ref.logprobs is not None)
            if ref.logprobs is not None:
                assert got["logprobs"] == [{str(t): lp for t, lp in entry.items()} for entry in ref.logprobs]
    assert records[0]["id"] == "first" and records[0]["prompt"] == "hello world"
    assert [len(o["token_ids"]) for o in records[0]["outputs"]] == [10]  # the flags' max_tokens
    assert len(records[1]["outputs"][0]["logprobs"]) == 3
    assert records[2]["outputs"][0]["token_ids"] != records[2]["outputs"][1]["token_ids"]  # seeds 7 and 8
    assert records[3]["outputs"][0]["finish_reason"] == "stop" and records[3]["outputs"][0]["stop_reason"] == stop
    assert records[4]["messages"] == messages and records[4]["prompt_token_ids"].count(0) == 1  # one BOS


def test_bad_sampling_value_exits_2_naming_the_field(model_dir):
    proc = run_cli(f"--model={model_dir}", "--prompt=hi", "--top_p=0")
    assert proc.returncode == 2
    assert "--top_p: top_p must be in (0, 1]" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--block_size=0"], "--block_size=0"),
    (["--max_tokens=many"], "--max_tokens=many"),
    (["--temperature=-1"], "--temperature: temperature must be >= 0"),
    (["--dtype=float99"], "--dtype=float99: not a dtype"),
    (["--prompt=a", "--prompt=b", "--stream"], "--stream takes exactly one --prompt"),
    (["--input=/no/such/file.jsonl"], "--input=/no/such/file.jsonl"),
])
def test_bad_flags_exit_2_with_a_message(model_dir, run_main, args, message):
    args = args if any(a.startswith(("--prompt", "--input")) for a in args) else ["--prompt=hi", *args]
    code, out, err = run_main(f"--model={model_dir}", *args)
    assert code == 2 and message in err and not out


def test_bad_input_line_exits_2_naming_file_line_and_field(model_dir, run_main, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "hello"}\n{"prompt": "fox", "top_k": -5}\n')
    code, _, err = run_main(f"--model={model_dir}", f"--input={path}")
    assert code == 2 and f"{path}:2: top_k:" in err
    path.write_text('{"prompt": "hello", "max_token": 5}\n')
    code, _, err = run_main(f"--model={model_dir}", f"--input={path}")
    assert code == 2 and "unknown keys ['max_token']" in err


def test_missing_model_dir_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_model"
    proc = run_cli(f"--model={missing}", "--prompt=hi")
    assert proc.returncode == 2
    assert f"--model={missing}: no such file or directory" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_default_model_says_to_pass_model(tmp_path, monkeypatch):
    import models

    monkeypatch.chdir(tmp_path)  # neither ./models/default nor the package's own
    monkeypatch.setattr(models, "__file__", str(tmp_path / "models" / "__init__.py"))
    with pytest.raises(FileNotFoundError, match="pass --model=DIR"):
        cli_flags.resolve_model_dir(cli_flags.DEFAULT_MODEL)


@pytest.fixture
def parsed_flags():
    """Parse a command line in-process; the global flags go back to unparsed defaults afterwards."""
    def parse(*args):
        FLAGS.unparse_flags()
        return FLAGS(["ferry-generate", *args])

    yield parse
    FLAGS.unparse_flags()


def test_every_engine_and_sampling_field_has_a_flag(parsed_flags):
    parsed_flags()
    assert cli_flags.engine_config_from_flags() == EngineConfig()
    assert cli_flags.sampling_params_from_flags() == SamplingParams()
    parsed_flags("--block_size=4", "--num_blocks=33", "--memory_fraction=0.25", "--max_num_seqs=3",
                 "--max_num_batched_tokens=64", "--max_model_len=100", "--chunk_size=16", "--watermark_blocks=1",
                 "--preemption_mode=recompute", "--num_host_blocks=5", "--kv_dtype=bfloat16",
                 "--attention_impl=reference", "--dtype=float32", "--engine_seed=9", "--noenable_prefix_caching")
    assert cli_flags.engine_config_from_flags() == EngineConfig(
        block_size=4, num_blocks=33, memory_fraction=0.25, max_num_seqs=3, max_num_batched_tokens=64,
        max_model_len=100, chunk_size=16, watermark_blocks=1, preemption_mode="recompute", num_host_blocks=5,
        kv_dtype="bfloat16", attention_impl="reference", dtype="float32", seed=9, enable_prefix_caching=False)
    parsed_flags("--n=2", "--temperature=0.5", "--top_p=0.9", "--top_k=7", "--min_p=0.1", "--seed=3",
                 "--presence_penalty=0.5", "--frequency_penalty=-0.5", "--repetition_penalty=1.2",
                 r"--stop=\n", "--stop=end", "--stop_token_ids=5", "--stop_token_ids=6", "--ignore_eos",
                 "--max_tokens=20", "--min_tokens=2", "--logprobs=3", "--prompt_logprobs=1", "--priority=1",
                 "--noskip_special_tokens", "--include_stop_str_in_output")
    assert cli_flags.sampling_params_from_flags() == SamplingParams(
        n=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, seed=3, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, stop=["\n", "end"], stop_token_ids=[5, 6], ignore_eos=True,
        max_tokens=20, min_tokens=2, logprobs=3, prompt_logprobs=1, priority=1, skip_special_tokens=False,
        include_stop_str_in_output=True)
