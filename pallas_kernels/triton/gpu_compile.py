"""The jax-triton kernel compiled for GPUs on a host without one, and what it turned into: ptxas's register and
spill report, the widths of the PTX's global loads, the shared memory a program needs. `check_cases` compiles
a list of configurations (the tuned table's by default: `table_cases`) and returns a row for each; the checks that
need no GPU read them (tests/pallas_kernels/test_gpu_compile.py, scripts/kernel_tables.py, and
scripts/tune_triton_kernels.py, which writes the table).

ptxas comes from the triton wheel (backends/nvidia/bin): `ptxas-blackwell`, which reads the PTX versions Triton
3.9 emits for every target (the wheel's plain `ptxas` is too old for sm_90a's).
"""

import itertools
import multiprocessing
import os
import re
import subprocess
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import jax.numpy as jnp

from pallas_kernels.triton import tuned_block_sizes as tuned

# A global load and its width: ld.global[.nc][.L1::...][.v2|.v4].<type>, or an asynchronous copy to shared memory.
_LOAD = re.compile(r"\b(?:ld\.global((?:\.[\w:]+)*?)(?:\.(v[248]))?\.([bsuf]\d+)|cp\.async\.c[ag]\.shared\.global)")


@dataclass(frozen=True, slots=True)
class PtxasReport:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int   # bytes


def ptxas_binary() -> str:
    import triton  # noqa: PLC0415 (only where a kernel is compiled)

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    if not os.path.exists(path):
        raise RuntimeError(f"no ptxas-blackwell in the triton wheel ({path})")
    return path


def ptxas_report(ptx: str, compute_capability: int) -> PtxasReport:
    """`ptxas -v` of `ptx` for sm_XX (sm_90a from 90: the arch-specific target Triton emits)."""
    arch = f"sm_{compute_capability}{'a' if compute_capability >= 90 else ''}"
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas_binary(), "-v", f"-arch={arch}", source, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, check=False)
    log = run.stdout + run.stderr
    if run.returncode:
        raise RuntimeError(f"ptxas failed for {arch}:\n{log[-2000:]}")
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not (registers and spills):
        raise RuntimeError(f"unexpected ptxas report:\n{log[-2000:]}")
    return PtxasReport(int(registers.group(1)), int(spills.group(1)), int(spills.group(2)))


def global_loads(ptx: str) -> Counter:
    """Global loads of the PTX by width: "cp.async", "v4.b32", "v2.b16", "b16" (a scalar 16-bit load), ..."""
    counts = Counter()
    for match in _LOAD.finditer(ptx):
        if match.group(0).startswith("cp.async"):
            counts["cp.async"] += 1
        else:
            vector, elem = match.group(2), match.group(3)
            counts[f"{vector}.{elem}" if vector else elem] += 1
    return counts


def vector_loads(loads: Counter) -> int:
    return sum(n for kind, n in loads.items() if kind == "cp.async" or kind.startswith("v"))


def scalar_loads(loads: Counter, bits: int) -> int:
    """Scalar loads of `bits`-wide elements (16: bf16/f16 rows read one at a time)."""
    return sum(n for kind, n in loads.items() if kind[0] in "bsuf" and kind[1:] == str(bits))


# ----------------------------------------------------------------------------- the configurations


@dataclass(frozen=True, slots=True)
class Case:
    """One kernel configuration to compile: Llama-3-8B's head group (32 query heads over 8 KV heads) at
    `head_dim`, 64 sequences over 64-page tables (prefill: 512 query rows), unless told otherwise."""
    compute_capability: int
    decode: bool
    dtype: str
    head_dim: int
    block_size: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    soft_cap: float | None = None
    windowed: bool = False
    has_sinks: bool = False
    kv_dtype: str | None = None   # int8 / float8_e4m3fn: quantized pages
    num_splits: int = 1
    blocks: tuned.BlockSizes | None = field(default=None)  # None: the table's

    @property
    def name(self) -> str:
        extras = [x for x, on in (("cap", self.soft_cap), ("window", self.windowed), ("sinks", self.has_sinks),
                                  (self.kv_dtype, self.kv_dtype), (f"split{self.num_splits}", self.num_splits > 1))
                  if on]
        return (f"sm_{self.compute_capability} {'decode' if self.decode else 'prefill'} {self.dtype} "
                f"d{self.head_dim} bs{self.block_size}" + "".join(f" {x}" for x in extras))


def table_cases() -> list[Case]:
    """Every configuration of the tuned table, at the head dims it serves (80 and 96 by 128's entry), and the
    kernel's variants (soft-cap, window, sinks, int8 and float8 pages, split-K) at a 128-wide bfloat16 head on
    each architecture (float8 from sm_89: sm_80 has no float8 conversions)."""
    cases = [Case(cc, decode, dtype, head_dim, block_size)
             for cc, decode, dtype, head_dim, block_size in itertools.product(
                 tuned.ARCHITECTURES, (True, False), tuned.DTYPES, (64, 80, 96, 128, 256), tuned.BLOCK_SIZES)]
    for cc, decode in itertools.product(tuned.ARCHITECTURES, (True, False)):
        variant = dict(compute_capability=cc, decode=decode, dtype="bfloat16", head_dim=128, block_size=16)
        cases += [Case(**variant, soft_cap=30.0, windowed=True), Case(**variant, has_sinks=True, windowed=True),
                  Case(**variant, kv_dtype="int8")]
        if cc >= 89:  # float8 needs sm_89's conversions
            cases.append(Case(**variant, kv_dtype="float8_e4m3fn"))
        if decode:
            cases.append(Case(**variant, num_splits=4))
    return cases


