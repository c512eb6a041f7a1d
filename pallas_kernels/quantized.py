"""The quantized weight format the kernels read (models/quantization.py makes and combines it; the native
stacked matmul packs it, pallas_kernels/native/ops.py): a kernel [..., K, N] as small integer (or fp8) values
with a float32 scale, and optionally an offset, per group of `group_size` rows of K and per column:

    w[..., k, n] = values[..., k, n] * scales[..., k // group_size, n] + offsets[..., k // group_size, n]

rounded as written (the product, then the sum)."""

import dataclasses

import jax
import jax.numpy as jnp

VALUE_BITS = {jnp.dtype(t): bits for t, bits in ((jnp.int8, 8), (jnp.uint8, 8), (jnp.int4, 4), (jnp.uint4, 4),
                                                 (jnp.float8_e4m3fn, 8))}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedWeight:
    """A quantized kernel [..., K, N] (see the module docstring). A pytree: stacked over layers, sliced by the
    layers' scan, placed on devices and sharded leaf by leaf like the float kernel it replaces."""

    values: jax.Array              # [..., K, N] int8, int4, uint4 or float8_e4m3fn
    scales: jax.Array              # [..., K // group_size, N] float32
    offsets: jax.Array | None = None  # like scales, or None (symmetric)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def group_size(self) -> int:
        return self.values.shape[-2] // self.scales.shape[-2]

    @property
    def bits(self) -> int:
        return VALUE_BITS[jnp.dtype(self.values.dtype)]

    @property
    def T(self) -> "QuantizedWeight":  # noqa: N802 - as arrays name it: torch [out, in] <-> Ferry [in, out]
        return jax.tree.map(lambda a: a.swapaxes(-1, -2), self)

    def dequantize(self, dtype=jnp.float32):
        """The float weights [..., K, N] (computed in float32, then cast)."""
        return dequantize(self.values, self.scales, self.offsets).astype(dtype)

    def describe(self) -> str:
        """"uint4 g32 +offsets": the format, for logs and errors."""
        return (f"{jnp.dtype(self.values.dtype).name} g{self.group_size}"
                f"{' +offsets' if self.offsets is not None else ''}")


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def _expand(a, group: int):
    return jnp.repeat(a, group, axis=-2)


def dequantize(values, scales, offsets=None):
    """values * scales (+ offsets), float32, each group's scale (and offset) repeated over its rows."""
    group = values.shape[-2] // scales.shape[-2]
    w = values.astype(jnp.float32) * _expand(scales, group)
    return w if offsets is None else w + _expand(offsets, group)
