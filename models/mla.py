"""DeepSeek's multi-head latent attention (MLA), served from a latent KV cache.

Each token's keys and values for every head come from one latent row: c = RMSNorm(x @ W_dkv) [kv_lora_rank],
and the rotary key part k_pe = RoPE(x @ W_kr) [qk_rope_head_dim], which every head shares. Head h's key is
[c @ W_uk[h] | k_pe], its value c @ W_uv[h] (kv_b_proj holds W_uk and W_uv). The cache holds only [c | k_pe]:
kv_lora_rank + qk_rope_head_dim values a token, where full heads hold heads x (qk_head_dim + v_head_dim).

The up-projections are absorbed (DeepSeek-V2's paper, vLLM's MLA backends): q_nope . (c W_uk) = (q_nope W_uk^T) . c,
so each head's query becomes [q_nope W_uk^T | q_pe] over the latent, the attention runs as multi-query attention
with one KV head of width kv_lora_rank + qk_rope_head_dim whose values are the same latent rows (the kernels read
the one page array as both), and the output's first kv_lora_rank features times W_uv are the head's value mix.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.mesh import HEADS_SPEC, model_axis_size
from models.rope import apply_rope
from pallas_kernels.attention import write_latent_and_attend


class UpProjection(nnx.Module):
    """kv_b_proj: weight [heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank], torch's layout as checkpoints
    store it. The absorbed products read it whole, per head: not a Linear, so neither packed nor quantized, and
    sliced per layer by the layer scan like the norms (a packed stack's kernels are not)."""

    def __init__(self, in_features: int, out_features: int, dtype, rngs):
        self.weight = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (out_features, in_features), dtype))


class LatentAttention(nnx.Module):
    """MLA in a decoder layer's self_attn place (the Attention module's call signature; kv is a 1-tuple of the
    latent pool). Parameter names are transformers' (DeepseekV3Attention)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs, linear, norm):
        self.cfg = cfg
        h, heads = cfg.hidden_size, cfg.num_heads
        qk_head_dim = cfg.qk_nope_head_dim + cfg.head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = linear(h, cfg.q_lora_rank)
            self.q_a_layernorm = norm(cfg.q_lora_rank)
            self.q_b_proj = linear(cfg.q_lora_rank, heads * qk_head_dim)
        else:
            self.q_proj = linear(h, heads * qk_head_dim)
        self.kv_a_proj_with_mqa = linear(h, cfg.kv_lora_rank + cfg.head_dim)
        self.kv_a_layernorm = norm(cfg.kv_lora_rank)
        self.kv_b_proj = UpProjection(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype, rngs)
        self.o_proj = linear(heads * cfg.v_head_dim, h)

    def query(self, x, ctx):
        cfg = self.cfg
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, ctx), ctx), ctx) if cfg.q_lora_rank else self.q_proj(
            x, ctx)
        q = q.reshape(q.shape[0], -1, cfg.qk_nope_head_dim + cfg.head_dim)
        return q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]

    def latent(self, x, cos, sin, ctx):
        """[c | RoPE(k_pe)] [T, 1, kv_lora_rank + qk_rope_head_dim]: the rows the cache holds."""
        cfg = self.cfg
        kv = self.kv_a_proj_with_mqa(x, ctx)
        c = self.kv_a_layernorm(kv[:, :cfg.kv_lora_rank], ctx)
        k_pe = apply_rope(rotary_layout(kv[:, None, cfg.kv_lora_rank:], cfg), cos, sin)
        return jnp.concatenate([c[:, None, :].astype(k_pe.dtype), k_pe], axis=-1)

    def __call__(self, x, cos, sin, kv, md, ctx, kept=None):
        cfg = self.cfg
        q_nope, q_pe = self.query(x, ctx)
        q_pe = apply_rope(rotary_layout(q_pe, cfg), cos, sin)
        latent = self.latent(x, cos, sin, ctx)
        out_ctx = ctx
        if kept is not None:
            q_nope, q_pe, md, out_ctx = q_nope[kept.indices], q_pe[kept.indices], md.last_rows_queried(), \
                ctx.with_rows(kept.real)
        w = self.kv_b_proj.weight[...].reshape(cfg.num_heads, -1, cfg.kv_lora_rank)  # [H, nope + v, rank]
        w_uk, w_uv = w[:, :cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]
        q = jnp.concatenate([jnp.einsum("thn,hnr->thr", q_nope, w_uk.astype(q_nope.dtype)), q_pe], axis=-1)
        attend = self._attend(ctx.kernels)
        if model_axis_size() > 1:
            # Per shard its query heads, over the whole latent cache (one KV head: every shard holds all of it)
            attend = jax.shard_map(attend, in_specs=(HEADS_SPEC, P(), P(), P()), out_specs=(HEADS_SPEC, P()))
        out, pool = attend(q, latent, kv[0], md)
        out = jnp.einsum("thr,hvr->thv", out[..., :cfg.kv_lora_rank], w_uv.astype(out.dtype))
        return self.o_proj.float32_out(out.reshape(out.shape[0], -1), out_ctx), (pool,)

    def _attend(self, kernels):
        cfg = self.cfg

        def attend(q, latent, pool, md):
            return write_latent_and_attend(
                q, latent, pool, md.slot_mapping, md.block_tables, md.context_lens, md.query_start_loc,
                decode=md.decode, scale=cfg.query_scale, kernels=kernels, sliding_window=md.sliding_window)
        return attend


def rotary_layout(x, cfg: ModelConfig):
    """The rotary features [..., qk_rope_head_dim] in the half-split layout apply_rope rotates: DeepSeek's
    interleaved pairs (x0, x1), (x2, x3), ... de-interleaved to (x0, x2, ... | x1, x3, ...), which is also the
    layout transformers' interleaved RoPE outputs (queries and keys alike, so their dot products agree)."""
    if not cfg.rope_interleave:
        return x
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)

