"""Builds Ferry's native CPU attention library; all other metadata lives in pyproject.toml.

The library (pallas_kernels/native/_ferry_native.so) is a plain shared library loaded with ctypes, whose
targets are registered with XLA's FFI, not a Python extension module: its name carries no Python ABI tag, and
it is compiled by pallas_kernels/native/library.py's own command (the one the first-use fallback runs), with the
XLA FFI headers of the jaxlib in the build environment (jax.ffi.include_dir()). `pip install .` puts it in the
wheel; `pip install -e .` builds it in place next to its sources.

If the build environment has no jax or no C++ compiler, the library is skipped with a warning
(native.py then builds it on first use, or the dispatch uses the reference); set
FERRY_REQUIRE_NATIVE=1 to make that an error. A compile error always fails the build.
"""

import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
EXT_NAME = "pallas_kernels.native._ferry_native"
SOURCE = "pallas_kernels/native/ferry_native.cc"


def _load_native():
    """pallas_kernels/native/library.py as a standalone module (the package itself is not installed yet)."""
    spec = importlib.util.spec_from_file_location("_ferry_native_build", ROOT / "pallas_kernels" / "native"
                                                  / "library.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildFerryNative(build_ext):
    def get_ext_filename(self, fullname):
        # Called with the dotted name or (from get_ext_fullpath) its last part: plain .so, no
        # cpython-3xx-... suffix either way.
        if fullname.split(".")[-1] == EXT_NAME.split(".")[-1]:
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def _missing_prerequisite(self):
        try:
            import jax  # noqa: F401  (the FFI headers ship with jaxlib)
        except ImportError as e:
            return f"jax is not importable in the build environment ({e})"
        if not any(shutil.which(c) for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c):
            return "no C++ compiler found (set CXX)"
        return None

    def run(self):
        missing = self._missing_prerequisite()
        if missing:
            if os.environ.get("FERRY_REQUIRE_NATIVE") == "1":
                raise RuntimeError(f"cannot build the native attention library: {missing}")
            self.warn(f"skipping the native attention library: {missing}; it is built on first "
                      f"use instead (python -m pallas_kernels.native.library --build)")
            self.extensions = [e for e in self.extensions if e.name != EXT_NAME]
        super().run()

    def build_extension(self, ext):
        if ext.name != EXT_NAME:
            return super().build_extension(ext)
        output = Path(self.get_ext_fullpath(ext.name))
        native = _load_native()
        native.build(output, verbose=True)
        return None


setup(
    ext_modules=[Extension(EXT_NAME, sources=[SOURCE], optional=True)],
    cmdclass={"build_ext": BuildFerryNative},
    package_data={"pallas_kernels": ["native/*.cc", "native/*.h"]},  # the sources, for the first-use build
)
