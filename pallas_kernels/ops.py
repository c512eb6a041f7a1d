"""The ops of a step other than attention, each picking its implementation from the step's Kernels: the native CPU
kernel (pallas_kernels/native/ops.py) where `kernels.native` says so, else plain jnp, which is also their reference.

  rms_norm       a decoder layer's RMSNorm (with `delta`: the residual add before it)
  matmul         x @ w in x's dtype (a float32 product, rounded once, for 16-bit floats on the CPU)
  packed_matmul  x @ w[layer] of a weight stack packed for the native matmul (pack_stacked; float, or a
                 QuantizedWeight of int8/int4/uint4 values: the float32 path's bits on the dequantized weights)
  packed_grouped_matmul  a mixture of experts' ragged dot over one layer's experts of a packed stack of every
                 layer's (native.grouped_matmul)
  write_kv       this step's K/V rows into the paged cache; write_blocks: whole blocks (a swap-in)
  gate_product   the MLP's act(gate) * up
"""

import math

import jax
import jax.numpy as jnp

from pallas_kernels.kernels import Kernels
from pallas_kernels.kv_quant import write_rows
from pallas_kernels.native import ops as native

PACKED_RANK = native.PACKED_RANK  # a packed stack's rank: how a parameter is known to be one
pack_stacked = native.pack_stacked
packed_columns = native.packed_columns  # a packed LM head's columns: the tied embedding's rows


def rms_norm(x, weight, *, eps: float, offset: float, delta=None, native_kernel: bool = False):
    """Llama (offset 0): w * normalize(x).to(dtype). Gemma (offset 1): (normalize(x) * (1 + w)).to(dtype).
    Given a residual branch `delta` (float32 or x's dtype), of the sum x + delta.astype(x.dtype) instead,
    returned beside it: (normed, sum). `native_kernel`: the native CPU kernel, one call where XLA runs several
    fusions (the same rounding; x and weight of one dtype)."""
    if native_kernel and x.dtype == weight.dtype:
        return native.rms_norm(x, weight, eps=eps, offset=offset, delta=delta)
    if delta is not None:
        x = x + delta.astype(x.dtype)
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        normed = (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    else:
        normed = weight * normed.astype(x.dtype)
    return normed if delta is None else (normed, x)


def matmul(x, w, kernels: Kernels, transpose_w: bool = False):
    """x [..., K] @ w [K, N] (w [N, K] if `transpose_w`), in x's dtype. On the CPU a 16-bit float product
    accumulates into float32 and rounds once at the end (as a GPU's and torch's do), and a one-row x is
    padded to two rows: asked for a 16-bit result XLA CPU runs a generic loop, and for one row its own
    matrix-vector loop, which widens the whole of w to float32 first."""
    dims = (((x.ndim - 1,), (1 if transpose_w else 0,)), ((), ()))
    if jnp.dtype(x.dtype) == jnp.float32 or kernels.platform != "cpu":
        return jax.lax.dot_general(x, w, dims)
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 1:
        x2 = jnp.concatenate([x2, jnp.zeros_like(x2)])
    y = jax.lax.dot_general(x2, w, (((1,), dims[0][1]), ((), ())), preferred_element_type=jnp.float32)
    return y[:rows].astype(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def packed_matmul(x, packed, layer, **kwargs):
    """native.stacked_matmul: x @ w[layer] of a packed stack, the layer's panels read where they lie."""
    return native.stacked_matmul(x, packed, layer, **kwargs)


def packed_grouped_matmul(x, packed, first, group_sizes, **kwargs):
    """native.grouped_matmul: x's rows sorted by expert, expert e's @ entry first + e of a packed stack of every
    layer's experts (read where they lie), rows past the groups zeros."""
    return native.grouped_matmul(x, packed, first, group_sizes, **kwargs)


def write_kv(k_pages, v_pages, k, v, slot_mapping, kernels: Kernels):
    """Scatter this step's k/v [T, Hkv, D] into their slots. Under a donated cache XLA does it in place, but for
    XLA CPU, which copies the whole pool where its scatter is not in place (a 16-bit float scatter is widened to
    float32; a one-token step's scatter becomes a dynamic-update-slice behind a copy of the pool): there the
    native write copies only the T rows, in place. Quantized pages (int8, fp8) take the rows quantized, each with
    its scale (kv_quant.write_rows): T rows of work, then the same row write."""
    return write_pages(k_pages, k, slot_mapping, kernels), write_pages(v_pages, v, slot_mapping, kernels)


def write_pages(pages, rows, slot_mapping, kernels: Kernels):
    """One page array's side of write_kv: rows [T, Hkv, D] into their slots (quantized if the pages are; zero-padded
    where the pages are wider: the TPU's, Kernels.kv_page_dims)."""
    rows = write_rows(rows, pages.dtype)
    if rows.shape[1:] != pages.shape[2:]:
        rows = jnp.pad(rows, ((0, 0), (0, pages.shape[2] - rows.shape[1]), (0, pages.shape[3] - rows.shape[2])))
    if kernels.native:
        return native.kv_write(pages, rows, slot_mapping)
    num_blocks, block_size = pages.shape[:2]
    flat = pages.reshape(num_blocks * block_size, *pages.shape[2:])
    flat = flat.at[slot_mapping].set(rows, mode="drop", unique_indices=False)
    return flat.reshape(pages.shape)


def write_blocks(pages, block_ids, blocks, native_write: bool):
    """pages [L, NB, BS, ...] with pages[:, block_ids] = blocks [L, n, BS, ...] (a swap-in). `native_write`
    (one CPU device): the native row write, in place, where XLA CPU widens a 16-bit float scatter (or update)
    to float32 over the whole pool."""
    if not native_write:
        return pages.at[:, block_ids].set(blocks)
    num_layers, num_blocks, block_size = pages.shape[:3]
    first_rows = (jnp.arange(num_layers)[:, None] * num_blocks + block_ids[None, :]) * block_size  # [L, n]
    slots = (first_rows[:, :, None] + jnp.arange(block_size)).reshape(-1)
    return native.kv_write(pages, blocks.reshape(-1, *pages.shape[3:]), slots)


def gate_product(gate, up, act: str = "silu"):
    """act(gate) * up in their dtype, as Hugging Face's act_fn(gate_proj(x)) * up_proj(x) rounds: act in
    float32, rounded once (torch's bfloat16 SiLU and GELU), then the product rounded. The MLP's gate
    wherever the gated packed matmul does not run."""
    g = gate.astype(jnp.float32)
    a = jax.nn.silu(g) if act == "silu" else jax.nn.gelu(g, approximate=True)
    return a.astype(gate.dtype) * up


def gated_activation(sums, dtype, act: str = "silu"):
    """The gated packed matmul's semantics in jnp: a fused [gate | up] projection's float32 sums
    [..., 2I] rounded to `dtype`, then gate_product -> [..., I]."""
    return gate_product(*jnp.split(sums.astype(dtype), 2, axis=-1), act)
