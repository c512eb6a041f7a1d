"""The native CPU kernels: a C++ library (one translation unit, a header per kernel family) registered as XLA
FFI targets (library.py) and called as JAX ops (ops.py)."""
