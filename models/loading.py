"""Load a model: `load_model` picks the checkpoint reader (models/checkpoints/: Ferry, Hugging Face, GGUF), and
`model_from_checkpoint` builds every format's model the same way. The result is a `LoadedModel`: the config and
the model split once (`nnx.split`) into a static graphdef and a state pytree, which is what the jitted step takes.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx

from models.checkpoints import ferry, gguf, hf
from models.checkpoints.tensors import (
    Checkpoint,
    checkpoint_layout,
    fill_state,
    fuse_projections,
    hf_to_ferry_name,
    per_layer_leaves,
    unfuse_projections,
    unfused_leaves,
)
from models.config import ConfigError, ModelConfig
from models.hub import resolve_model_name
from models.quantization import is_quantized
from models.transformer import Transformer, layer_stacks, quantize_kernels

# Buffers some checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A multimodal Gemma 3 checkpoint's image side: Ferry serves its language model (config.py's gemma3 text_config).
_IGNORED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


@dataclasses.dataclass(slots=True)
class LoadedModel:
    cfg: ModelConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    max_model_len: int
    path: str | None = None

    @property
    def dtype(self):
        return self.params()["norm"]["weight"].dtype  # the embedding may be quantized

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
    stacks = [params.pop(name) for name, *_ in layer_stacks(model.cfg)]  # DeepSeek's dense layers, then the rest
    layers = [jax.tree.map(lambda a, i=i: a[i], stack) for stack in stacks
              for i in range(jax.tree.leaves(stack)[0].shape[0])]
    params["layers"] = dict(enumerate(layers))
    graphdef, state = abstract_model(model.cfg, model.dtype, scan=False)
    nnx.replace_by_pure_dict(state, params)
    return dataclasses.replace(model, graphdef=graphdef, state=state)


def random_model(cfg: ModelConfig, dtype=jnp.float32, seed: int = 0, max_model_len: int | None = None) -> LoadedModel:
    """Random weights (benchmarks and tests)."""
    graphdef, state = nnx.split(Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
    return LoadedModel(cfg, graphdef, state, max_model_len or cfg.max_context_len)


def model_from_checkpoint(checkpoint: Checkpoint, dtype=None) -> LoadedModel:
    """A LoadedModel from a checkpoint reader's tensors, cast to `dtype` (default: the checkpoint's own). Every
    format funnels through here, so the checkpoint name -> parameter tree mapping lives in one place; a tensor
    with no place in the model, of the wrong shape, or missing is a ConfigError naming it."""
    cfg, path, config_source = checkpoint.cfg, checkpoint.path, checkpoint.config_source
    dtype = _dtype(dtype) or jnp.dtype(checkpoint.dtype)
    graphdef, abstract = abstract_model(cfg, dtype)
    # per-layer names, q/k/v and gate/up apart as checkpoints store them; fused, then stacked, below
    fused = per_layer_leaves(abstract)
    expected = unfused_leaves(fused, cfg)
    # A checkpoint may store a projection fused as Ferry holds it (Phi-3's qkv_proj, gate_up_proj): split on read.
    known = {**fused, **expected}
    arrays = {}
    for where, hf_name, host in checkpoint.tensors:
        if hf_name.endswith(_IGNORED_SUFFIXES) or hf_name.startswith(_IGNORED_PREFIXES):
            continue
        name, transpose = hf_to_ferry_name(hf_name)
        host = checkpoint_layout(name, host, cfg)
        if name == "lm_head.kernel" and cfg.tie_word_embeddings:
            continue  # tied: the embedding serves as the head
        if name not in known:
            raise ConfigError(f"{where}: tensor {hf_name!r} has no place in a {cfg.model_type} model "
                              f"built from {config_source}")
        want = known[name].shape[::-1] if transpose else known[name].shape
        if tuple(host.shape) != tuple(want):
            raise ConfigError(f"{where}: tensor {hf_name!r} has shape {list(host.shape)}, but "
                              f"{config_source} implies {list(want)}")
        if is_quantized(host):  # kept packed; a quantized embedding is held as the tied head's [D, V] kernel
            transpose = transpose or name == "embed_tokens.embedding"
        for part, value in unfuse_projections({name: host.T if transpose else host}, cfg).items():
            arrays[part] = (value if is_quantized(value)
                            else jnp.asarray(value, dtype=dtype))  # casts on the way
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise ConfigError(f"{path}: checkpoint lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    state = fill_state(graphdef, abstract, fuse_projections(arrays))
    return LoadedModel(cfg, graphdef, state, checkpoint.max_model_len, path)


def quantize_model(model: LoadedModel, method: str, group_size: int | None = None) -> LoadedModel:
    """The model with its linears (and LM head) quantized weight-only on load: --quantization."""
    return dataclasses.replace(model, state=quantize_kernels(model.graphdef, model.state, method, group_size))


def read_checkpoint(path: str) -> Checkpoint:
    """The checkpoint at `path`: a Ferry checkpoint directory, a Hugging Face one, a GGUF file (or a directory
    holding one .gguf and no config.json), a packaged model's short name (models/packaged.py), or a Hugging Face
    repo id in the local cache (models/hub.py)."""
    path = resolve_model_name(path)
    if os.path.isfile(path) and gguf.find_gguf_file(path):
        return gguf.read_checkpoint(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: model directory not found")
    if os.path.exists(os.path.join(path, ferry.FERRY_CONFIG)):
        return ferry.read_checkpoint(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return hf.read_checkpoint(path)
    if gguf_file := gguf.find_gguf_file(path):
        return gguf.read_checkpoint(gguf_file)
    raise FileNotFoundError(f"{path}: neither {ferry.FERRY_CONFIG} (Ferry checkpoint) nor config.json (Hugging "
                            f"Face) nor a .gguf file")


def load_model(path: str, dtype=None) -> LoadedModel:
    """The one entry point: the model of the checkpoint at `path` (see read_checkpoint), in `dtype` (default: the
    checkpoint's own)."""
    return model_from_checkpoint(read_checkpoint(path), dtype)
