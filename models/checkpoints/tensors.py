"""The tensors of a checkpoint and their names.

Every checkpoint format is read into a `Checkpoint`: the model's config and its tensors under Hugging Face
names in torch layout ("model.layers.3.mlp.up_proj.weight", Linear weights [out, in]), one at a time. Ferry's
model holds each layer parameter once, stacked over layers ("layers.mlp.up_proj.kernel" [num_layers, ...], see
models/transformer.py), and fuses q/k/v and gate/up (transformer.FUSED_PROJECTIONS). This module is the one
place the two namings meet: `hf_to_ferry_name` renames a checkpoint tensor to its per-layer Ferry name
("layers.3.mlp.up_proj.kernel"), `fill_state` puts per-layer tensors at their index of the stacked tree, and
`per_layer_tensors` / `unfuse_projections` go the other way, for saving.
"""

import dataclasses
import itertools
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx

from models import quantization
from models.config import ModelConfig
from models.transformer import FUSED_PROJECTIONS, fused_projection_widths


@dataclasses.dataclass(slots=True)
class Checkpoint:
    """What a checkpoint reader found, for models.loading to build the model from."""

    cfg: ModelConfig
    dtype: str                                      # the stored dtype: the model's unless the caller names one
    tensors: Iterator[tuple[str, str, np.ndarray]]  # (where: a file, HF name, host array in torch layout)
    max_model_len: int
    path: str
    config_source: str                              # what the shapes were derived from (for errors)


def flat_paths(tree, prefix=()):
    """{"layers.0.mlp.up_proj.kernel": (("layers", 0, "mlp", "up_proj", "kernel"), leaf)} of a pure dict."""
    out = {}
    for key, value in tree.items():
        path = prefix + (key,)
        if isinstance(value, dict):
            out.update(flat_paths(value, path))
        else:
            out[".".join(map(str, path))] = (path, value)
    return out


def set_path(tree, path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def layer_name(stacked_name: str, layer: int) -> str:
    """"layers.mlp.up_proj.kernel", 3 -> "layers.3.mlp.up_proj.kernel"."""
    return f"layers.{layer}.{stacked_name.removeprefix('layers.')}"


def per_layer_leaves(state) -> dict[str, jax.ShapeDtypeStruct]:
    """The model's tensors under per-layer names, each with its per-layer shape and dtype."""
    out = {}
    for name, (_, leaf) in flat_paths(nnx.to_pure_dict(state)).items():
        if name.startswith("layers."):
            for layer in range(leaf.shape[0]):
                out[layer_name(name, layer)] = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
        else:
            out[name] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return out


def per_layer_tensors(params: dict) -> dict[str, jax.Array]:
    """A pure params dict -> {per-layer name: tensor}: the stacked layer parameters cut back into layers."""
    out = {}
    for name, (_, leaf) in flat_paths(params).items():
        if name.startswith("layers."):
            out.update((layer_name(name, i), leaf[i]) for i in range(leaf.shape[0]))
        else:
            out[name] = leaf
    return out


def fused_widths(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{"self_attn.qkv_proj": (q, k, v widths), "mlp.gate_up_proj": (...)}: where each fused tensor splits."""
    return {f"{module}.{proj}": widths for module, proj, widths in fused_projection_widths(cfg)}


def unfused_leaves(leaves: dict[str, jax.ShapeDtypeStruct], cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Per-layer leaves with each fused projection replaced by its parts ("layers.3.mlp.gate_up_proj.kernel"
    -> "layers.3.mlp.gate_proj.kernel", "layers.3.mlp.up_proj.kernel"): the names checkpoints store."""
    return unfuse_projections(leaves, cfg, split=lambda leaf, widths: [
        jax.ShapeDtypeStruct((*leaf.shape[:-1], width), leaf.dtype) for width in widths])


def fuse_projections(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Concatenate (in place) every layer's separate projections into the model's fused ones; arrays
    already fused pass through."""
    for fused, parts in FUSED_PROJECTIONS.items():
        first = f".{parts[0]}."
        for name in [n for n in arrays if first in n]:
            prefix, leaf = name.split(first)  # "layers.3", "kernel"
            tensors = [arrays.pop(f"{prefix}.{part}.{leaf}") for part in parts]
            arrays[f"{prefix}.{fused}.{leaf}"] = quantization.concatenate(tensors, axis=-1)
    return arrays


def split_parts(tensor, widths: tuple[int, ...]) -> list:
    return quantization.split(tensor, list(itertools.accumulate(widths))[:-1], axis=-1)


def unfuse_projections(tensors: dict, cfg: ModelConfig, split=split_parts) -> dict:
    """The inverse of `fuse_projections`: each fused projection's tensor split (`split(tensor, widths)`) into
    its parts, as checkpoints store them, so every checkpoint a Ferry model writes loads through the one path
    (model_from_hf_tensors)."""
    widths = fused_widths(cfg)
    out = {}
    for name, tensor in tensors.items():
        fused = next((f for f in FUSED_PROJECTIONS if f".{f}." in name), None)
        if fused is None:
            out[name] = tensor
            continue
        out.update((name.replace(fused, part), piece)
                   for part, piece in zip(FUSED_PROJECTIONS[fused], split(tensor, widths[fused])))
    return out


def fill_state(graphdef, state, arrays: dict[str, jax.Array]) -> nnx.State:
    """Put per-layer-named `arrays` (consumed: each is dropped once stacked) into `state`."""
    pure = nnx.to_pure_dict(state)
    for name, (path, leaf) in flat_paths(pure).items():
        if name.startswith("layers."):
            value = quantization.stack([arrays.pop(layer_name(name, i)) for i in range(leaf.shape[0])])
        else:
            value = arrays.pop(name)
        set_path(pure, path, value)
    nnx.replace_by_pure_dict(state, pure)
    return state


def hf_to_ferry_name(hf_name: str) -> tuple[str, bool]:
    """Checkpoint tensor name -> (Ferry per-layer tensor name, transpose?), e.g.
    "model.layers.3.mlp.up_proj.weight" -> ("layers.3.mlp.up_proj.kernel", True); `fill_state` stacks."""
    # A multimodal Gemma 3's language model: "model.language_model.layers..." (transformers >= 5) or
    # "language_model.model.layers..." (before).
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):
        if hf_name.startswith(prefix):
            hf_name = "model." + hf_name.removeprefix(prefix)
            break
    name = hf_name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed_tokens.embedding", False
    if name.endswith("_proj.weight") or name == "lm_head.weight":
        return name.removesuffix(".weight") + ".kernel", True  # torch Linear is [out, in]
    return name, False
