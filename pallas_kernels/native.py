"""Native CPU paged attention: an XLA FFI custom call (pallas_kernels/cpu/paged_attention.cc).

  paged_decode_attention_native(q, k_pages, v_pages, block_tables, context_lens, *, scale,
                                soft_cap=None)
  paged_prefill_attention_native(q, k_pages, v_pages, block_tables, context_lens,
                                 query_start_loc, *, scale, soft_cap=None)

take exactly the arguments of the references in pallas_kernels/reference.py and match them (float32
and bfloat16, q and pages of one dtype, or float32 q over bfloat16 pages: a bf16 KV cache under a
float32 model; GQA/MQA; any head_dim and block size; optional soft cap).
`stacked_matmul(x, packed, layer, n=N)` is x @ w[layer] for a [L, K, N] stack of weights (float32 or bfloat16)
packed once by `pack_stacked`, reading that layer's panels in place (the scanned decoder layers'
linears: XLA CPU copies a dynamic slice before its library dot).
`kv_write(pages, updates, slot_mapping)` scatters one step's K or V rows into the pages in place (XLA
CPU's own scatter into a 16-bit float cache rewrites every page). `rms_norm(x, w, eps=, offset=, delta=)` is a
decoder layer's RMSNorm (with delta: the residual add before it) in one call, where XLA CPU runs five
small fusions. They run on the CPU backend only. `available()` says whether the library is loaded (and logs why
not); callers fall back to the reference when it is False.

Where the library comes from, first match wins:
  1. $FERRY_NATIVE_ATTENTION_LIB, if set (must load: a RuntimeError says why not; nothing else is tried);
  2. pallas_kernels/cpu/_ferry_cpu_attention.so, built by the package's own build (setup.py) on
     `pip install .` and `pip install -e .`;
  3. a copy built on first use into $FERRY_CACHE_DIR (default ~/.cache/ferry), when (2) is missing
     or was built from another version of paged_attention.cc, a C++ compiler is found and
     $FERRY_NATIVE_AUTOBUILD is not "0". `python -m pallas_kernels.native --build` builds (2) by
     hand; `--check` reports which library loads.

Each library carries the hash of the source it was compiled from, so an edited .cc is never
served by a stale build, and the jaxlib version whose FFI headers it saw: one built against a
newer jaxlib than the running one is refused too (XLA takes handlers built with older headers).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
SOURCE = _HERE / "cpu" / "paged_attention.cc"
LIBRARY_NAME = "_ferry_cpu_attention.so"
PACKAGE_LIBRARY = _HERE / "cpu" / LIBRARY_NAME

DECODE_TARGET = "ferry_paged_decode_attention"
PREFILL_TARGET = "ferry_paged_prefill_attention"
KV_WRITE_TARGET = "ferry_kv_write"
STACKED_MATMUL_TARGET = "ferry_stacked_matmul"
RMS_NORM_TARGET = "ferry_rms_norm"
ADD_RMS_NORM_TARGET = "ferry_add_rms_norm"
ABI_VERSION = 8  # FerryPagedAttentionAbiVersion() in the .cc
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# ----------------------------------------------------------------------------- building


def source_hash(source: Path = SOURCE) -> str:
    return hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16]


def find_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_flags(machine: str | None = None, *, legacy: bool = False) -> list[str]:
    """Portable flags: no -march=native (wheels travel). On x86-64 the baseline is x86-64-v2 and
    the hot loops carry an AVX2/FMA clone picked at load time (target_clones in the source).
    `legacy`: the same baseline spelled for compilers older than GCC 12, without the clones."""
    machine = (machine or platform.machine()).lower()
    flags = ["-std=c++17", "-O3", "-fPIC", "-shared", "-fvisibility=hidden", "-fopenmp-simd",
             "-fno-math-errno", "-Wall", "-Wno-psabi"]
    if machine in ("x86_64", "amd64"):
        flags += (["-msse4.2", "-mpopcnt", "-DFERRY_NO_TARGET_CLONES"] if legacy
                  else ["-march=x86-64-v2"])
    if sys.platform.startswith("linux"):
        # Self-contained (no newer libstdc++ needed where the wheel lands, its symbols kept
        # private), unused code dropped and stripped: ~0.8 MB.
        flags += ["-static-libstdc++", "-static-libgcc", "-Wl,--exclude-libs,ALL",
                  "-ffunction-sections", "-fdata-sections", "-Wl,--gc-sections", "-s"]
    return flags


def compile_command(output: Path, *, include_dir: str | None = None, cxx: str | None = None,
                    source: Path = SOURCE, legacy: bool = False) -> list[str]:
    cxx = cxx or find_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    if include_dir is None:
        include_dir, headers_version = jax.ffi.include_dir(), _jaxlib_version()
    else:
        headers_version = "unknown"
    return [cxx, *compile_flags(legacy=legacy), "-isystem", str(include_dir),
            f'-DFERRY_SOURCE_HASH="{source_hash(source)}"',
            f'-DFERRY_JAXLIB_VERSION="{headers_version}"', str(source), "-o", str(output)]


def _jaxlib_version() -> str:
    import jaxlib
    return jaxlib.__version__


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def build(output: Path | str = PACKAGE_LIBRARY, *, include_dir: str | None = None,
          cxx: str | None = None, verbose: bool = False) -> Path:
    """Compiles paged_attention.cc into `output` (atomically: a half-written library never loads)."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=output.name + ".", suffix=".tmp", dir=output.parent)
    os.close(fd)
    try:
        errors = []
        for legacy in (False, True):  # the second try only matters for old compilers
            cmd = compile_command(Path(tmp), include_dir=include_dir, cxx=cxx, legacy=legacy)
            if verbose:
                print(" ".join(cmd), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                break
            errors.append(f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        else:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n" + "\n".join(errors))
        os.chmod(tmp, 0o755)
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return output


def cache_dir() -> Path:
    if os.environ.get("FERRY_CACHE_DIR"):
        return Path(os.environ["FERRY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ferry"


def cached_library_path() -> Path:
    # The FFI headers come from jaxlib: key the cache on its version too.
    return cache_dir() / f"_ferry_cpu_attention-{source_hash()}-jaxlib{_jaxlib_version()}.so"


# ----------------------------------------------------------------------------- loading

_lock = threading.Lock()
_state: dict = {}  # "lib", "path", "reason"


def _open(path: Path) -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    try:
        lib.FerryPagedAttentionAbiVersion.restype = ctypes.c_int
        lib.FerryPagedAttentionSourceHash.restype = ctypes.c_char_p
        lib.FerryPagedAttentionJaxlibVersion.restype = ctypes.c_char_p
        abi = lib.FerryPagedAttentionAbiVersion()
        built_from = lib.FerryPagedAttentionSourceHash().decode()
        headers = lib.FerryPagedAttentionJaxlibVersion().decode()
        lib.FerryPagedDecodeAttention, lib.FerryPagedPrefillAttention  # noqa: B018 (must exist)
        lib.FerryKvWrite, lib.FerryStackedMatmul  # noqa: B018 (must exist)
    except AttributeError as e:
        return None, f"{path} is not a Ferry attention library: {e}"
    if abi != ABI_VERSION:
        return None, f"{path} has ABI {abi}, this module needs {ABI_VERSION}"
    if SOURCE.exists() and built_from != source_hash():
        return None, f"{path} was built from another version of {SOURCE.name} (stale build)"
    if headers != "unknown" and _version_tuple(headers) > _version_tuple(_jaxlib_version()):
        # XLA accepts FFI handlers built against older headers, not always newer ones.
        return None, (f"{path} was built against jaxlib {headers}, newer than the running "
                      f"{_jaxlib_version()}")
    return lib, ""


def _locate() -> tuple[ctypes.CDLL | None, Path | None, str]:
    forced = os.environ.get("FERRY_NATIVE_ATTENTION_LIB")
    if forced:
        # An error, not the reference's fallback: asked for by name, a stale build would otherwise run
        # the XLA reference (~10x slower) with only a warning to say so.
        lib, why = _open(Path(forced))
        if lib is None:
            raise RuntimeError(f"FERRY_NATIVE_ATTENTION_LIB={forced} does not load: {why}")
        return lib, Path(forced), ""
    reasons = []
    for path in (PACKAGE_LIBRARY, cached_library_path() if SOURCE.exists() else None):
        if path is not None and path.exists():
            lib, why = _open(path)
            if lib is not None:
                return lib, path, ""
            reasons.append(why)
    if not reasons:
        reasons.append(f"{PACKAGE_LIBRARY} is not built")
    if os.environ.get("FERRY_NATIVE_AUTOBUILD", "1") == "0":
        return None, None, "; ".join(reasons + ["auto-build disabled (FERRY_NATIVE_AUTOBUILD=0)"])
    if not SOURCE.exists():
        return None, None, "; ".join(reasons + [f"{SOURCE} is missing, cannot build"])
    if find_compiler() is None:
        return None, None, "; ".join(reasons + ["no C++ compiler to build it (set CXX)"])
    target = cached_library_path()
    _log.info("building the native attention library into %s", target)
    try:
        build(target)
    except Exception as e:  # noqa: BLE001 (any failure means: not available)
        return None, None, "; ".join(reasons + [f"auto-build failed: {e}"])
    lib, why = _open(target)
    return lib, target, why


def _load() -> dict:
    with _lock:
        if not _state:
            if jax.default_backend() != "cpu" and not _cpu_backend_exists():
                _state.update(lib=None, path=None, reason="no CPU backend")
                return _state
            lib, path, reason = _locate()
            if lib is not None:
                for name, fn in ((DECODE_TARGET, lib.FerryPagedDecodeAttention),
                                 (PREFILL_TARGET, lib.FerryPagedPrefillAttention),
                                 (KV_WRITE_TARGET, lib.FerryKvWrite),
                                 (STACKED_MATMUL_TARGET, lib.FerryStackedMatmul),
                                 (RMS_NORM_TARGET, lib.FerryRmsNorm),
                                 (ADD_RMS_NORM_TARGET, lib.FerryAddRmsNorm)):
                    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
            else:
                _log.warning("native CPU paged attention unavailable (using the reference): %s",
                             reason)
            _state.update(lib=lib, path=path, reason=reason)
        return _state


def _cpu_backend_exists() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:
        return False


# The stacked matmul's paths and the environment switches that force them (read by the library on every
# call; the others unset): the CPU's own (AVX-512 where present, else AVX2 where present), AVX2 on an
# AVX-512 CPU, bf16 x widened instead of AVX512-BF16's dot products, the portable loops. For tests and
# benchmarks.
MATMUL_PATH_SWITCHES = {"default": {}, "avx2": {"FERRY_NATIVE_NO_AVX512": "1"},
                        "widened": {"FERRY_NATIVE_MATMUL_NO_BF16_DOT": "1"},
                        "portable": {"FERRY_NATIVE_MATMUL_GENERIC": "1"}}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them ("avx2", "fma", "avx512f", ...); empty elsewhere. Which
    native paths run is the library's choice (__builtin_cpu_supports); tests and benchmarks ask this to
    know which paths a CPU has."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def available() -> bool:
    """True when the native library is loaded and registered (built on first use if needed)."""
    return _load()["lib"] is not None


def unavailable_reason() -> str:
    """Why available() is False ("" when it is True)."""
    return _load()["reason"]


def library_path() -> Path | None:
    return _load()["path"]


def supports(q_dtype, page_dtype) -> bool:
    """Whether the native kernels take these dtypes: q and pages of one supported dtype, or float32 q
    over bfloat16 pages (read in place and widened per page: no cache copy)."""
    q_dtype, page_dtype = jnp.dtype(q_dtype), jnp.dtype(page_dtype)
    if q_dtype == page_dtype:
        return q_dtype in SUPPORTED_DTYPES
    return q_dtype == jnp.dtype(jnp.float32) and page_dtype == jnp.dtype(jnp.bfloat16)


# ----------------------------------------------------------------------------- the calls


def _check(q, k_pages, v_pages):
    if not available():
        raise RuntimeError(f"native CPU paged attention unavailable: {unavailable_reason()}")
    if not (supports(q.dtype, k_pages.dtype) and k_pages.dtype == v_pages.dtype):
        raise ValueError(f"native paged attention takes float32 or bfloat16 q and pages of one "
                         f"dtype, or bfloat16 pages under float32 q; got q {q.dtype}, k {k_pages.dtype}, "
                         f"v {v_pages.dtype}")


def _attrs(scale, soft_cap):
    # soft_cap 0 means "no cap" to the kernel.
    return dict(scale=np.float32(scale), soft_cap=np.float32(0.0 if soft_cap is None else soft_cap))


def paged_decode_attention_native(q, k_pages, v_pages, block_tables, context_lens, *, scale,
                                  soft_cap=None):
    """One query token per sequence: q [S, Hq, D] -> [S, Hq, D] (reference semantics)."""
    _check(q, k_pages, v_pages)
    call = jax.ffi.ffi_call(DECODE_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, k_pages, v_pages, jnp.asarray(block_tables, jnp.int32),
                jnp.asarray(context_lens, jnp.int32), **_attrs(scale, soft_cap))


def paged_prefill_attention_native(q, k_pages, v_pages, block_tables, context_lens,
                                   query_start_loc, *, scale, soft_cap=None):
    """Flat query tokens of several sequences: q [T, Hq, D] -> [T, Hq, D] (reference semantics)."""
    _check(q, k_pages, v_pages)
    call = jax.ffi.ffi_call(PREFILL_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, k_pages, v_pages, jnp.asarray(block_tables, jnp.int32),
                jnp.asarray(context_lens, jnp.int32), jnp.asarray(query_start_loc, jnp.int32),
                **_attrs(scale, soft_cap))


def kv_write(pages, updates, slot_mapping):
    """pages [NB, BS, H, D] with row slot_mapping[t] (block * BS + offset) set to updates[t] [T, H, D]
    (cast to the pages' dtype); slots outside the pages are dropped, as `.at[].set(mode="drop")`.
    More leading dims count as more blocks, in order ([L, NB, BS, H, D]: slot (l * NB + block) * BS +
    offset): a caller need not reshape a donated pool, which makes XLA copy it. The output aliases `pages`:
    under a donated cache XLA writes the T rows in place."""
    if not available():
        raise RuntimeError(f"native CPU kv write unavailable: {unavailable_reason()}")
    call = jax.ffi.ffi_call(KV_WRITE_TARGET, jax.ShapeDtypeStruct(pages.shape, pages.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(pages, updates.astype(pages.dtype), jnp.asarray(slot_mapping, jnp.int32))


GATED_ACTIVATIONS = ("silu", "gelu_tanh")  # the kernel's act attribute: their index
PANEL_COLS = 64  # kPanelCols in the .cc
STRIP_COLS = 16  # kStripCols
PANEL_STRIPS = PANEL_COLS // STRIP_COLS
PACKED_RANK = 5  # pack_stacked's [L, P, 4, KP, 16 * E]


def packed_shape(num_layers: int, k: int, n: int, dtype, groups: int = 1) -> tuple[int, ...]:
    """pack_stacked's output shape for a [num_layers, K, N] stack: [L, P, 4, KP, 16 * E] (see pack_stacked)."""
    panels = groups * -(-(n // groups) // PANEL_COLS)
    if jnp.dtype(dtype) == jnp.bfloat16:
        return num_layers, panels, PANEL_STRIPS, (k + 1) // 2, 2 * STRIP_COLS
    return num_layers, panels, PANEL_STRIPS, k, STRIP_COLS


def pack_stacked(w, groups: int = 1):
    """A stack of per-layer weights w [L, K, N] -> the panel-major layout stacked_matmul reads, once at
    load (the weights then stream from memory contiguously, where packing per call read 64 columns of
    every row of w: 6-13 GB/s a thread). `groups` equal parts of the columns (a fused [gate | up]: 2)
    are each zero-padded to whole 64-column panels, so a gated call finds the up's panel at a fixed
    offset from the gate's. [L, P, 4, KP, 16 * E], panel p holding 64 columns over all of K as 4 strips
    of 16 columns, one after another (a tile reads a strip's k steps as one stream):
      float32: KP = K, [l, p, s, k, j] = w[l, k, c + 16 s + j];
      bfloat16: KP = ceil(K / 2), [l, p, s, k2, 2 j + h] = w[l, 2 k2 + h, c + 16 s + j] (zero past K): the
      pairs of rows a bf16 dot product instruction takes, one 32-bit lane per column."""
    num_layers, k, n = w.shape
    if n % groups:
        raise ValueError(f"pack_stacked: N {n} does not split into {groups} equal parts")
    part = n // groups
    panels_per_part = -(-part // PANEL_COLS)
    w = w.reshape(num_layers, k, groups, part)
    w = jnp.pad(w, ((0, 0), (0, 0), (0, 0), (0, panels_per_part * PANEL_COLS - part)))
    w = w.reshape(num_layers, k, groups * panels_per_part, PANEL_STRIPS, STRIP_COLS)  # [L, K, P, 4, 16]
    if jnp.dtype(w.dtype) != jnp.bfloat16:
        return w.transpose(0, 2, 3, 1, 4)
    w = jnp.pad(w, ((0, 0), (0, k % 2), (0, 0), (0, 0), (0, 0)))
    w = w.reshape(num_layers, (k + 1) // 2, 2, groups * panels_per_part, PANEL_STRIPS, STRIP_COLS)
    return w.transpose(0, 3, 4, 1, 5, 2).reshape(packed_shape(num_layers, k, n, w.dtype, groups))


def unpack_stacked(packed, k: int, n: int, groups: int = 1):
    """pack_stacked's inverse: the [L, K, N] stack."""
    num_layers, panels = packed.shape[:2]
    part = n // groups
    if jnp.dtype(packed.dtype) == jnp.bfloat16:
        w = packed.reshape(num_layers, panels, PANEL_STRIPS, -1, STRIP_COLS, 2).transpose(0, 3, 5, 1, 2, 4)
        w = w.reshape(num_layers, -1, panels, PANEL_COLS)[:, :k]  # [L, K, P, 64]
    else:
        w = packed.transpose(0, 3, 1, 2, 4).reshape(num_layers, k, panels, PANEL_COLS)
    w = w.reshape(num_layers, k, groups, -1)[..., :part]
    return w.reshape(num_layers, k, n)


def stacked_matmul(x, packed_w, layer, *, n: int, groups: int = 1, gated: str | None = None,
                   dtype=jnp.float32, round_to=None, rows=None):
    """x [..., K] @ w[layer] -> [..., n], float32, where packed_w = pack_stacked(w, groups) for w [L, K, n]
    (float32, or bfloat16: widened exactly as it is read, the sums in float32), x float32 (or bfloat16
    under bfloat16 weights: on a CPU with AVX512-BF16 its pairs of products go through the bf16 dot
    instruction, exact products summed in float32) and an int32 scalar `layer` (clamped into [0, L) like
    a dynamic slice). The kernel reads the layer's panels where they lie in the stack: under
    jax.lax.scan with the stack closed over (not sliced by the scan), no per-step copy of a layer.
    Reference: jnp.dot(x.astype(float32), w[layer].astype(float32)).

    `gated` ("silu" or "gelu_tanh", groups 2): the columns are a fused [gate | up] projection and the
    result is gated_activation(sums, dtype) [..., n / 2] in `dtype` (float32 or bfloat16), applied on
    AVX-512 to each panel's sums while they are in cache (a bf16 MLP's float32 [M, 2I] round trip
    through memory was a tenth of its prefill step).

    `round_to` (not gated; None, float32 or bfloat16): the float32 result rounded to that dtype's precision,
    y.astype(round_to).astype(float32) in one pass, as a bf16 LM head's logits reach the sampler (XLA's two
    converts of [64, 32000] logits cost ~0.5 ms a step).

    `rows` (an int32 scalar; None: all of them): only x's first `rows` rows (flattened) are computed, the
    rest of the result left unwritten (garbage): a bucketed step's padding rows, which no real row reads."""
    if not available():
        raise RuntimeError(f"native CPU stacked matmul unavailable: {unavailable_reason()}")
    if packed_w.dtype not in SUPPORTED_DTYPES or x.dtype not in {jnp.dtype(jnp.float32), packed_w.dtype}:
        raise ValueError(f"native stacked matmul takes float32 or bfloat16 weights and float32 x (or x of the "
                         f"weights' dtype); got x {x.dtype}, packed_w {packed_w.dtype}")
    want = (packed_shape(packed_w.shape[0], x.shape[-1], n, packed_w.dtype, groups)
            if packed_w.ndim == PACKED_RANK else None)
    if tuple(packed_w.shape) != want or n % groups:
        raise ValueError(f"native stacked matmul: packed_w must be pack_stacked(w [L, K, {n}], groups={groups}) "
                         f"for x [..., K]; got x {x.shape}, packed_w {packed_w.shape}")
    width = n
    round_bf16 = round_to is not None and jnp.dtype(round_to) == jnp.bfloat16
    if round_to is not None and (gated is not None or jnp.dtype(round_to) not in SUPPORTED_DTYPES):
        raise ValueError(f"native stacked matmul: round_to is float32 or bfloat16, and not gated; got "
                         f"{round_to!r}, gated {gated!r}")
    if gated is not None:
        if gated not in GATED_ACTIVATIONS or groups != 2 or jnp.dtype(dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"native gated stacked matmul: act one of {GATED_ACTIVATIONS}, groups 2 and a "
                             f"float32 or bfloat16 dtype needed; got {gated!r}, groups {groups}, {jnp.dtype(dtype)}")
        width //= 2
    x2 = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(STACKED_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((x2.shape[0], width), dtype if gated else jnp.float32),
                            vmap_method="sequential")
    rows = x2.shape[0] if rows is None else rows
    y = call(x2, packed_w, jnp.asarray(layer, jnp.int32).reshape(()), jnp.asarray(rows, jnp.int32).reshape(()),
             act=np.int32(-1 if gated is None else GATED_ACTIVATIONS.index(gated)), groups=np.int32(groups),
             round_bf16=np.int32(round_bf16))
    return y.reshape(*x.shape[:-1], width)


def rms_norm(x, weight, *, eps: float, offset: float = 0.0, delta=None):
    """RMSNorm over x's last axis, as models.transformer.RMSNorm rounds it: in float32
    v * rsqrt(mean(v^2) + eps), then weight * normed.astype(dtype) (offset 0: Llama) or
    (normed * (offset + weight)).astype(dtype) (Gemma: offset 1). x float32 or bfloat16, weight [K] of
    x's dtype. With `delta` (x's shape; float32, e.g. a matmul's sums, or x's dtype), v is the residual
    add x + delta.astype(x.dtype), and the result is (normed, v). Reference: models.transformer.RMSNorm."""
    if not available():
        raise RuntimeError(f"native CPU rms norm unavailable: {unavailable_reason()}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"native rms norm takes float32 or bfloat16 x and weight [K] of its dtype; got x "
                         f"{x.dtype}{list(x.shape)}, weight {weight.dtype}{list(weight.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    like = jax.ShapeDtypeStruct(rows.shape, x.dtype)
    attrs = dict(eps=np.float32(eps), offset=np.float32(offset))
    if delta is None:
        out = jax.ffi.ffi_call(RMS_NORM_TARGET, like, vmap_method="sequential")(rows, weight, **attrs)
        return out.reshape(x.shape)
    if delta.shape != x.shape or delta.dtype not in {jnp.dtype(jnp.float32), x.dtype}:
        raise ValueError(f"native add rms norm: delta must have x's shape {list(x.shape)} and be float32 or "
                         f"{x.dtype}; got {delta.dtype}{list(delta.shape)}")
    total, out = jax.ffi.ffi_call(ADD_RMS_NORM_TARGET, (like, like), vmap_method="sequential")(
        rows, delta.reshape(rows.shape), weight, **attrs)
    return out.reshape(x.shape), total.reshape(x.shape)


def gate_product(gate, up, act: str = "silu"):
    """act(gate) * up in their dtype, as Hugging Face's act_fn(gate_proj(x)) * up_proj(x) rounds: act in
    float32, rounded once (torch's bfloat16 SiLU and GELU), then the product rounded. The MLP's gate
    wherever the gated stacked matmul does not run."""
    g = gate.astype(jnp.float32)
    a = jax.nn.silu(g) if act == "silu" else jax.nn.gelu(g, approximate=True)
    return a.astype(gate.dtype) * up


def gated_activation(sums, dtype, act: str = "silu"):
    """The gated stacked matmul's semantics in jnp: a fused [gate | up] projection's float32 sums
    [..., 2I] rounded to `dtype`, then gate_product -> [..., I]."""
    return gate_product(*jnp.split(sums.astype(dtype), 2, axis=-1), act)


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.native", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="store_true", help=f"compile into {PACKAGE_LIBRARY}")
    parser.add_argument("--output", type=Path, default=PACKAGE_LIBRARY, help="with --build")
    parser.add_argument("--check", action="store_true", help="load the library, say which")
    args = parser.parse_args(argv)
    if not (args.build or args.check):
        parser.error("nothing to do: pass --build and/or --check")
    if args.build:
        print(f"built {build(args.output, verbose=True)}")
    if args.check:
        if not available():
            print(f"native attention UNAVAILABLE: {unavailable_reason()}")
            return 1
        print(f"native attention available: {library_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
