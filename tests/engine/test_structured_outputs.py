"""Structured outputs offline (SamplingParams.structured_outputs): JSON schemas, json_object, regexes, choices and
Lark grammars constrain a random model sampled at temperature 1, and every output is checked by an independent
validator (jsonschema, re.fullmatch, set membership, a small recursive parser). Also: a permissive grammar leaves
greedy output alone, n > 1 and preemption (swap, recompute) keep outputs valid and seed-identical, no compilation
after warm-up, bad grammars are errors naming the field."""

import json
import re

import jsonschema
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from engine.worker.compilation import compile_guard
from helpers.hf_models import make_text_model

NUM_SEEDS = 50
# 63 usable blocks of 8 tokens for up to 32 sequences: every batched test here preempts (swap) under load.
# One cache shape for every engine in this file, so they all share the jitted step programs.
CONFIG = dict(block_size=8, max_num_seqs=32, max_num_batched_tokens=256, num_blocks=64)

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                         "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "address"], "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                "minItems": 1, "maxItems": 4},
                       "ok": {"type": "boolean"}},
        "required": ["tags", "ok"], "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                       "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                       "note": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["age", "score"], "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                                   "kind": {"enum": ["a", "b"]}},
                  "required": ["id", "kind"], "additionalProperties": False},
    },
}

# Written in the common subset of Rust's and Python's regex syntax ([0-9], not \d: Rust's \d is Unicode).
REGEX = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]{0,3})?"
CHOICES = ("yes", "no", "maybe not", "café")
# Sums of small numbers in brackets, nested at most MAX_DEPTH deep: recursive (a regex could not check the
# brackets), yet bounded, so every sample ends within max_tokens. (Unbounded, a random model at temperature 1
# opens brackets faster than it closes them often enough to run out of tokens: a flaky test.)
MAX_DEPTH = 3
LARK = "start: e3\n" + "".join(f'e{d}: NUM | "(" e{d - 1} "+" e{d - 1} ")"\n' for d in range(MAX_DEPTH, 0, -1)) + \
    "e0: NUM\nNUM: /[0-9]{1,2}/"


def parse_sum(text: str) -> bool:
    """Does `text` match LARK's language? A recursive-descent parser, independent of llguidance."""
    def expr(i, depth):
        if i < len(text) and text[i] == "(":
            if depth == 0:
                return None
            j = expr(i + 1, depth - 1)
            if j is None or text[j:j + 1] != "+":
                return None
            k = expr(j + 1, depth - 1)
            return k + 1 if k is not None and text[k:k + 1] == ")" else None
        m = re.match(r"[0-9]{1,2}", text[i:])
        return i + m.end() if m else None

    return expr(0, MAX_DEPTH) == len(text)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory, seed=int(np.random.SeedSequence().entropy % 2**31))[0]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, EngineConfig(**CONFIG))


