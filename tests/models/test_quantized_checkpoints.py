"""Hugging Face weight-only quantized checkpoints read packed (models/checkpoints/compressed.py): the
QuantizedWeights dequantize to the reference dequantization of the stored tensors.

  compressed-tensors: written and dequantized by the compressed-tensors package itself (its compressors'
      compress/decompress and its QuantizationConfig; a test dependency).
  AWQ: packed from its definition (and by AutoAWQ's WQLinear_GEMM.from_linear where autoawq is installed, the
      same words); the reference is AutoAWQ's dequantize_gemm, reproduced in _awq_reference.
  GPTQ: no packer installs cleanly here (gptqmodel is a CUDA build), so the int32 packing is built below from
      its definition and the reference is AutoGPTQ's / gptqmodel's dequantization, reproduced in _gptq_reference.

Tolerance: none. Scales are float16 / bfloat16 and the codes small integers, so values * scales + offsets in
float32 is the exact (q - z) * s rounded once: equal to the reference computed in float32, and, cast to the
scale's dtype, bit for bit the reference computed in that dtype (one rounding of the same exact product)."""

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from models.checkpoints import hf as hf_checkpoint
from models.config import ConfigError
from models.quantization import is_quantized

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=256,
             intermediate_size=512, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-5, torch_dtype="bfloat16")
OUT, IN = 192, 256  # one Linear [out, in]
MODULE = "model.layers.0.mlp.up_proj"


def write_checkpoint(path, tensors: dict, quantization_config: dict):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": quantization_config}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def read_tensors(path) -> dict:
    return {name: tensor for _, name, tensor in hf_checkpoint.read_checkpoint(str(path)).tensors}


def ferry_floats(tensor) -> np.ndarray:
    """A yielded quantized weight (qw.T) as float32 [out, in]."""
    assert is_quantized(tensor)
    return np.asarray(tensor.T.dequantize()).T


def assert_matches_reference(ours: np.ndarray, ref32: torch.Tensor, ref_low: torch.Tensor | None = None):
    """Equal to the float32 reference; cast to the scales' dtype, bitwise the reference in that dtype."""
    np.testing.assert_array_equal(ours, ref32.detach().float().numpy())
    if ref_low is not None:
        low, ref_low = torch.from_numpy(ours).to(ref_low.dtype), ref_low.detach()
        assert torch.equal(low.view(torch.int16), ref_low.view(torch.int16))


# ---------------------------------------------------------------- compressed-tensors

def _ct():
    return pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")


def _ct_module(fmt: str, weights: dict, seed: int, scale_dtype=torch.bfloat16):
    """(stored tensors, library reference float32, reference in the scale dtype, config) for one Linear quantized
    by compressed-tensors' own compressor for `fmt`."""
    _ct()
    from compressed_tensors.compressors.base import BaseCompressor  # noqa: PLC0415
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: PLC0415
    from compressed_tensors.quantization.utils import calculate_qparams  # noqa: PLC0415

    torch.manual_seed(seed)
    weight = (torch.randn(OUT, IN) * 0.05).to(scale_dtype)
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    if args.strategy == "group":
        view = weight.float().reshape(OUT, IN // args.group_size, args.group_size)
        mins, maxs = view.amin(-1), view.amax(-1)
    elif args.strategy == "channel":
        mins, maxs = weight.float().amin(-1, keepdim=True), weight.float().amax(-1, keepdim=True)
    else:
        mins, maxs = weight.float().amin().reshape(1), weight.float().amax().reshape(1)
    scale, zero_point = calculate_qparams(torch.minimum(mins, torch.zeros(())), torch.maximum(maxs, torch.zeros(())),
                                          args)
    state = {"weight": weight, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zero_point}
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored = compressor.compress(state, scheme)
    ref = compressor.decompress(dict(stored), scheme)["weight"]
    ref32 = compressor.decompress({**stored, "weight_scale": stored["weight_scale"].float()}, scheme)["weight"]
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                                quantization_status="compressed").model_dump(mode="json")
    return {f"{MODULE}.{k}": v for k, v in stored.items()}, ref32, ref, config


