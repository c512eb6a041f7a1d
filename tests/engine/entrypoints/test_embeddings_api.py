"""POST /v1/embeddings end to end: a real uvicorn server over a small random llama with a byte-level BPE tokenizer
(tests/helpers/server_harness.py), driven by the openai client (base64 by default) and raw httpx (floats); equal to
LLM.embed offline; every bad input a 400 naming its field, leaking nothing."""

import base64

import numpy as np
import openai
import pytest
from absl import flags

from engine.config import EngineConfig
from engine.entrypoints import cli_flags
from engine.entrypoints.server import ServerConfig
from engine.llm import LLM
from engine.pooling_params import PoolingParams
from helpers.hf_models import make_text_model
from helpers.server_harness import API_KEY, ENGINE, MAX_MODEL_LEN, MODEL_NAME, post, prompt_len, serve

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 2, "ferry", "café über naïve"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_text_model(tmp_path_factory, seed=3)[0]


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir, ServerConfig(MODEL_NAME, api_key=API_KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, EngineConfig(**ENGINE))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-5, atol=1e-6)


def test_openai_client_base64_and_httpx_floats_equal_offline(server, client, offline):
    want = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # asks for base64, decodes it
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    for d, w in zip(response.data, want):
        _close(d.embedding, w)
    tokens = sum(prompt_len(server, prompt=t) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    assert response.model == MODEL_NAME

    raw = post(server, "/v1/embeddings", {"model": MODEL_NAME, "input": TEXTS, "encoding_format": "float"})
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["object"] == "list" and body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert [d["object"] for d in body["data"]] == ["embedding"] * len(TEXTS)
    for d, w in zip(body["data"], want):
        assert isinstance(d["embedding"], list)
        _close(d["embedding"], w)
        assert abs(np.linalg.norm(d["embedding"]) - 1) < 1e-5

    encoded = post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), "<f4")
    _close(decoded, want[0])
    server.settle()


def test_token_id_inputs_and_pooling_overrides(server, offline):
    ids = [[5, 6, 7, 8], list(range(10, 10 + MAX_MODEL_LEN))]  # the second exactly max_model_len
    for pooling_type, normalize in (("mean", False), ("last", True)):
        want = offline.embed(ids, PoolingParams(pooling_type=pooling_type, normalize=normalize), use_tqdm=False)
        for single in (False, True):
            inputs = ids[0] if single else ids
            r = post(server, "/v1/embeddings", {"input": inputs, "pooling_type": pooling_type,
                                                "normalize": normalize})
            assert r.status_code == 200, r.text
            for d, w in zip(r.json()["data"], want):
                _close(d["embedding"], w.outputs.embedding)
    server.settle()


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [5, 10**6]}, "input"),                          # a token id outside the vocabulary
    ({"input": [[5, 6], [7, 100000]]}, "input"),
    ({"input": list(range(3, 4 + MAX_MODEL_LEN))}, "input"),   # max_model_len + 1 tokens
    ({"input": "hello", "dimensions": 8}, "dimensions"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hello", "pooling_type": "cls"}, "pooling_type"),
    ({"input": "hello", "normalize": "yes"}, "normalize"),
    ({"input": 7}, "input"),
    ({"input": "hello", "model": "other"}, "model"),
])
def test_bad_inputs_are_400s_naming_the_field_and_leak_nothing(server, client, body, param):
    r = post(server, "/v1/embeddings", body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param, r.json()
    server.settle()
    assert client.embeddings.create(model=MODEL_NAME, input="still serving").data[0].embedding
    server.settle()


def test_many_inputs_under_preemption_then_nothing_leaks(server, offline):
    """More long inputs than the cache holds at once (6 blocks of 16, 4 sequences): they wait for admission and
    prefill in chunks of the 64-token budget; every block is back after."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 200, size=int(n)).tolist() for n in rng.integers(20, MAX_MODEL_LEN, size=12)]
    want = offline.embed(ids, PoolingParams(pooling_type="mean"), use_tqdm=False)
    r = post(server, "/v1/embeddings", {"input": ids, "pooling_type": "mean"})
    assert r.status_code == 200, r.text
    for d, w in zip(r.json()["data"], want):
        _close(d["embedding"], w.outputs.embedding)
    server.settle()


def test_task_embed_server_refuses_generation(model_dir):
    with serve(model_dir, ServerConfig(MODEL_NAME, api_key=API_KEY), task="embed") as running:
        r = post(running, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 400 and "task is 'embed'" in r.json()["error"]["message"]
        r = post(running, "/v1/embeddings", {"input": ["hello", "world"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        running.settle()


def test_task_flag():
    cli_flags.define_engine_flags()
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["ferry-serve", "--task=embed"])
        assert cli_flags.engine_config_from_flags().task == "embed"
        flags.FLAGS.unparse_flags()
        with pytest.raises(flags.IllegalFlagValueError):
            flags.FLAGS(["ferry-serve", "--task=classify"])
    finally:
        flags.FLAGS.unparse_flags()
