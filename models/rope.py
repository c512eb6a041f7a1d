"""RoPE's rotation of queries and keys (the tables: models/transformer.rope_tables)."""

import jax.numpy as jnp


def apply_rope(x, cos, sin):
    """x [T, H, D]; cos, sin [T, rotary_dim]: the first rotary_dim features of each head rotate (partial rotary,
    Phi-4-mini), the rest pass through."""
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out if rotary == x.shape[-1] else jnp.concatenate([out, x_pass], axis=-1)