CT_CASES = {
    "w4a16-group-sym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                               group_size=64)),
    "w4a16-group-asym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                                group_size=32)),
    "w4a16-channel-asym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="channel")),
    "w8a16-pack-channel": ("pack-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel")),
    "w8a16-int-channel": ("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel")),
    "w8a16-naive-group": ("naive-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="group",
                                                  group_size=128)),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel")),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="tensor")),
}
CT_EXPECTED = {  # case -> (values dtype, group, offsets?)
    "w4a16-group-sym": (ml_dtypes.int4, 64, False), "w4a16-group-asym": (ml_dtypes.int4, 32, True),
    "w4a16-channel-asym": (ml_dtypes.int4, IN, True), "w8a16-pack-channel": (np.int8, IN, False),
    "w8a16-int-channel": (np.int8, IN, False), "w8a16-naive-group": (np.int8, 128, False),
    "fp8-channel": (ml_dtypes.float8_e4m3fn, IN, False), "fp8-tensor": (ml_dtypes.float8_e4m3fn, IN, False),
}


@pytest.mark.parametrize("case", sorted(CT_CASES))
def test_compressed_tensors_match_the_library(case, tmp_path):
    fmt, weights = CT_CASES[case]
    stored, ref32, ref, config = _ct_module(fmt, weights, seed=len(case))
    norm = torch.randn(IN).to(torch.bfloat16)
    path = write_checkpoint(tmp_path / case, {**stored, "model.norm.weight": norm}, config)
    tensors = read_tensors(path)
    assert set(tensors) == {f"{MODULE}.weight", "model.norm.weight"}
    qw = tensors[f"{MODULE}.weight"].T
    dtype, group, offsets = CT_EXPECTED[case]
    assert qw.values.dtype == dtype and qw.group_size == group and (qw.offsets is not None) == offsets, \
        qw.describe()
    assert qw.shape == (IN, OUT) and qw.scales.dtype == np.float32
    assert_matches_reference(ferry_floats(tensors[f"{MODULE}.weight"]), ref32, ref)
    stored_norm = torch.from_numpy(np.asarray(tensors["model.norm.weight"]).view(np.int16))
    assert torch.equal(stored_norm, norm.view(torch.int16))