def compile_case(case: Case) -> dict:
    """Compile `case` (jax_triton.compile_for_gpu) and read the result: a row with the launch, registers, spill
    bytes, shared memory, the global loads by width, and whether the K/V loads are vector loads."""
    from pallas_kernels.triton import jax_triton as jt  # noqa: PLC0415 (imports triton)

    rows = 64 if case.decode else 512
    page_dim = case.head_dim + (4 if case.kv_dtype else 0)
    kwargs = dict(table_width=64, num_seqs=64, decode=case.decode, compute_capability=case.compute_capability,
                  scale=case.head_dim ** -0.5, soft_cap=case.soft_cap, windowed=case.windowed,
                  kv_dtype=jnp.dtype(case.kv_dtype) if case.kv_dtype else None, has_sinks=case.has_sinks,
                  num_splits=case.num_splits)
    q_shape = (rows, case.num_q_heads, case.head_dim)
    k_shape = (4096, case.block_size, case.num_kv_heads, page_dim)
    asm = jt.compile_for_gpu(q_shape, k_shape, jnp.dtype(case.dtype), blocks=case.blocks, **kwargs)
    report = ptxas_report(asm["ptx"], case.compute_capability)
    loads = global_loads(asm["ptx"])
    launch = asm["launch"]
    kv_bits = 8 * jnp.dtype(case.kv_dtype or case.dtype).itemsize
    return dict(
        case=case.name, **{k: v for k, v in asdict(case).items() if k != "blocks"},
        tile_keys=launch.constexprs["TILE_KEYS"], block_q=launch.block_q, num_warps=launch.num_warps,
        num_stages=launch.num_stages, registers=report.registers, spill_stores=report.spill_stores,
        spill_loads=report.spill_loads, shared=asm["shared"],
        shared_limit=tuned.SHARED_MEMORY[tuned.architecture(case.compute_capability)],
        loads=dict(loads), vector_loads=vector_loads(loads), scalar_kv_loads=scalar_loads(loads, kv_bits))


def passes(row: dict) -> list[str]:
    """What is wrong with a compiled row (empty: nothing): spills, shared memory over the architecture's limit,
    K/V read by scalar loads (for 16- and 8-bit pages: any scalar load of that width; float32 pages: fewer vector
    loads than the two K/V tiles need)."""
    problems = []
    if row["spill_stores"]:
        problems.append(f"{row['spill_stores']} bytes of spill stores")
    if row["shared"] > row["shared_limit"]:
        problems.append(f"{row['shared']} bytes of shared memory > {row['shared_limit']}")
    if row["vector_loads"] < 2:
        problems.append(f"no vector K/V loads: {row['loads']}")
    if row["kv_dtype"] is None and row["dtype"] != "float32" and row["scalar_kv_loads"]:
        problems.append(f"{row['scalar_kv_loads']} scalar loads of K/V's width: {row['loads']}")
    return problems


def check_cases(cases: list[Case], workers: int = 2) -> list[dict]:
    """compile_case of every case, `workers` processes at a time (each compile is one CPU core's work)."""
    if workers <= 1:
        return [compile_case(case) for case in cases]
    # spawn, not fork: the parent runs jax's threads
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(compile_case, cases))


# ----------------------------------------------------------------------------- the Pallas kernels, through Triton

_TRITON_CALL = re.compile(r'stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(.*?mhlo\.backend_config = \{(.*?)\}, ')
_IR = re.compile(r'\bir = "((?:[^"\\]|\\.)*)"')


def _mlir_string_bytes(literal: str) -> bytes:
    """The bytes of an MLIR string attribute's printed body (\\XX hex escapes, \\\\, \\", \\n, \\t)."""
    out, i = bytearray(), 0
    named = {'"': 34, "\\": 92, "n": 10, "t": 9}
    while i < len(literal):
        if literal[i] != "\\":
            out += literal[i].encode()
            i += 1
        elif literal[i + 1] in named:
            out.append(named[literal[i + 1]])
            i += 2
        else:
            out.append(int(literal[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def pallas_triton_kernels(stablehlo: str) -> list[dict]:
    """The Triton kernels of a CUDA lowering's Pallas calls (pallas_kernels/lowering.export_for's text): each
    call's Triton IR as text (jaxlib's Triton dialect prints it from the bytecode Pallas serialises), its name,
    num_warps and num_stages. What XLA would compile on a GPU, and what `compile_pallas_kernel` compiles here."""
    from jax._src.lib.mlir import ir  # noqa: PLC0415 (private: jaxlib's MLIR with its Triton dialect)
    from jax._src.lib.triton import dialect  # noqa: PLC0415

    kernels = []
    for call in _TRITON_CALL.finditer(stablehlo):
        config = call.group(1)
        attrs = dict(re.findall(r"(\w+) = (\d+) : i32", _IR.sub("", config)))
        name = re.search(r'name = "([^"]*)"', _IR.sub("", config)).group(1)
        context = ir.Context()
        dialect.register_dialect(context)
        with context:
            module = ir.Module.parse(_mlir_string_bytes(_IR.search(config).group(1)))
            text = module.operation.get_asm(enable_debug_info=False)
        kernels.append(dict(name=name, ttir=text, num_warps=int(attrs["num_warps"]),
                            num_stages=int(attrs["num_stages"])))
    return kernels


def compile_pallas_kernel(kernel: dict, compute_capability: int) -> dict:
    """A pallas_triton_kernels entry compiled by the triton wheel for sm_XX (its passes stand in for XLA's Triton,
    a close relative): Triton's assembly stages by name, plus "shared"."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{kernel['name']}.ttir")
        with open(path, "w") as f:
            f.write(kernel["ttir"])
        compiled = triton.compile(path, target=GPUTarget("cuda", compute_capability, 32),
                                  options={"num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"]})
    return {**compiled.asm, "shared": compiled.metadata.shared}
