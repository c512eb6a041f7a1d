"""Ferry checkpoints: DIR/ferry_config.json beside DIR/model.safetensors (per-layer Hugging Face names, q/k/v
and gate/up apart) and any tokenizer files. Checkpoints saved before model.safetensors hold DIR/params/ (orbax),
which still loads."""

import itertools
import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file

from models.checkpoints.hf import safetensors_tensors
from models.checkpoints.tensors import Checkpoint, per_layer_tensors, unfuse_projections
from models.config import ModelConfig, read_json

FERRY_CONFIG = "ferry_config.json"
WEIGHTS_FILE = "model.safetensors"
LEGACY_PARAMS_DIR = "params"  # orbax: how checkpoints were saved before model.safetensors
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")


def save_checkpoint(model, out_dir: str, tokenizer_dir: str | None = None) -> str:
    """Write a LoadedModel's weights (safetensors: per-layer names, q/k/v and gate/up apart, as checkpoints store them)
    and the config beside them; copy tokenizer files from `tokenizer_dir`."""
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = unfuse_projections(per_layer_tensors(model.params()), model.cfg)
    # contiguous: safetensors writes an array's buffer as it lies (a column split is a strided view)
    save_file({name: np.ascontiguousarray(tensor) for name, tensor in tensors.items()},
              os.path.join(out_dir, WEIGHTS_FILE))
    with open(os.path.join(out_dir, FERRY_CONFIG), "w") as f:
        json.dump({"model": model.cfg.to_json(), "max_model_len": model.max_model_len}, f, indent=2)
    source = tokenizer_dir or model.path
    if source:
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(source, name)):
                shutil.copy(os.path.join(source, name), os.path.join(out_dir, name))
    return out_dir


def read_checkpoint(ckpt_dir: str) -> Checkpoint:
    ckpt_dir = os.path.abspath(ckpt_dir)
    meta = read_json(os.path.join(ckpt_dir, FERRY_CONFIG))
    cfg = ModelConfig.from_json(meta["model"])
    max_model_len = int(meta.get("max_model_len", cfg.max_context_len))
    config_source = os.path.join(ckpt_dir, FERRY_CONFIG)
    if os.path.isdir(os.path.join(ckpt_dir, LEGACY_PARAMS_DIR)):
        tensors = orbax_tensors(os.path.join(ckpt_dir, LEGACY_PARAMS_DIR), cfg)
    elif os.path.exists(os.path.join(ckpt_dir, WEIGHTS_FILE)):
        tensors = safetensors_tensors(ckpt_dir)
    else:
        raise FileNotFoundError(f"{ckpt_dir}: no {WEIGHTS_FILE} beside {FERRY_CONFIG}")
    first_path, first_name, first = next(tensors)  # the stored dtype is the default
    tensors = itertools.chain([(first_path, first_name, first)], tensors)
    return Checkpoint(cfg, str(first.dtype), tensors, max_model_len, ckpt_dir, config_source)


def orbax_tensors(params_dir: str, cfg: ModelConfig):
    """(directory, name, numpy array) of a checkpoint saved by Ferry before its weights moved to safetensors
    (orbax: imported only here, where start-up needs it)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(params_dir)
        stored = getattr(stored, "item_metadata", stored)
        target = {name: np.empty(leaf.shape, leaf.dtype) for name, leaf in stored.items()}
        restored = ckptr.restore(params_dir, target)
    for name, array in unfuse_projections(restored, cfg).items():  # fused if saved after the fusion
        yield params_dir, name, np.asarray(array)