def test_compressed_tensors_errors(tmp_path):
    _ct()
    stored, _, _, config = _ct_module("pack-quantized", CT_CASES["w4a16-group-sym"][1], seed=0)
    w8a8 = json.loads(json.dumps(config))
    w8a8["config_groups"]["group_0"]["input_activations"] = dict(num_bits=8, type="int", symmetric=True,
                                                                 strategy="token", dynamic=True)
    with pytest.raises(ConfigError, match=r"config_groups\.group_0\.input_activations.*activation quantization"):
        hf_checkpoint.read_checkpoint(str(write_checkpoint(tmp_path / "w8a8", stored, w8a8)))
    three = json.loads(json.dumps(config))
    three["config_groups"]["group_0"]["weights"]["num_bits"] = 3
    with pytest.raises(ConfigError, match=r"config_groups\.group_0\.weights\.num_bits = 3 is not supported"):
        hf_checkpoint.read_checkpoint(str(write_checkpoint(tmp_path / "three", stored, three)))
    other = {**config, "format": "nvfp4-pack-quantized"}
    with pytest.raises(ConfigError, match=r"quantization_config\.format = 'nvfp4-pack-quantized'"):
        hf_checkpoint.read_checkpoint(str(write_checkpoint(tmp_path / "nvfp4", stored, other)))
    with pytest.raises(ConfigError, match=r"quant_method = 'bitsandbytes'"):
        hf_checkpoint.read_checkpoint(str(write_checkpoint(tmp_path / "bnb", stored, {"quant_method": "bitsandbytes"})))
    g_idx = {**stored, f"{MODULE}.weight_g_idx": torch.randperm(IN, generator=torch.Generator().manual_seed(0))
             .to(torch.int32) // 64}
    with pytest.raises(ConfigError, match=r"up_proj\.weight_g_idx: act-order"):
        read_tensors(write_checkpoint(tmp_path / "actorder", g_idx, config))


# ---------------------------------------------------------------- AWQ

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: word nibble i holds column 8 j + AWQ_ORDER[i]


def _pack_awq(codes: np.ndarray) -> np.ndarray:
    """AutoAWQ's GEMM packing (WQLinear_GEMM.from_linear), from its definition: [rows, cols] 4-bit codes ->
    int32 [rows, cols / 8], nibble i of word j the code of column 8 j + AWQ_ORDER[i]."""
    packed = np.zeros((codes.shape[0], codes.shape[1] // 8), np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        packed |= codes[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return packed.view(np.int32)


def _awq_reference(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm (awq/utils/packing_utils.py: unpack_awq, reverse_awq_order with
    AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7], then (iweight - izeros) * scales), in the scales' dtype."""
    shifts = torch.arange(0, 32, 4)
    iweight = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8).view(
        qweight.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8).view(
        qzeros.shape[0], -1)
    order = torch.arange(iweight.shape[-1], dtype=torch.int32).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    iweight, izeros = torch.bitwise_and(iweight[:, order], 15), torch.bitwise_and(izeros[:, order], 15)
    return (iweight - izeros.repeat_interleave(group, dim=0)) * scales.repeat_interleave(group, dim=0)


def test_awq_gemm_matches_the_reference_dequantization(tmp_path):
    """Codes and zeros drawn, packed as AutoAWQ packs them (checked against its own packer where autoawq is
    installed), read by Ferry and compared with AutoAWQ's dequantization reproduced above."""
    group = 64
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(IN, OUT))
    zeros = rng.integers(0, 16, size=(IN // group, OUT))
    scales = torch.from_numpy(rng.uniform(0.001, 0.02, size=(IN // group, OUT))).half()
    qweight, qzeros = torch.from_numpy(_pack_awq(codes)), torch.from_numpy(_pack_awq(zeros))
    ref, ref32 = _awq_reference(qweight, qzeros, scales, group), _awq_reference(qweight, qzeros, scales.float(), group)
    drawn = (codes - np.repeat(zeros, group, 0)) * np.repeat(scales.float().numpy(), group, 0)
    np.testing.assert_array_equal(ref32.numpy(), drawn.astype(np.float32))  # the packing is the reference's
    try:  # AutoAWQ's own packer, where it is installed, packs the same words
        from awq.modules.linear.gemm import WQLinear_GEMM  # noqa: PLC0415
        linear = torch.nn.Linear(IN, OUT, bias=False).half()
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(drawn.T))
        awq = WQLinear_GEMM.from_linear(linear, 4, group, scales=scales, zeros=torch.from_numpy(zeros))  # [groups, out]
        assert torch.equal(awq.qweight, qweight) and torch.equal(awq.qzeros, qzeros)
    except ImportError:
        pass
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    stored = {f"{MODULE}.qweight": qweight, f"{MODULE}.qzeros": qzeros, f"{MODULE}.scales": scales}
    tensors = read_tensors(write_checkpoint(tmp_path / "awq", stored, config))
    qw = tensors[f"{MODULE}.weight"].T
    assert qw.values.dtype == ml_dtypes.int4 and qw.group_size == group and qw.offsets is not None
    assert_matches_reference(ferry_floats(tensors[f"{MODULE}.weight"]), ref32.T, ref.T.contiguous())
    for bad, match in (({**config, "version": "gemv"}, r"version = 'gemv'"), ({**config, "bits": 3}, r"bits = 3")):
        with pytest.raises(ConfigError, match=match):
            hf_checkpoint.read_checkpoint(str(write_checkpoint(tmp_path / "bad", stored, bad)))


# ---------------------------------------------------------------- GPTQ

def _pack_gptq(codes: np.ndarray, zeros: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's packing, from its definition: qweight [in * bits / 32, out], input i of word r at bits
    bits * (i % per) (per = 32 / bits); qzeros [groups, out * bits / 32], output j likewise along a row."""
    per = 32 // bits
    qweight = np.zeros((codes.shape[0] // per, codes.shape[1]), np.uint32)
    for i in range(per):
        qweight |= codes[i::per].astype(np.uint32) << np.uint32(bits * i)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per), np.uint32)
    for j in range(per):
        qzeros |= zeros[:, j::per].astype(np.uint32) << np.uint32(bits * j)
    return qweight.view(np.int32), qzeros.view(np.int32)


def _gptq_reference(qweight, qzeros, scales, g_idx, bits, v1: bool) -> torch.Tensor:
    """AutoGPTQ's QuantLinear dequantization (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, as gptqmodel's
    TorchQuantLinear.dequantize_weight keeps it), in the scales' dtype:
        zeros = (qzeros >> wf) & maxq  [+ 1 for the v1 checkpoint format]
        weight = (qweight >> wf) & maxq
        weights = scales[g_idx] * (weight - zeros[g_idx])"""
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    maxq = 2 ** bits - 1
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 32 // bits), wf.view(1, 1, -1))
    zeros = torch.bitwise_and(zeros, maxq).reshape(qzeros.shape[0], -1) + (1 if v1 else 0)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 32 // bits, -1), wf.view(1, -1, 1))
    weight = torch.bitwise_and(weight, maxq).reshape(-1, qweight.shape[1])
    g = g_idx.long()
    return scales[g] * (weight - zeros[g]).to(scales.dtype)  # [in, out]


@pytest.mark.parametrize("bits,sym,fmt", [(4, True, "gptq"), (4, False, "gptq"), (4, False, "gptq_v2"),
                                          (8, True, "gptq"), (8, False, "gptq_v2")])
def test_gptq_matches_the_reference_dequantization(bits, sym, fmt, tmp_path):
    group = 64
    rng = np.random.default_rng(bits + sym)
    maxq = 2 ** bits - 1
    codes = rng.integers(0, maxq + 1, size=(IN, OUT))
    zeros = np.full((IN // group, OUT), 2 ** (bits - 1)) if sym else rng.integers(1 if fmt == "gptq" else 0, maxq + 1,
                                                                                  size=(IN // group, OUT))
    stored_zeros = zeros - 1 if fmt == "gptq" else zeros  # v1 stores z - 1
    qweight, qzeros = _pack_gptq(codes, stored_zeros, bits)
    scales = torch.from_numpy(rng.uniform(0.001, 0.02, size=(IN // group, OUT))).half()
    g_idx = torch.arange(IN, dtype=torch.int32) // group
    stored = {f"{MODULE}.qweight": torch.from_numpy(qweight), f"{MODULE}.qzeros": torch.from_numpy(qzeros),
              f"{MODULE}.scales": scales, f"{MODULE}.g_idx": g_idx}
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": sym,
              "checkpoint_format": fmt}
    ref = _gptq_reference(stored[f"{MODULE}.qweight"], stored[f"{MODULE}.qzeros"], scales, g_idx, bits, fmt == "gptq")
    ref32 = _gptq_reference(stored[f"{MODULE}.qweight"], stored[f"{MODULE}.qzeros"], scales.float(), g_idx, bits,
                            fmt == "gptq")
    # the packing is the one the reference reads: it unpacks the codes and zeros drawn above
    drawn = (codes - np.repeat(zeros, group, 0)) * np.repeat(scales.float().numpy(), group, 0)
    np.testing.assert_array_equal(ref32.numpy(), drawn.astype(np.float32))
    tensors = read_tensors(write_checkpoint(tmp_path / "gptq", stored, config))
    qw = tensors[f"{MODULE}.weight"].T
    assert qw.values.dtype == (ml_dtypes.int4 if bits == 4 else np.int8) and qw.group_size == group
    assert (qw.offsets is None) == sym, qw.describe()
    assert_matches_reference(ferry_floats(tensors[f"{MODULE}.weight"]), ref32.T, ref.T.contiguous())


def test_gptq_act_order_and_bad_config_are_errors(tmp_path):
    bits, group = 4, 64
    rng = np.random.default_rng(0)
    qweight, qzeros = _pack_gptq(rng.integers(0, 16, size=(IN, OUT)), np.full((IN // group, OUT), 7), bits)
    g_idx = torch.from_numpy(rng.permutation(IN).astype(np.int32) // group)
    stored = {f"{MODULE}.qweight": torch.from_numpy(qweight), f"{MODULE}.qzeros": torch.from_numpy(qzeros),
              f"{MODULE}.scales": torch.ones(IN // group, OUT).half(), f"{MODULE}.g_idx": g_idx}
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": True, "sym": True}
    with pytest.raises(ConfigError, match=r"up_proj\.g_idx: act-order"):
        read_tensors(write_checkpoint(tmp_path / "actorder", stored, config))
    for bad, match in (({**config, "bits": 3}, r"quantization_config\.bits = 3 is not supported"),
                       ({**config, "checkpoint_format": "marlin"}, r"checkpoint_format = 'marlin'")):
        with pytest.raises(ConfigError, match=match):
            hf_checkpoint.read_checkpoint(str(write_checkpoint(tmp_path / "bad", stored, bad)))
