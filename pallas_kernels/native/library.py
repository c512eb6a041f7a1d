"""The native CPU library: built from this folder's C++ sources, loaded, and its XLA FFI targets registered.

Where the library comes from, first match wins:
  1. $FERRY_NATIVE_ATTENTION_LIB, if set (must load: a RuntimeError says why not; nothing else is tried);
  2. pallas_kernels/native/_ferry_native.so, built by the package's own build (setup.py) on `pip install .` and
     `pip install -e .`;
  3. a copy built on first use into $FERRY_CACHE_DIR (default ~/.cache/ferry), when (2) is missing or was built
     from other sources, a C++ compiler is found and $FERRY_NATIVE_AUTOBUILD is not "0".
`python -m pallas_kernels.native.library --build` builds (2) by hand; `--check` reports which library loads.

The library is one translation unit, ferry_native.cc, which includes one header per kernel family. It exports
two C functions: FerryFfiTargets(), the table of its FFI targets (name, handler), which `_register` iterates as
jax's FFI examples iterate their `registrations()`; and FerryNativeInfo(), what it was built as: the ABI version
this module asked for, the hash of the sources, the jaxlib whose FFI headers it saw (one built against a newer
jaxlib than the running one is refused: XLA takes handlers built with older headers), and the layout constants
the Python side shares with the kernels. An edited source is never served by a stale build.

This module imports nothing of Ferry's: setup.py loads it on its own to build the library.
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

_log = logging.getLogger(__name__)

# The calling convention between ops.py and the kernels (attributes, operands, layouts): bump it with any change
# to them. The build passes it in (-DFERRY_ABI_VERSION) and the library reports it back.
ABI_VERSION = 12

SOURCE_DIR = Path(__file__).resolve().parent
SOURCE = SOURCE_DIR / "ferry_native.cc"  # the one translation unit
LIBRARY_NAME = "_ferry_native.so"
PACKAGE_LIBRARY = SOURCE_DIR / LIBRARY_NAME


class _Target(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("handler", ctypes.c_void_p)]


class _Info(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_int32), ("source_hash", ctypes.c_char_p),
                ("jaxlib_version", ctypes.c_char_p), ("panel_cols", ctypes.c_int32), ("strip_cols", ctypes.c_int32)]


# ----------------------------------------------------------------------------- building


def source_files(source_dir: Path = SOURCE_DIR) -> list[Path]:
    return sorted(p for p in Path(source_dir).iterdir() if p.suffix in (".cc", ".h"))


def source_hash(source_dir: Path = SOURCE_DIR) -> str:
    digest = hashlib.sha256()
    for path in source_files(source_dir):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


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
        # Self-contained (no newer libstdc++ needed where the wheel lands, its symbols kept private), unused
        # code dropped and stripped.
        flags += ["-static-libstdc++", "-static-libgcc", "-Wl,--exclude-libs,ALL",
                  "-ffunction-sections", "-fdata-sections", "-Wl,--gc-sections", "-s"]
    return flags


def compile_command(output: Path, *, include_dir: str | None = None, cxx: str | None = None,
                    source_dir: Path = SOURCE_DIR, legacy: bool = False) -> list[str]:
    cxx = cxx or find_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    if include_dir is None:
        include_dir, headers_version = jax.ffi.include_dir(), _jaxlib_version()
    else:
        headers_version = "unknown"
    return [cxx, *compile_flags(legacy=legacy), "-isystem", str(include_dir),
            f"-DFERRY_ABI_VERSION={ABI_VERSION}", f'-DFERRY_SOURCE_HASH="{source_hash(source_dir)}"',
            f'-DFERRY_JAXLIB_VERSION="{headers_version}"', str(Path(source_dir) / SOURCE.name), "-o", str(output)]


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
    """Compiles the library into `output` (atomically: a half-written library never loads)."""
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
    return cache_dir() / f"_ferry_native-{source_hash()}-jaxlib{_jaxlib_version()}.so"


# ----------------------------------------------------------------------------- loading

_lock = threading.Lock()
_state: dict = {}  # "lib", "path", "reason", "info", "targets"


def _open(path: Path) -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    try:
        lib.FerryNativeInfo.restype = ctypes.POINTER(_Info)
        lib.FerryFfiTargets.restype = ctypes.POINTER(_Target)
        lib.FerryFfiTargets.argtypes = [ctypes.POINTER(ctypes.c_int32)]
    except AttributeError as e:
        return None, f"{path} is not a Ferry native library: {e}"
    info = lib.FerryNativeInfo().contents
    if info.abi_version != ABI_VERSION:
        return None, f"{path} has ABI {info.abi_version}, this module needs {ABI_VERSION}"
    if SOURCE.exists() and info.source_hash.decode() != source_hash():
        return None, f"{path} was built from other sources than {SOURCE_DIR} holds (stale build)"
    headers = info.jaxlib_version.decode()
    if headers != "unknown" and _version_tuple(headers) > _version_tuple(_jaxlib_version()):
        return None, (f"{path} was built against jaxlib {headers}, newer than the running "
                      f"{_jaxlib_version()}")
    return lib, ""


def _locate() -> tuple[ctypes.CDLL | None, Path | None, str]:
    forced = os.environ.get("FERRY_NATIVE_ATTENTION_LIB")
    if forced:
        # An error, not the reference's fallback: asked for by name, a stale build would otherwise run
        # the XLA reference with only a warning to say so.
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
    _log.info("building the native CPU library into %s", target)
    try:
        build(target)
    except Exception as e:  # noqa: BLE001 (any failure means: not available)
        return None, None, "; ".join(reasons + [f"auto-build failed: {e}"])
    lib, why = _open(target)
    return lib, target, why


def _register(lib: ctypes.CDLL) -> list[str]:
    """Register every target of the library's table with XLA (CPU); returns their names."""
    count = ctypes.c_int32()
    table = lib.FerryFfiTargets(ctypes.byref(count))
    names = []
    for i in range(count.value):
        name = table[i].name.decode()
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(table[i].handler), platform="cpu")
        names.append(name)
    return names


