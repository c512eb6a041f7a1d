"""Models by Hugging Face repo id, from the local cache only (models/hub.py): the snapshot a cache holds loads as
its directory does; a repo or revision the cache lacks is an error that says where it looked."""

import shutil

import huggingface_hub
import pytest

from engine.entrypoints.cli_flags import resolve_model_dir
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from helpers.hf_models import make_text_model
from models import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, as huggingface_hub lays one out, in place of the user's."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cache_repo(cache, repo_id: str, model_dir: str, branch: str = "main"):
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(COMMIT)
    return repo / "snapshots" / COMMIT


def test_a_cached_repo_id_loads_as_its_snapshot(hf_cache, tmp_path_factory):
    model_dir, _ = make_text_model(tmp_path_factory, seed=4)
    snapshot = _cache_repo(hf_cache, "ferry-test/tiny-llama", model_dir)
    assert hub.is_repo_id("ferry-test/tiny-llama") and not hub.is_repo_id(model_dir)
    assert resolve_model_dir("ferry-test/tiny-llama") == str(snapshot)
    assert hub.resolve_model_name("ferry-test/tiny-llama@main") == str(snapshot)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    by_name = LLM("ferry-test/tiny-llama").generate("hello world", greedy, use_tqdm=False)[0]
    by_path = LLM(model_dir).generate("hello world", greedy, use_tqdm=False)[0]
    assert by_name.outputs[0].token_ids == by_path.outputs[0].token_ids


def test_a_repo_the_cache_lacks_says_where_it_looked(hf_cache, tmp_path_factory):
    with pytest.raises(FileNotFoundError, match="hf download ferry-test/absent") as e:
        LLM("ferry-test/absent")
    assert str(hf_cache) in str(e.value)
    model_dir, _ = make_text_model(tmp_path_factory, seed=4)
    _cache_repo(hf_cache, "ferry-test/tiny-llama", model_dir)
    with pytest.raises(FileNotFoundError, match="revision 'v2'"):
        resolve_model_dir("ferry-test/tiny-llama@v2")
    with pytest.raises(FileNotFoundError, match="--model=no-such-dir"):  # not a repo id: a path that is not there
        resolve_model_dir("no-such-dir")
