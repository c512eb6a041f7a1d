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
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
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


# The model's stacks of decoder layers, in order: DeepSeek's first dense-MLP layers, then the rest (every layer,
# for the other families). A checkpoint numbers the layers across both.
LAYER_STACKS = ("dense_layers", "layers")


def stack_offsets(params: dict) -> dict[str, int]:
    """Each layer stack's first layer in the checkpoint's numbering, from a pure params dict."""
    dense = params.get("dense_layers")
    first_leaf = jax.tree.leaves(dense)[0] if dense else None
    return {"dense_layers": 0, "layers": 0 if first_leaf is None else first_leaf.shape[0]}


def layer_name(stacked_name: str, layer: int, offset: int = 0) -> str:
    """"layers.mlp.up_proj.kernel", 3 -> "layers.3.mlp.up_proj.kernel" (a stack whose first layer is the
    checkpoint's `offset`: its layer offset + 3)."""
    rest = stacked_name.split(".", 1)[1]
    return f"layers.{offset + layer}.{rest}"


def _stack_of(name: str) -> str | None:
    stack = name.split(".", 1)[0]
    return stack if stack in LAYER_STACKS else None


def per_layer_leaves(state) -> dict[str, jax.ShapeDtypeStruct]:
    """The model's tensors under per-layer names, each with its per-layer shape and dtype."""
    pure = nnx.to_pure_dict(state)
    offsets, out = stack_offsets(pure), {}
    for name, (_, leaf) in flat_paths(pure).items():
        if stack := _stack_of(name):
            for layer in range(leaf.shape[0]):
                out[layer_name(name, layer, offsets[stack])] = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
        else:
            out[name] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return out


def per_layer_tensors(params: dict) -> dict[str, jax.Array]:
    """A pure params dict -> {per-layer name: tensor}: the stacked layer parameters cut back into layers."""
    offsets, out = stack_offsets(params), {}
    for name, (_, leaf) in flat_paths(params).items():
        if stack := _stack_of(name):
            out.update((layer_name(name, i, offsets[stack]), leaf[i]) for i in range(leaf.shape[0]))
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


# An MoE layer's experts as checkpoints store them, one tensor per expert and projection
# ("layers.3.mlp.experts.5.up_proj.kernel", [hidden, I]), and as the model stacks them ("layers.3.mlp.experts.
# gate_up_proj" [E, hidden, 2I], models/moe.py Experts): stacked leaf -> (its parts, the per-expert leaf name).
EXPERT_STACKS = {"gate_up_proj": (("gate_proj", "up_proj"), "kernel"), "down_proj": (("down_proj",), "kernel"),
                 "gate_up_proj_bias": (("gate_proj", "up_proj"), "bias"), "down_proj_bias": (("down_proj",), "bias")}
_EXPERTS = ".mlp.experts."


def fuse_experts(arrays: dict) -> dict:
    """Stack (in place) every layer's per-expert tensors into the model's expert stacks (EXPERT_STACKS)."""
    for stacked, (parts, leaf) in EXPERT_STACKS.items():
        first = f".0.{parts[0]}.{leaf}"
        for name in [n for n in arrays if _EXPERTS in n and n.endswith(first)]:
            prefix = name.removesuffix(first)  # "layers.3.mlp.experts"
            experts = []
            while f"{prefix}.{len(experts)}.{parts[0]}.{leaf}" in arrays:
                e = len(experts)
                experts.append(jnp.concatenate([arrays.pop(f"{prefix}.{e}.{part}.{leaf}") for part in parts], -1))
            arrays[f"{prefix}.{stacked}"] = jnp.stack(experts)
    return arrays


def unfuse_experts(name: str, tensor) -> dict | None:
    """An expert stack's per-expert tensors (the inverse of fuse_experts), or None for any other tensor."""
    prefix, _, stacked = name.rpartition(".")
    if _EXPERTS not in name + "." or stacked not in EXPERT_STACKS:
        return None
    parts, leaf = EXPERT_STACKS[stacked]
    width = tensor.shape[-1] // len(parts)

    def part(e, i):
        if isinstance(tensor, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((*tensor.shape[1:-1], width), tensor.dtype)
        return tensor[e, ..., i * width:(i + 1) * width]

    return {f"{prefix}.{e}.{name}.{leaf}": part(e, i) for e in range(tensor.shape[0]) for i, name in enumerate(parts)}


def fuse_projections(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Concatenate (in place) every layer's separate projections into the model's fused ones (and experts into
    their stacks); arrays already fused pass through."""
    fuse_experts(arrays)
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
        experts = unfuse_experts(name, tensor)
        if experts is not None:
            out.update(experts)
            continue
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
    offsets = stack_offsets(pure)
    for name, (path, leaf) in flat_paths(pure).items():
        if stack := _stack_of(name):
            value = quantization.stack([arrays.pop(layer_name(name, i, offsets[stack])) for i in range(leaf.shape[0])])
        else:
            value = arrays.pop(name)
        set_path(pure, path, value)
    nnx.replace_by_pure_dict(state, pure)
    return state


# Families' own names for the MoE modules -> the common ones (Mixtral's block_sparse_moe and its experts'
# w1/w3/w2, gpt-oss's router).
_RENAMES = ((r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
            (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."), (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
            (r"\.mlp\.router\.", ".mlp.gate."), (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."))


def checkpoint_layout(name: str, host, cfg: ModelConfig):
    """A checkpoint tensor in the layout Ferry holds it, where a family stores it otherwise: gpt-oss interleaves
    its experts' gate and up columns (gate = [..., 0::2], up = [..., 1::2]), Ferry concatenates them."""
    if cfg.model_type == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        return np.concatenate([host[..., 0::2], host[..., 1::2]], axis=-1)
    return host


# Projections the model holds as checkpoints store them (torch's [out, in]): MLA's kv_b_proj (models/mla.py).
_AS_STORED = ("kv_b_proj.weight",)


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
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    if name == "embed_tokens.weight":
        return "embed_tokens.embedding", False
    if name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight")) and not name.endswith(_AS_STORED) or \
            name == "lm_head.weight":
        return name.removesuffix(".weight") + ".kernel", True  # torch Linear is [out, in]
    return name, False
