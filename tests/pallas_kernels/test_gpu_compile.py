"""What the GPU kernels compile to, checked on a host with no GPU (pallas_kernels/triton/gpu_compile.py).

* The jax-triton kernel: every configuration of its tuned table (sm_80, sm_89, sm_90; head_dim 64/80/96/128/256;
  bfloat16 and float32; pages of 16/32/64; decode and prefill) and its variants (soft-cap with a window, sinks,
  int8 and float8 pages, split-K), compiled by triton.compile as jax_triton.triton_call would: ptxas must report
  0 bytes of spill stores, the shared memory must fit the architecture's, and the K/V loads must be vector loads
  (16-byte cp.async / ld.global.v4), never one element at a time.
* The Pallas kernels, through the Triton IR their CUDA lowering carries (XLA compiles it on a GPU; here the triton
  wheel does): the same checks on the model head shapes.
* Pools past 4 GiB (every layer's pages in one array): both kernel families address them with 64-bit offsets.
Runs in both environments (jax 0.10.2 and 0.11.2); needs only the triton wheel (its ptxas-blackwell).
"""

import re

import jax
import jax.numpy as jnp
import pytest

from helpers.cuda_lowering import lower_for_cuda
from pallas_kernels.attention import paged_attention
from pallas_kernels.triton import gpu_compile
from pallas_kernels.triton import jax_triton as jt
from pallas_kernels.triton import tuned_block_sizes as tuned
from pallas_kernels.triton.decode import paged_decode_attention
from pallas_kernels.triton.prefill import paged_prefill_attention

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _table(rows):
    lines = [f"{r['case']}: warps {r['num_warps']} stages {r['num_stages']} keys {r['tile_keys']} "
             f"regs {r['registers']} spill {r['spill_stores']} shared {r['shared']} loads {r['loads']}" for r in rows]
    return "\n".join(lines)


def test_tuned_table_covers_every_configuration():
    """Every (architecture, mode, dtype, padded head_dim, page size) has its own entry: none falls to the rule."""
    for cc in tuned.ARCHITECTURES:
        for mode in ("decode", "prefill"):
            for dtype in tuned.DTYPES:
                for head_dim in tuned.HEAD_DIMS:
                    for block_size in tuned.BLOCK_SIZES:
                        assert (cc, mode, dtype, head_dim, block_size) in tuned.TUNED
    assert tuned.architecture(86) == 89 and tuned.architecture(100) == 90 and tuned.architecture(80) == 80


@pytest.mark.parametrize("capability", tuned.ARCHITECTURES)
def test_jax_triton_kernel_compiles_without_spills_and_with_vector_loads(capability):
    cases = [case for case in gpu_compile.table_cases() if case.compute_capability == capability]
    rows = gpu_compile.check_cases(cases)
    print(_table(rows))  # the compile / spill / vector-load table, shown with -s or on failure
    failures = {row["case"]: gpu_compile.passes(row) for row in rows if gpu_compile.passes(row)}
    assert not failures, failures
    # pipelined (2+ stages): Triton's software pipeliner copies K/V ahead into shared memory, even though each
    # step's addresses come from a block-table load in the same step
    pipelined = [row for row in rows if row["num_stages"] > 1 and row["dtype"] == "bfloat16" and not row["kv_dtype"]]
    assert pipelined and all(row["loads"].get("cp.async") for row in pipelined), _table(pipelined)


