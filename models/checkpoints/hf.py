"""Hugging Face checkpoint directories: config.json and *.safetensors (sharded or not)."""

import glob
import json
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import safe_open

from models.checkpoints import compressed, mxfp4
from models.checkpoints.tensors import Checkpoint
from models.config import load_hf_config, read_json


def read_checkpoint(model_dir: str) -> Checkpoint:
    """A Hugging Face directory's config and tensors; a weight-only quantized checkpoint's (config.json's
    quantization_config: compressed-tensors, AWQ, GPTQ) Linears as QuantizedWeights (checkpoints/compressed.py)."""
    cfg, hf = load_hf_config(model_dir)
    source = f"{model_dir}/config.json"
    tensors = safetensors_tensors(model_dir)
    if hf.get("quantization_config") and cfg.model_type == "gpt_oss":  # MXFP4 experts, dequantized
        mxfp4.check_quantization_config(hf["quantization_config"], source)
        tensors = mxfp4.dequantized_tensors(tensors)
    elif hf.get("quantization_config"):
        plan = compressed.read_quantization_config(hf["quantization_config"], source)
        tensors = compressed.quantized_tensors(plan, safetensors_keys(model_dir), tensors, model_dir)
    return Checkpoint(cfg, hf.get("dtype") or hf.get("torch_dtype") or "float32", tensors,
                      cfg.max_context_len, model_dir, source)


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


def safetensors_keys(model_dir: str) -> dict[str, str]:
    """{tensor name: file} of every stored tensor (headers only)."""
    keys = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="numpy") as f:
            keys.update((name, path) for name in f.keys())
    return keys


def safetensors_tensors(model_dir: str):
    """(file, HF name, numpy array in its stored dtype: bf16 stays bf16 via ml_dtypes), one at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="numpy") as f:
            for hf_name in f.keys():
                try:
                    tensor = f.get_tensor(hf_name)
                except (AttributeError, TypeError, ValueError):  # a dtype numpy lacks (safetensors' F8_E4M3)
                    tensor = _raw_tensor(path, hf_name)
                yield path, hf_name, tensor


_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _raw_tensor(path: str, name: str) -> np.ndarray:
    """Tensor `name` of a .safetensors file read from its header's offsets (8-byte length, JSON, data)."""
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        info = json.loads(f.read(length))[name]
    if info["dtype"] not in _RAW_DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which Ferry does not read")
    begin, end = info["data_offsets"]
    data = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=8 + length + begin)
    return data.view(_RAW_DTYPES[info["dtype"]]).reshape(info["shape"])
