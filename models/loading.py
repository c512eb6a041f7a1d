"""Load a model from a Hugging Face directory (safetensors), a GGUF file (models/gguf.py) or a Ferry
checkpoint; save the latter.

Both forms come back as a `LoadedModel`: the config and the model split once (`nnx.split`) into a
static graphdef and a state pytree, which is what the jitted step takes.

Ferry checkpoint layout:  DIR/ferry_config.json  DIR/model.safetensors  plus any tokenizer files (checkpoints
saved before model.safetensors hold DIR/params/, orbax, which still loads).

Names. Both formats store one tensor per layer under Hugging Face-style names ("layers.3.mlp.up_proj.kernel"
once `_hf_to_ferry_name` has dropped "model." and renamed "weight"), while the model holds each
layer parameter once, stacked over layers ("layers.mlp.up_proj.kernel" [num_layers, ...], see
models/transformer.py). `_fill_state` is the one place the per-layer names meet the stacked tree: it
puts tensor "layers.i.NAME" at index i of "layers.NAME"; `_per_layer_tensors` is its inverse, for saving.
The model fuses q/k/v and gate/up (transformer.FUSED_PROJECTIONS); `_fuse_projections` concatenates
checkpoints' separate tensors (Hugging Face, GGUF, Ferry checkpoints saved before the fusion) on load.
"""

import dataclasses
import glob
import itertools
import json
import os
import shutil

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models.config import ConfigError, ModelConfig, load_hf_config, max_context_len, read_json
from models.packaged import resolve_packaged
from models.transformer import FUSED_PROJECTIONS, Transformer, fused_projection_widths

FERRY_CONFIG = "ferry_config.json"
WEIGHTS_FILE = "model.safetensors"
LEGACY_PARAMS_DIR = "params"  # orbax: how checkpoints were saved before model.safetensors
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")
# Buffers some checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(slots=True)
class LoadedModel:
    cfg: ModelConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    max_model_len: int
    path: str | None = None

    @property
    def dtype(self):
        return self.params()["embed_tokens"]["embedding"].dtype

    def params(self) -> dict:
        return nnx.to_pure_dict(self.state)


def _dtype(name):
    return None if name is None else jnp.dtype(name)


def abstract_model(cfg: ModelConfig, dtype, scan: bool = True) -> tuple[nnx.GraphDef, nnx.State]:
    """graphdef and a state of ShapeDtypeStructs: nothing allocated."""
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0), scan=scan, traced=True))
    return nnx.split(model)


def unstack_layers(model: LoadedModel) -> LoadedModel:
    """The same model with one module (and arrays) per layer, run unrolled (Transformer(scan=False)):
    faster decode on CPU, compile time growing with depth. The stacked arrays are sliced once, here."""
    params = model.params()
    stacked = params["layers"]
    params["layers"] = {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(model.cfg.num_layers)}
    graphdef, state = abstract_model(model.cfg, model.dtype, scan=False)
    nnx.replace_by_pure_dict(state, params)
    return dataclasses.replace(model, graphdef=graphdef, state=state)