def test_checks_catch_scalar_loads_and_spills():
    """The checks can fail: without jax_triton's 16-byte alignment the same kernel reads K/V one element at a
    time (ld.global.b16), and a tile too big for the registers spills."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    launch = jt.plan_launch((64, 32, 128), (512, 16, 8, 128), jnp.bfloat16, num_seqs=64, table_width=64,
                            decode=True, scale=0.1, soft_cap=None, compute_capability=90)
    signature = {**launch.pointer_types(jnp.bfloat16, jnp.bfloat16), **{k: "constexpr" for k in launch.constexprs}}
    unaligned = triton.compile(ASTSource(launch.kernel, signature, constexprs=launch.constexprs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
    loads = gpu_compile.global_loads(unaligned.asm["ptx"])
    assert gpu_compile.scalar_loads(loads, 16) > 0 and not loads.get("cp.async"), loads

    spilling = gpu_compile.compile_case(gpu_compile.Case(
        80, False, "float32", 128, 64, blocks=tuned.BlockSizes(rows=64, tile_keys=64, num_warps=4, num_stages=1)))
    assert spilling["spill_stores"] > 0 and gpu_compile.passes(spilling), spilling


def test_float32_compiles_with_ieee_dots():
    """float32 asks for IEEE dots (Triton's default is TF32): no tf32 MMA in the PTX."""
    for decode in (True, False):
        asm = jt.compile_for_gpu((64, 32, 128), (512, 16, 8, 128), jnp.float32, table_width=64, num_seqs=8,
                                 decode=decode, compute_capability=80)
        assert ".tf32" not in asm["ptx"] and asm["cubin"][:4] == b"\x7fELF"


# ----------------------------------------------------------------------------- the Pallas kernels

NUM_SEQS, TABLE_WIDTH, NUM_TOKENS = 8, 64, 256


def _pallas_specs(hq, hkv, d, dtype, rows, num_blocks=512, block_size=16):
    pages = jax.ShapeDtypeStruct((num_blocks, block_size, hkv, d), dtype)
    return (jax.ShapeDtypeStruct((rows, hq, d), dtype), pages, pages,
            jax.ShapeDtypeStruct((NUM_SEQS, TABLE_WIDTH), jnp.int32), jax.ShapeDtypeStruct((NUM_SEQS,), jnp.int32),
            jax.ShapeDtypeStruct((NUM_SEQS + 1,), jnp.int32))


def _pallas_kernels(f, specs):
    kernels = gpu_compile.pallas_triton_kernels(lower_for_cuda(f, specs))
    assert kernels, "no Pallas Triton kernel in the lowering"
    return kernels


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_pallas_kernels_compile_without_spills_and_with_vector_loads(capability, dtype, head_dim):
    """Decode and prefill at Llama-3-8B's head group, the architecture's tuned tiles."""
    problems = []
    for decode in (True, False):
        def f(q, k, v, tables, lens, qsl, decode=decode):
            if decode:
                return paged_decode_attention(q, k, v, tables, lens, scale=0.1, compute_capability=capability)
            return paged_prefill_attention(q, k, v, tables, lens, qsl, scale=0.1, compute_capability=capability)

        specs = _pallas_specs(32, 8, head_dim, dtype, NUM_SEQS if decode else NUM_TOKENS)
        for kernel in _pallas_kernels(f, specs):
            asm = gpu_compile.compile_pallas_kernel(kernel, capability)
            report = gpu_compile.ptxas_report(asm["ptx"], capability)
            loads = gpu_compile.global_loads(asm["ptx"])
            row = dict(spill_stores=report.spill_stores, shared=asm["shared"], loads=dict(loads),
                       shared_limit=tuned.SHARED_MEMORY[tuned.architecture(capability)], dtype=jnp.dtype(dtype).name,
                       kv_dtype=None, vector_loads=gpu_compile.vector_loads(loads),
                       scalar_kv_loads=gpu_compile.scalar_loads(loads, 8 * jnp.dtype(dtype).itemsize))
            if gpu_compile.passes(row):
                problems.append((kernel["name"], gpu_compile.passes(row)))
    assert not problems, problems


def test_pallas_variants_compile_without_spills():
    """Window + soft-cap, sinks and split-K at sm_90, bfloat16, head_dim 128."""
    window = jax.ShapeDtypeStruct((), jnp.int32)
    sinks = jax.ShapeDtypeStruct((32,), jnp.float32)

    def decode_split(q, k, v, tables, lens, qsl, window, sinks):
        return paged_decode_attention(q[:NUM_SEQS], k, v, tables, lens, scale=0.1, soft_cap=30.0, num_splits=4,
                                      sliding_window=window, sinks=sinks, compute_capability=90)

    def prefill(q, k, v, tables, lens, qsl, window, sinks):
        return paged_prefill_attention(q, k, v, tables, lens, qsl, scale=0.1, soft_cap=30.0, sliding_window=window,
                                       sinks=sinks, compute_capability=90)

    for f in (decode_split, prefill):
        for kernel in _pallas_kernels(f, (*_pallas_specs(32, 8, 128, jnp.bfloat16, NUM_TOKENS), window, sinks)):
            asm = gpu_compile.compile_pallas_kernel(kernel, 90)
            report = gpu_compile.ptxas_report(asm["ptx"], 90)
            loads = gpu_compile.global_loads(asm["ptx"])
            assert report.spill_stores == 0, (kernel["name"], report)
            assert loads.get("cp.async") and not gpu_compile.scalar_loads(loads, 16), (kernel["name"], loads)


# ----------------------------------------------------------------------------- pools past 4 GiB


def _offset_types(ttir: str, pointer_type: str, shape: str = r"[\dx]+") -> set[str]:
    """The offset element types of the tt.addptr ops on `shape` tensors of `pointer_type` pointers (gathers of q,
    K, V and the output; `shape` e.g. "64x128x": only those)."""
    return set(re.findall(rf"tt\.addptr .*: tensor<{shape}!tt\.ptr<{pointer_type}>>, tensor<{shape}(i\d+)>", ttir))


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_pallas_kernels_address_pools_past_4_gib_with_64_bit_offsets(decode):
    """A pool past 2**32 bytes (32 layers x 4,096 pages of 16 x 8 x 128 bfloat16, and one page more) lowers with
    64-bit K/V offsets, and compiles to PTX without spills; a 128 MiB pool keeps 32-bit ones."""
    def f(q, k, v, tables, lens, qsl):
        return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=0.1, impl="pallas")

    rows = NUM_SEQS if decode else NUM_TOKENS
    big = 32 * 4096 + 1  # pages of 32 KiB: 2**32 bytes and one page
    (kernel,) = _pallas_kernels(f, _pallas_specs(32, 8, 128, jnp.bfloat16, rows, num_blocks=big))[:1]
    assert "i64" in _offset_types(kernel["ttir"], "bf16"), kernel["ttir"][:3000]  # q's own stay 32-bit
    asm = gpu_compile.compile_pallas_kernel(kernel, 90)
    assert gpu_compile.ptxas_report(asm["ptx"], 90).spill_stores == 0
    (small,) = _pallas_kernels(f, _pallas_specs(32, 8, 128, jnp.bfloat16, rows, num_blocks=4096))[:1]
    assert _offset_types(small["ttir"], "bf16") == {"i32"}


def test_jax_triton_kernel_addresses_pages_with_64_bit_offsets():
    """The jax-triton kernel computes every K/V offset in 64 bits, whatever the pool's size (the pool's shape is
    not part of its signature): its [64 keys x 128] gathers."""
    asm = jt.compile_for_gpu((64, 32, 128), (1 << 16, 16, 8, 128), jnp.bfloat16, table_width=64, num_seqs=64,
                             decode=True, compute_capability=90)
    assert asm["launch"].constexprs["TILE_KEYS"] == 64
    assert _offset_types(asm["ttir"], "bf16", "64x128x") == {"i64"}
