"""Hugging Face checkpoints quantized weight-only, read packed: config.json's `quantization_config` names the
format, and each quantized Linear's tensors become one `QuantizedWeight` (models/quantization.py), yielded
as `qw.T` (torch layout) under the module's "<module>.weight" name, as every checkpoint reader yields a weight.

  format (quant_method / format)       stored tensors                                   QuantizedWeight
  compressed-tensors pack-quantized    weight_packed int32 [out, in*b/32] (+8 offset      int4 (b=4) / int8 (b=8)
    (llm-compressor's W4A16, W8A16)    codes, element i at bits b*i), weight_scale        g = group_size or in,
                                       [out, in/g], weight_zero_point int32 packed along  offsets -zp*s if asym
                                       out (asymmetric), weight_shape
  compressed-tensors int-/naive-       weight int8 [out, in], weight_scale, (zero point)  int8, same groups
    quantized (W8A16)
  compressed-tensors float-quantized   weight float8_e4m3fn, weight_scale [out, 1] or []  float8_e4m3fn, g = in
    (FP8 weights)
  awq (GEMM)                           qweight int32 [in, out/8] (AWQ's nibble order      int4 q - 8, g, offsets
                                       0,2,4,6,1,3,5,7), qzeros [in/g, out/8], scales     -(z - 8)*s unless z = 8
                                       [in/g, out]; w = (q - z) * s
  gptq (gptq, gptq_v2)                 qweight int32 [in*b/32, out] (packed along in),    int4/int8 q - 2^(b-1),
                                       qzeros [in/g, out*b/32] (v1 stores z - 1), scales  offsets -(z - 2^(b-1))*s
                                       [in/g, out], g_idx [in]; w = (q - z) * s           unless z = 2^(b-1)

Values and scales are both exact in float32 and the integer codes are small, so with 16-bit scales (fp16, bf16:
what these formats store) values * scales + offsets is the exact (q - z) * s rounded once to float32: the
reference dequantization's value, to the last bit. Activation quantization (W8A8, W4A8, FP8 with input scales),
other bit widths, GPTQ act-order (a g_idx that is not i // g) and AWQ's other kernel layouts are ConfigErrors
naming the field.
"""

import dataclasses
import re

import ml_dtypes
import numpy as np

from models.config import ConfigError
from models.quantization import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's WQLinear_GEMM: nibble i of a word holds column AWQ_ORDER[i]
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How one quantized Linear is stored."""

    method: str                 # "pack", "int", "fp8" (compressed-tensors), "awq", "gptq"
    bits: int
    group: int | None           # rows of `in` per scale; None: one group (per output channel or per tensor)
    zero_plus_one: bool = False  # GPTQ v1: the stored zero is z - 1

    def tensor_suffixes(self) -> tuple[str, ...]:
        return {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
                }.get(self.method, ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_shape",
                                    "weight_g_idx"))


def _need(qc: dict, key: str, source: str):
    if key not in qc:
        raise ConfigError(f"{source}: quantization_config lacks {key!r}")
    return qc[key]


def _bits(value, field: str, source: str, allowed=(4, 8)) -> int:
    if value not in allowed:
        raise ConfigError(f"{source}: quantization_config.{field} = {value!r} is not supported "
                          f"({', '.join(map(str, allowed))} bits)")
    return int(value)


def _group(value) -> int | None:
    return None if value in (None, -1, 0) else int(value)


@dataclasses.dataclass
class QuantizationPlan:
    """quantization_config read: the scheme of each Linear (by module name), None for one left float."""

    groups: list[tuple[list[str], Scheme]]  # (targets, scheme), compressed-tensors' config_groups in order
    ignore: list[str]

    def scheme(self, module: str) -> Scheme | None:
        if any(_matches(module, pattern) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(module, target) for target in targets):
                return scheme
        return None


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' targets: "Linear" (every Linear: here every module with quantized tensors), a
    "re:" regular expression, or a module name."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def read_quantization_config(qc: dict, source: str) -> QuantizationPlan:
    """config.json's quantization_config -> a QuantizationPlan; ConfigError for what Ferry does not load."""
    method = qc.get("quant_method")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"{source}: quantization_config.version = {qc.get('version')!r} is not supported "
                              f"(AWQ's 'gemm' layout)")
        if not qc.get("zero_point", True):
            raise ConfigError(f"{source}: quantization_config.zero_point = False is not supported (AWQ GEMM with "
                              f"zero points)")
        bits = _bits(_need(qc, "bits", source) if "bits" in qc else qc.get("w_bit"), "bits", source, (4,))
        scheme = Scheme("awq", bits, _group(qc.get("group_size", qc.get("q_group_size", 128))))
        return QuantizationPlan([(["Linear"], scheme)], list(qc.get("modules_to_not_convert") or []))
    if method == "gptq":
        bits = _bits(_need(qc, "bits", source), "bits", source)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"{source}: quantization_config.checkpoint_format = {fmt!r} is not supported "
                              f"(gptq, gptq_v2)")
        scheme = Scheme("gptq", bits, _group(qc.get("group_size", 128)), zero_plus_one=fmt == "gptq")
        return QuantizationPlan([(["Linear"], scheme)], list(qc.get("modules_to_not_convert") or []))
    if method != "compressed-tensors":
        raise ConfigError(f"{source}: quantization_config.quant_method = {method!r} is not supported "
                          f"(compressed-tensors, awq, gptq)")
    sparsity = qc.get("sparsity_config")
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise ConfigError(f"{source}: quantization_config.sparsity_config.format = {sparsity.get('format')!r} "
                          f"is not supported (dense)")
    groups = []
    for name, group in (_need(qc, "config_groups", source) or {}).items():
        field = f"config_groups.{name}"
        for acts in ("input_activations", "output_activations"):
            if group.get(acts):
                raise ConfigError(f"{source}: quantization_config.{field}.{acts} = {group[acts]!r}: activation "
                                  f"quantization (e.g. W8A8) is not supported; Ferry loads weight-only schemes")
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise ConfigError(f"{source}: quantization_config.format = {fmt!r} is not supported "
                              f"({', '.join(_CT_FORMATS)})")
        weights = group.get("weights") or {}
        kind, strategy = weights.get("type", "int"), weights.get("strategy", "tensor")
        if strategy not in ("channel", "group", "tensor"):
            raise ConfigError(f"{source}: quantization_config.{field}.weights.strategy = {strategy!r} is not "
                              f"supported (channel, group, tensor)")
        if weights.get("dynamic"):
            raise ConfigError(f"{source}: quantization_config.{field}.weights.dynamic = True is not supported")
        group_size = _group(weights.get("group_size")) if strategy == "group" else None
        if strategy == "group" and group_size is None:
            raise ConfigError(f"{source}: quantization_config.{field}.weights.group_size = "
                              f"{weights.get('group_size')!r} with strategy 'group'")
        if fmt == "float-quantized" or kind == "float":
            if kind != "float" or weights.get("num_bits") != 8 or fmt != "float-quantized":
                raise ConfigError(f"{source}: quantization_config.{field}.weights: {kind} {weights.get('num_bits')}"
                                  f"-bit in format {fmt!r} is not supported (FP8: float 8-bit, float-quantized)")
            if strategy == "group":
                raise ConfigError(f"{source}: quantization_config.{field}.weights.strategy = 'group' is not "
                                  f"supported for FP8 (channel, tensor)")
            scheme = Scheme("fp8", 8, None)
        else:
            bits = _bits(weights.get("num_bits"), f"{field}.weights.num_bits", source,
                         (4, 8) if fmt == "pack-quantized" else (8,))
            scheme = Scheme("pack" if fmt == "pack-quantized" else "int", bits, group_size)
        groups.append((list(group.get("targets") or ["Linear"]), scheme))
    return QuantizationPlan(groups, list(qc.get("ignore") or []))


