"""Models by Hugging Face repo id (`HuggingFaceTB/SmolLM2-135M-Instruct`), found in the local Hugging Face cache.

Offline only: Ferry never downloads at run time. Fill the cache first (`hf download REPO`, or any tool that
uses huggingface_hub); `$HF_HUB_CACHE` / `$HF_HOME` move it, as for transformers and vLLM.
"""

import os
import re

from models.packaged import resolve_packaged

# owner/name, as the Hub spells repo ids; `owner/name@revision` picks a branch, tag or commit
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_repo_id(name: str) -> bool:
    """Whether `name` reads as a repo id rather than a path (an existing path always wins)."""
    return bool(REPO_ID.match(name)) and not os.path.exists(name) and not name.endswith(".gguf")


def cached_snapshot(name: str) -> str:
    """The local snapshot directory of repo id `name` (`owner/name[@revision]`); FileNotFoundError saying
    where it looked and how to fill the cache when it is not there."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = name.partition("@")
    try:
        return snapshot_download(repo_id, revision=revision or None, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as e:
        where = f"revision {revision!r} of " if revision else ""
        raise FileNotFoundError(
            f"{name}: no such path, and no snapshot of {where}the Hugging Face repo {repo_id!r} in the local cache "
            f"{constants.HF_HUB_CACHE} (Ferry does not download: run `hf download {repo_id}` first, or pass a "
            f"directory)") from e


def resolve_model_name(name: str) -> str:
    """The path a model name means: a packaged model's short name (models/packaged.py), a path, or else a
    repo id in the local Hugging Face cache."""
    name = resolve_packaged(name)
    return cached_snapshot(name) if is_repo_id(name) else name
