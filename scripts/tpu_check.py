#!/usr/bin/env python
"""Check Ferry's TPU paged-attention kernel on a TPU VM: correctness against the references, timing,
and bandwidth against the chip's own copy bandwidth measured in the same run. The TPU counterpart of
scripts/gpu_check.py, with the same cases, inputs (NaN in every slot no sequence owns, shuffled
block tables), timing method and table.

  python scripts/tpu_check.py                      # real sizes, Mosaic-compiled kernel
  python scripts/tpu_check.py --json_out out.json  # also write the results as JSON
  python scripts/tpu_check.py --smoke              # tiny shapes, TPU interpreter, any backend

The kernel is pallas_kernels/tpu/ragged_paged_attention.py (ragged paged attention: decode and chunked prefill
through one pallas_call). "decode split-K" is gpu_check's small-batch long-context case; the TPU
kernel has no split-K, so it shows how a few long sequences fare. Exits 1 on any mismatch.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
from gpu_check import copy_bandwidth, parse_args, report, run_cases  # noqa: E402

from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu  # noqa: E402


def tpu_kernel(decode: bool, interpret: bool):
    """make_kernel(scale, soft_cap) for the TPU kernel (decode or prefill)."""
    def make(scale, soft_cap):
        def run(q, k, v, tables, lens, qsl=None):
            return ragged_paged_attention_tpu(q, k, v, tables, lens, qsl, decode=decode,
                                              scale=scale, soft_cap=soft_cap, interpret=interpret)
        return run
    return make


def main(argv=None):
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    device = jax.devices()[0]
    interpret = args.smoke or jax.default_backend() != "tpu"
    if interpret and not args.smoke:
        print("no TPU here: running the kernel in the TPU interpreter (slow); use --smoke")
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"seed {seed}, {'TPU interpreter' if interpret else 'Mosaic'}", flush=True)
    t_start = time.perf_counter()
    decode = tpu_kernel(decode=True, interpret=interpret)
    copy_gbs, copy_s = copy_bandwidth(args.copy_gib, args.trials, args.inner)
    rows = run_cases(
        args, np.random.default_rng(seed), jax.random.key(seed), decode_kernel=decode,
        split_kernel=decode, prefill_kernel=tpu_kernel(decode=False, interpret=interpret))
    return report(args, rows, {}, copy_gbs, copy_s, device, seed, interpret, t_start)


if __name__ == "__main__":
    sys.exit(main())