def _load() -> dict:
    with _lock:
        if not _state:
            if jax.default_backend() != "cpu" and not _cpu_backend_exists():
                _state.update(lib=None, path=None, reason="no CPU backend")
                return _state
            lib, path, reason = _locate()
            if lib is not None:
                _state.update(info=lib.FerryNativeInfo().contents, targets=_register(lib))
            else:
                _log.warning("native CPU kernels unavailable (using the reference): %s", reason)
            _state.update(lib=lib, path=path, reason=reason)
        return _state


def _cpu_backend_exists() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:
        return False


def available() -> bool:
    """True when the native library is loaded and its targets registered (built on first use if needed)."""
    return _load()["lib"] is not None


def unavailable_reason() -> str:
    """Why available() is False ("" when it is True)."""
    return _load()["reason"]


def library_path() -> Path | None:
    return _load()["path"]


def info():
    """What the loaded library was built as (its FerryNativeInfo): the layout constants among it."""
    if not available():
        raise RuntimeError(f"the native CPU library is unavailable: {unavailable_reason()}")
    return _load()["info"]


def require(target: str) -> None:
    """Raise unless the library is loaded and registered `target`."""
    state = _load()
    if state["lib"] is None:
        raise RuntimeError(f"native CPU kernel {target} unavailable: {state['reason']}")
    if target not in state["targets"]:
        raise RuntimeError(f"the native library {state['path']} has no FFI target {target!r}")


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


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.native.library", description=__doc__,
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
            print(f"native CPU library UNAVAILABLE: {unavailable_reason()}")
            return 1
        print(f"native CPU library available: {library_path()} (targets: {', '.join(_load()['targets'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