# ---------------------------------------------------------------- unpacking


def _unpack_last(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [..., W] -> uint8 [..., W * 32 / bits]: element i of each word at bits [bits * i, bits * (i + 1))."""
    words = np.ascontiguousarray(packed).view("<u4")
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    return ((words[..., None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.uint8).reshape(
        *words.shape[:-1], -1)


def _unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [W, N] packed along rows -> uint8 [W * 32 / bits, N]."""
    return np.ascontiguousarray(_unpack_last(packed.T, bits).T)


def _signed(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes minus 2^(bits-1), as int4 / int8."""
    values = codes.astype(np.int16) - (1 << (bits - 1))
    return values.astype(ml_dtypes.int4 if bits == 4 else np.int8)


def _offsets(zeros: np.ndarray | None, scales: np.ndarray) -> np.ndarray | None:
    """-(zeros * scales) in float32 (zeros: signed, relative to the values' zero), None where every zero is 0."""
    if zeros is None or not np.any(zeros):
        return None
    return -(zeros.astype(np.float32) * scales)


def _scales(scale: np.ndarray, groups: int, out: int) -> np.ndarray:
    """A stored scale (torch layout [out, groups], [out, 1], [out] or a scalar) -> float32 [groups, out]."""
    scale = np.asarray(scale).astype(np.float32)
    if scale.size == 1:
        return np.full((groups, out), scale.reshape(()), np.float32)
    return np.ascontiguousarray(scale.reshape(out, -1).T)


def _check_group(name: str, scheme: Scheme, in_features: int) -> int:
    group = scheme.group or in_features
    if in_features % group:
        raise ConfigError(f"{name}: {in_features} inputs are not whole groups of {group}")
    return group


def _check_g_idx(name: str, g_idx, in_features: int, group: int):
    """Activation order (GPTQ's desc_act, llm-compressor's actorder="group") stores each input's group: Ferry
    reads only groups of consecutive inputs (g_idx = i // group)."""
    if g_idx is not None and not np.array_equal(np.asarray(g_idx).reshape(-1), np.arange(in_features) // group):
        raise ConfigError(f"{name}: act-order weights (groups that are not runs of {group} consecutive inputs) "
                          f"are not supported")


def quantized_weight(module: str, scheme: Scheme, parts: dict[str, np.ndarray]) -> QuantizedWeight:
    """One Linear's stored tensors (by suffix) -> QuantizedWeight [in, out] (Ferry layout)."""
    bits = scheme.bits
    if scheme.method == "awq":
        codes = _unpack_last(parts["qweight"], 4)  # [in, out], columns in AWQ's order within each word
        in_features, out = codes.shape
        reorder = np.argsort(AWQ_ORDER)  # column j of a word's 8 sits at nibble argsort(AWQ_ORDER)[j]
        codes = codes.reshape(in_features, -1, 8)[..., reorder].reshape(in_features, out)
        zeros = _unpack_last(parts["qzeros"], 4).reshape(-1, out // 8, 8)[..., reorder].reshape(-1, out)
        group = _check_group(f"{module}.qweight", scheme, in_features)
        scales = _scales(np.asarray(parts["scales"]).T, in_features // group, out)
        if zeros.shape != scales.shape:
            raise ConfigError(f"{module}.qzeros: shape {list(zeros.shape)} does not match scales "
                              f"{list(scales.shape)}")
        return QuantizedWeight(_signed(codes, 4), scales, _offsets(zeros.astype(np.int16) - 8, scales))
    if scheme.method == "gptq":
        codes = _unpack_rows(parts["qweight"], bits)  # [in, out]
        in_features, out = codes.shape
        group = _check_group(f"{module}.qweight", scheme, in_features)
        _check_g_idx(f"{module}.g_idx", parts.get("g_idx"), in_features, group)
        scales = _scales(np.asarray(parts["scales"]).T, in_features // group, out)
        zeros = _unpack_last(parts["qzeros"], bits)[:, :out].astype(np.int16)
        zeros = zeros + 1 if scheme.zero_plus_one else zeros
        if zeros.shape != scales.shape:
            raise ConfigError(f"{module}.qzeros: shape {list(zeros.shape)} does not match scales "
                              f"{list(scales.shape)}")
        return QuantizedWeight(_signed(codes, bits), scales, _offsets(zeros - (1 << (bits - 1)), scales))
    # compressed-tensors
    if scheme.method == "pack":
        out, in_features = (int(d) for d in np.asarray(parts["weight_shape"]).reshape(-1))
        codes = _unpack_last(parts["weight_packed"], bits)[:, :in_features]  # [out, in]
        values = _signed(codes, bits).T
    elif scheme.method == "int":
        values = np.asarray(parts["weight"])
        if values.dtype != np.int8:
            raise ConfigError(f"{module}.weight: dtype {values.dtype}, not int8 (int-quantized)")
        values = values.T
    else:
        values = np.asarray(parts["weight"])
        if values.dtype != ml_dtypes.float8_e4m3fn:
            raise ConfigError(f"{module}.weight: dtype {values.dtype}, not float8_e4m3fn (float-quantized)")
        values = values.T
    in_features, out = values.shape
    group = _check_group(f"{module}.weight", scheme, in_features)
    _check_g_idx(f"{module}.weight_g_idx", parts.get("weight_g_idx"), in_features, group)
    scales = _scales(parts["weight_scale"], in_features // group, out)
    zeros = parts.get("weight_zero_point")
    if zeros is not None:
        zeros = np.asarray(zeros)
        if scheme.method == "pack" and zeros.dtype == np.int32:  # packed along out, +2^(b-1) codes
            zeros = _unpack_rows(zeros, bits)[:out].astype(np.int16) - (1 << (bits - 1))
        zeros = _scales(zeros, in_features // group, out)  # [groups, out] (float32: small integers, exact)
    return QuantizedWeight(np.ascontiguousarray(values), scales, _offsets(zeros, scales))


def quantized_tensors(plan: QuantizationPlan, keys: dict[str, str], tensors, source: str):
    """(where, HF name, tensor) from `tensors` (every stored tensor, `keys`: name -> file), each quantized
    Linear's tensors gathered into one QuantizedWeight yielded as "<module>.weight" (torch layout: qw.T) once
    all of them are read; every other tensor passed through."""
    modules = {}  # module -> (scheme, the stored names it needs)
    for name in keys:
        module, _, suffix = name.rpartition(".")
        if suffix in ("weight_scale", "scales", "weight_packed", "qweight"):
            scheme = plan.scheme(module)
            if scheme is None:
                raise ConfigError(f"{keys[name]}: {name} is quantized, but quantization_config's targets and "
                                  f"ignore list leave {module} float")
            modules[module] = (scheme, {f"{module}.{s}" for s in scheme.tensor_suffixes()} & set(keys))
    pending: dict[str, dict[str, np.ndarray]] = {}
    for where, name, tensor in tensors:
        module, _, suffix = name.rpartition(".")
        if module not in modules or f"{module}.{suffix}" not in modules[module][1]:
            yield where, name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[suffix] = tensor
        scheme, needed = modules[module]
        if len(parts) == len(needed):
            del pending[module]
            yield where, f"{module}.weight", quantized_weight(module, scheme, parts).T
    if pending:
        raise ConfigError(f"{source}: quantized tensors of {sorted(pending)[:3]} were incomplete")