def random_model(cfg: ModelConfig, dtype=jnp.float32, seed: int = 0, max_model_len: int | None = None) -> LoadedModel:
    """Random weights (benchmarks and tests)."""
    graphdef, state = nnx.split(Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
    return LoadedModel(cfg, graphdef, state, max_model_len or cfg.max_position_embeddings)


def _flat_paths(tree, prefix=()):
    """{"layers.0.mlp.up_proj.kernel": (("layers", 0, "mlp", "up_proj", "kernel"), leaf)} of a pure dict."""
    out = {}
    for key, value in tree.items():
        path = prefix + (key,)
        if isinstance(value, dict):
            out.update(_flat_paths(value, path))
        else:
            out[".".join(map(str, path))] = (path, value)
    return out


def _set_path(tree, path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _layer_name(stacked_name: str, layer: int) -> str:
    """"layers.mlp.up_proj.kernel", 3 -> "layers.3.mlp.up_proj.kernel"."""
    return f"layers.{layer}.{stacked_name.removeprefix('layers.')}"


def _per_layer_leaves(state) -> dict[str, jax.ShapeDtypeStruct]:
    """The model's tensors under per-layer names, each with its per-layer shape and dtype."""
    out = {}
    for name, (_, leaf) in _flat_paths(nnx.to_pure_dict(state)).items():
        if name.startswith("layers."):
            for layer in range(leaf.shape[0]):
                out[_layer_name(name, layer)] = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
        else:
            out[name] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return out


def _per_layer_tensors(params: dict) -> dict[str, jax.Array]:
    """A pure params dict -> {per-layer name: tensor}: the stacked layer parameters cut back into layers."""
    out = {}
    for name, (_, leaf) in _flat_paths(params).items():
        if name.startswith("layers."):
            out.update((_layer_name(name, i), leaf[i]) for i in range(leaf.shape[0]))
        else:
            out[name] = leaf
    return out


def _fused_widths(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{"self_attn.qkv_proj": (q, k, v widths), "mlp.gate_up_proj": (...)}: where each fused tensor splits."""
    return {f"{module}.{proj}": widths for module, proj, widths in fused_projection_widths(cfg)}


def _unfused_leaves(leaves: dict[str, jax.ShapeDtypeStruct], cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Per-layer leaves with each fused projection replaced by its parts ("layers.3.mlp.gate_up_proj.kernel"
    -> "layers.3.mlp.gate_proj.kernel", "layers.3.mlp.up_proj.kernel"): the names checkpoints store."""
    return _unfuse_projections(leaves, cfg, split=lambda leaf, widths: [
        jax.ShapeDtypeStruct((*leaf.shape[:-1], width), leaf.dtype) for width in widths])


def _fuse_projections(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Concatenate (in place) every layer's separate projections into the model's fused ones; arrays
    already fused pass through."""
    for fused, parts in FUSED_PROJECTIONS.items():
        first = f".{parts[0]}."
        for name in [n for n in arrays if first in n]:
            prefix, leaf = name.split(first)  # "layers.3", "kernel"
            tensors = [arrays.pop(f"{prefix}.{part}.{leaf}") for part in parts]
            arrays[f"{prefix}.{fused}.{leaf}"] = jnp.concatenate(tensors, axis=-1)
    return arrays


def _split_columns(tensor, widths: tuple[int, ...]) -> list[np.ndarray]:
    return np.split(np.asarray(tensor), list(itertools.accumulate(widths))[:-1], axis=-1)


def _unfuse_projections(tensors: dict, cfg: ModelConfig, split=_split_columns) -> dict:
    """The inverse of `_fuse_projections`: each fused projection's tensor split (`split(tensor, widths)`) into
    its parts, as checkpoints store them, so every checkpoint a Ferry model writes loads through the one path
    (model_from_hf_tensors)."""
    widths = _fused_widths(cfg)
    out = {}
    for name, tensor in tensors.items():
        fused = next((f for f in FUSED_PROJECTIONS if f".{f}." in name), None)
        if fused is None:
            out[name] = tensor
            continue
        out.update((name.replace(fused, part), piece)
                   for part, piece in zip(FUSED_PROJECTIONS[fused], split(tensor, widths[fused])))
    return out


def _fill_state(graphdef, state, arrays: dict[str, jax.Array]) -> nnx.State:
    """Put per-layer-named `arrays` (consumed: each is dropped once stacked) into `state`."""
    pure = nnx.to_pure_dict(state)
    for name, (path, leaf) in _flat_paths(pure).items():
        if name.startswith("layers."):
            value = jnp.stack([arrays.pop(_layer_name(name, i)) for i in range(leaf.shape[0])])
        else:
            value = arrays.pop(name)
        _set_path(pure, path, value)
    nnx.replace_by_pure_dict(state, pure)
    return state


# ---------------------------------------------------------------- Hugging Face safetensors

def _safetensors_files(model_dir: str) -> list[str]:
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


def _hf_to_ferry_name(hf_name: str) -> tuple[str, bool]:
    """Checkpoint tensor name -> (Ferry per-layer tensor name, transpose?), e.g.
    "model.layers.3.mlp.up_proj.weight" -> ("layers.3.mlp.up_proj.kernel", True); `_fill_state` stacks."""
    name = hf_name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed_tokens.embedding", False
    if name.endswith("_proj.weight") or name == "lm_head.weight":
        return name.removesuffix(".weight") + ".kernel", True  # torch Linear is [out, in]
    return name, False


def load_hf(model_dir: str, dtype=None) -> LoadedModel:
    cfg, hf = load_hf_config(model_dir)
    dtype = _dtype(dtype) or _dtype(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    return model_from_hf_tensors(cfg, dtype, _safetensors_tensors(model_dir), max_context_len(hf, cfg),
                                 model_dir, f"{model_dir}/config.json")


def _safetensors_tensors(model_dir: str):
    """(file, HF name, numpy array in its stored dtype: bf16 stays bf16 via ml_dtypes), one at a time."""
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="numpy") as f:
            for hf_name in f.keys():
                yield path, hf_name, f.get_tensor(hf_name)


def model_from_hf_tensors(cfg: ModelConfig, dtype, tensors, max_model_len: int, path: str,
                          config_source: str) -> LoadedModel:
    """A LoadedModel from Hugging-Face-named host tensors in torch layout (Linear weights [out, in]).

    `tensors` yields (where, HF name, numpy array); `where` (a file) and `config_source` (what the
    shapes were derived from) only name things in errors. Every checkpoint format funnels through here,
    so the HF name -> parameter tree mapping lives in one place."""
    graphdef, abstract = abstract_model(cfg, dtype)
    # per-layer names, q/k/v and gate/up apart as checkpoints store them; fused, then stacked, below
    expected = _unfused_leaves(_per_layer_leaves(abstract), cfg)
    arrays = {}
    for where, hf_name, host in tensors:
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        name, transpose = _hf_to_ferry_name(hf_name)
        if name == "lm_head.kernel" and cfg.tie_word_embeddings:
            continue  # tied: the embedding serves as the head
        if name not in expected:
            raise ConfigError(f"{where}: tensor {hf_name!r} has no place in a {cfg.model_type} model "
                              f"built from {config_source}")
        want = expected[name].shape[::-1] if transpose else expected[name].shape
        if tuple(host.shape) != tuple(want):
            raise ConfigError(f"{where}: tensor {hf_name!r} has shape {list(host.shape)}, but "
                              f"{config_source} implies {list(want)}")
        arrays[name] = jnp.asarray(host.T if transpose else host, dtype=dtype)  # casts on the way
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise ConfigError(f"{path}: checkpoint lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    state = _fill_state(graphdef, abstract, _fuse_projections(arrays))
    return LoadedModel(cfg, graphdef, state, max_model_len, path)


# ---------------------------------------------------------------- Ferry checkpoints

def save_checkpoint(model: LoadedModel, out_dir: str, tokenizer_dir: str | None = None) -> str:
    """Write the weights (safetensors: per-layer names, q/k/v and gate/up apart, as checkpoints store them)
    and the config beside them; copy tokenizer files from `tokenizer_dir`."""
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = _unfuse_projections(_per_layer_tensors(model.params()), model.cfg)
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


def load_checkpoint(ckpt_dir: str, dtype=None) -> LoadedModel:
    ckpt_dir = os.path.abspath(ckpt_dir)
    meta = read_json(os.path.join(ckpt_dir, FERRY_CONFIG))
    cfg = ModelConfig.from_json(meta["model"])
    max_model_len = int(meta.get("max_model_len", cfg.max_position_embeddings))
    config_source = os.path.join(ckpt_dir, FERRY_CONFIG)
    if os.path.isdir(os.path.join(ckpt_dir, LEGACY_PARAMS_DIR)):
        tensors = _orbax_tensors(os.path.join(ckpt_dir, LEGACY_PARAMS_DIR), cfg)
    elif os.path.exists(os.path.join(ckpt_dir, WEIGHTS_FILE)):
        tensors = _safetensors_tensors(ckpt_dir)
    else:
        raise FileNotFoundError(f"{ckpt_dir}: no {WEIGHTS_FILE} beside {FERRY_CONFIG}")
    first_path, first_name, first = next(tensors)  # the stored dtype is the default
    tensors = itertools.chain([(first_path, first_name, first)], tensors)
    return model_from_hf_tensors(cfg, _dtype(dtype) or jnp.dtype(first.dtype), tensors, max_model_len, ckpt_dir,
                                 config_source)


def _orbax_tensors(params_dir: str, cfg: ModelConfig):
    """(directory, name, numpy array) of a checkpoint saved by Ferry before its weights moved to safetensors
    (orbax: imported only here, ~0.7 s of start-up that other checkpoints do not need)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(params_dir)
        stored = getattr(stored, "item_metadata", stored)
        target = {name: np.empty(leaf.shape, leaf.dtype) for name, leaf in stored.items()}
        restored = ckptr.restore(params_dir, target)
    for name, array in _unfuse_projections(restored, cfg).items():  # fused if saved after the fusion
        yield params_dir, name, np.asarray(array)


def load_model(path: str, dtype=None) -> LoadedModel:
    """The one entry point: a Ferry checkpoint directory, a Hugging Face one, or a GGUF file (or a
    directory holding one .gguf and no config.json), or a packaged model's short name (models/packaged.py)."""
    from models.gguf import find_gguf_file, load_gguf  # noqa: PLC0415 (gguf imports this module)

    path = resolve_packaged(path)
    if os.path.isfile(path) and find_gguf_file(path):
        return load_gguf(path, dtype)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: model directory not found")
    if os.path.exists(os.path.join(path, FERRY_CONFIG)):
        return load_checkpoint(path, dtype)
    if os.path.exists(os.path.join(path, "config.json")):
        return load_hf(path, dtype)
    if gguf_file := find_gguf_file(path):
        return load_gguf(gguf_file, dtype)
    raise FileNotFoundError(f"{path}: neither {FERRY_CONFIG} (Ferry checkpoint) nor config.json (Hugging Face) "
                            f"nor a .gguf file")