def _sampled(llm, spec: dict, max_tokens: int, prompts=("hello world", "the quick brown fox")) -> list:
    """NUM_SEEDS samples at temperature 1: every seed a request (prompts alternate), one generate call."""
    base = int(np.random.SeedSequence().entropy % 2**31)
    params = [SamplingParams(temperature=1.0, seed=base + i, max_tokens=max_tokens, structured_outputs=spec)
              for i in range(NUM_SEEDS)]
    outputs = llm.generate([prompts[i % len(prompts)] for i in range(NUM_SEEDS)], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    for out in _sampled(llm, {"json": schema}, max_tokens=160):
        assert out.finish_reason == "stop", f"{out.finish_reason}: {out.text!r}"
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_regex_choice_and_lark_outputs(llm):
    for out in _sampled(llm, {"json_object": True}, max_tokens=160):
        # Any object: a random model may write long strings, so only finished ones must parse.
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")
    for out in _sampled(llm, {"regex": REGEX}, max_tokens=48):
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    choices = [out.text for out in _sampled(llm, {"choice": list(CHOICES)}, max_tokens=16)]
    assert set(choices) <= set(CHOICES) and len(set(choices)) > 1, choices
    for out in _sampled(llm, {"grammar": LARK}, max_tokens=200):
        assert out.finish_reason == "stop" and parse_sum(out.text), out.text


def test_permissive_grammar_leaves_greedy_output_alone(llm):
    """A grammar that accepts any text masks only what text cannot hold (special tokens, UTF-8 bytes that
    cannot come next): the constrained greedy output equals the unconstrained one up to the first token the
    grammar disallows, and at every step it is the best raw-logprob token the grammar allows."""
    rng = np.random.default_rng()
    prompts = [rng.integers(3, llm.engine.model.cfg.vocab_size, size=int(rng.integers(3, 12))).tolist()
               for _ in range(24)]
    # logprobs in both runs: both use the full sampler's programs (the module's other tests compiled them).
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=20), use_tqdm=False)
    permissive = {"grammar": "start: /(?s:.*)/"}
    bound = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=20,
                                                 structured_outputs=permissive), use_tqdm=False)
    grammar = llm.engine.compile_grammar(StructuredOutputsParams(**permissive))
    compared = best_checked = 0
    for a, b in zip(free, bound):
        free_tokens, tokens = a.outputs[0].token_ids, b.outputs[0].token_ids
        matcher, same_until = grammar.matcher(), None
        for i, token in enumerate(tokens):
            allowed = np.unpackbits(matcher.allowed_mask().view(np.uint8), bitorder="little")
            if same_until is None and (i == len(free_tokens) or not allowed[free_tokens[i]]):
                same_until = i
            ranked = sorted(b.outputs[0].logprobs[i].items(), key=lambda item: (-item[1], item[0]))
            best_allowed = next((t for t, _ in ranked if allowed[t]), None)
            if best_allowed is not None:  # among the top 20 (else it lies further down)
                assert token == best_allowed, f"step {i}: sampled {token}, best allowed {best_allowed}"
                best_checked += 1
            matcher.advance(tokens[:i + 1])
        same_until = min(len(free_tokens), len(tokens)) if same_until is None else same_until
        assert tokens[:same_until] == free_tokens[:same_until]
        compared += same_until
    assert compared > 0 and best_checked >= sum(len(b.outputs[0].token_ids) for b in bound) // 2, (compared,
                                                                                                   best_checked)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_n_samples_and_preemption_keep_outputs_valid_without_compiling(llm, model_dir, preemption_mode):
    """n=6 samples of 3 requests in a cache too small for all 18 (preemptions happen) give the outputs each
    request gets alone, all valid; the same batch again (every shape now compiled) compiles nothing."""
    schema = SCHEMAS["nested"]
    spec = {"json": schema}
    prompts = ["hello world", "the quick brown fox jumps", "jax tokenizer of a"]
    params = [SamplingParams(n=6, temperature=1.0, seed=100 + i, max_tokens=96, structured_outputs=spec)
              for i in range(len(prompts))]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    # No prefix caching: the second run's schedule is then the first's.
    batched = LLM(model_dir, EngineConfig(**CONFIG, preemption_mode=preemption_mode, enable_prefix_caching=False))
    first = batched.generate(prompts, params, use_tqdm=False)
    assert batched.engine.scheduler.stats()["preemptions"][preemption_mode] > 0
    with compile_guard():  # the same schedule again, with fresh matchers
        outs = batched.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for r in outs for o in r.outputs] == [o.token_ids for r in first for o in r.outputs]
    assert len({o.text for r in outs for o in r.outputs}) > 1  # the samples are not copies of each other
    for got, want in zip(outs, alone):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
        for o in got.outputs:
            assert o.finish_reason == "stop"
            jsonschema.validate(json.loads(o.text), schema)


def test_bad_structured_outputs_are_errors_naming_the_field(llm):
    engine: LLMEngine = llm.engine
    bad = [{"regex": "a(b"}, {"json": {"type": "frobnicate"}}, {"json": "{not json"}, {"grammar": "start: ("},
           {"choice": []}, {"regex": "a", "choice": ["a"]}, {"json_object": "yes"}, {"jsn": {}}]
    for spec in bad:
        with pytest.raises(SamplingParamsError) as e:
            engine.add_request(None, "hello", SamplingParams(structured_outputs=spec))
        assert e.value.field == "structured_outputs", spec
    assert engine.num_requests == 0
    # The engine goes on, and a compiled grammar is cached: the same spec compiles once.
    spec = StructuredOutputsParams(regex="[ab]{4}")
    assert engine.compile_grammar(spec) is engine.compile_grammar(StructuredOutputsParams(regex="[ab]{4}"))
    (out,) = llm.generate(["hello"], SamplingParams(temperature=1.0, structured_outputs=spec), use_tqdm=False)
    assert re.fullmatch("[ab]{4}", out.outputs[0].text)


def test_sentencepiece_tokenizer_is_refused_naming_the_field(tmp_path):
    """Sentencepiece tokenizers (the embedded demo model's) are refused with an error naming the field."""
    from engine.structured import GrammarCompiler  # noqa: PLC0415
    from helpers.tokenizer_fixtures import write_sentencepiece_dir  # noqa: PLC0415
    from models.tokenizers.load import load_tokenizer

    tokenizer = load_tokenizer(str(write_sentencepiece_dir(tmp_path)))
    with pytest.raises(SamplingParamsError, match="tokenizer.json") as e:
        GrammarCompiler.for_tokenizer(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    assert e.value.field == "structured_outputs"
