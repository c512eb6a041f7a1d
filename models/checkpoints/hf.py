"""Hugging Face checkpoint directories: config.json and *.safetensors (sharded or not)."""

import glob
import os

from safetensors import safe_open

from models.checkpoints.tensors import Checkpoint
from models.config import load_hf_config, read_json


def read_checkpoint(model_dir: str) -> Checkpoint:
    cfg, hf = load_hf_config(model_dir)
    return Checkpoint(cfg, hf.get("dtype") or hf.get("torch_dtype") or "float32", safetensors_tensors(model_dir),
                      cfg.max_context_len, model_dir, f"{model_dir}/config.json")


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(model_dir, f))]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not in {model_dir}: {', '.join(missing)}")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (and no model.safetensors.index.json)")
    return files


def safetensors_tensors(model_dir: str):
    """(file, HF name, numpy array in its stored dtype: bf16 stays bf16 via ml_dtypes), one at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="numpy") as f:
            for hf_name in f.keys():
                yield path, hf_name, f.get_tensor(hf_name)
