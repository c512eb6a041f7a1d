#!/usr/bin/env python
"""Write the jax-triton kernel's tuned table (pallas_kernels/triton/tuned_block_sizes.py) from compiles alone.

  python scripts/tune_triton_kernels.py                 # every entry; rewrites the table (minutes on 2 cores)
  python scripts/tune_triton_kernels.py --smoke         # one entry, printed, nothing written (CI)

For each entry (architecture, decode/prefill, dtype, padded head_dim, page size) it compiles the candidates below in
order of preference with triton.compile (no GPU needed), each as it is, with soft-cap, window and sinks, and over
int8 pages, and keeps the first that ptxas reports with 0 bytes of spill stores in all three, whose shared memory
fits the architecture's, and whose K/V loads are vector loads (pallas_kernels/triton/gpu_compile.py). Preference:
more keys a loop step, more query rows a tile, then more pipeline stages, then fewer warps. Prints the table
(markdown) and, with --json_out, every compile tried.
"""

import argparse
import dataclasses
import itertools
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.triton import gpu_compile  # noqa: E402
from pallas_kernels.triton import tuned_block_sizes as tuned  # noqa: E402

B = tuned.BlockSizes
# (decode, 16-bit) -> candidates, preferred first. Decode has one token's head group as its rows.
CANDIDATES = {
    (True, True): [B(16, 64, 4, 3), B(16, 64, 4, 2), B(16, 64, 8, 2), B(16, 32, 4, 3), B(16, 32, 4, 2),
                   B(16, 16, 4, 2), B(16, 16, 8, 2), B(16, 16, 8, 1)],
    (True, False): [B(16, 32, 4, 2), B(16, 32, 4, 1), B(16, 32, 8, 1), B(16, 16, 4, 1), B(16, 16, 8, 1)],
    (False, True): [B(64, 64, 4, 3), B(64, 64, 4, 2), B(64, 64, 8, 2), B(64, 32, 4, 2), B(64, 32, 8, 2),
                    B(32, 32, 4, 2), B(32, 32, 8, 2), B(32, 16, 4, 1), B(16, 16, 4, 1), B(16, 16, 8, 1)],
    (False, False): [B(32, 32, 4, 2), B(32, 32, 4, 1), B(32, 32, 8, 1), B(32, 16, 4, 1), B(16, 16, 4, 1),
                     B(16, 16, 8, 1)],
}
# The kernel's variants with more live registers than the plain kernel: soft-cap, window and sinks together, and
# int8 pages (dequantized in registers). Each candidate must compile without spills in every one.
VARIANTS = (dict(soft_cap=30.0, windowed=True, has_sinks=True), dict(kv_dtype="int8"))
TABLE_FILE = os.path.join(os.path.dirname(tuned.__file__), "tuned_block_sizes.py")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="one entry (sm_90 bf16 decode d128 bs16), not written")
    p.add_argument("--workers", type=int, default=2, help="compiles at a time")
    p.add_argument("--json_out", default=None)
    return p.parse_args(argv)


def tune(entry, workers: int) -> tuple[tuned.BlockSizes | None, list[dict]]:
    """The first candidate of `entry` that passes, and every compile tried (in pairs of `workers`)."""
    cc, mode, dtype, head_dim, block_size = entry
    decode = mode == "decode"
    candidates = CANDIDATES[(decode, dtype != "float32")]
    tried = []
    for start in range(0, len(candidates), workers):
        batch = candidates[start:start + workers]
        # each candidate as it is, and in the variants that cost it the most registers
        variants = ({},) + VARIANTS
        cases = [gpu_compile.Case(cc, decode, dtype, head_dim, block_size, blocks=b, **variant)
                 for b in batch for variant in variants]
        rows = gpu_compile.check_cases(cases, workers=min(workers, len(cases)))
        for i, blocks in enumerate(batch):
            compiled = rows[len(variants) * i:len(variants) * (i + 1)]
            compiled[0]["problems"] = [p for row in compiled for p in gpu_compile.passes(row)]
            tried += compiled
            if not compiled[0]["problems"]:
                return blocks, tried
    return None, tried


def write_table(table: dict) -> None:
    lines = [f"    {key!r}: BlockSizes({b.rows}, {b.tile_keys}, {b.num_warps}, {b.num_stages}),"
             for key, b in sorted(table.items())]
    source = open(TABLE_FILE).read()
    body = "TUNED: dict[tuple, BlockSizes] = {\n" + "\n".join(lines) + "\n}\n"
    source = re.sub(r"TUNED: dict\[tuple, BlockSizes\] = \{.*?\}\n", lambda _: body, source, flags=re.S)
    with open(TABLE_FILE, "w") as f:
        f.write(source)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        entries = [(90, "decode", "bfloat16", 128, 16)]
    else:
        entries = list(itertools.product(tuned.ARCHITECTURES, ("decode", "prefill"), tuned.DTYPES, tuned.HEAD_DIMS,
                                         tuned.BLOCK_SIZES))
    table, tried, start = {}, [], time.time()
    print("| arch | mode | dtype | head_dim | page | rows | keys | warps | stages | registers | shared | tried |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for entry in entries:
        blocks, rows = tune(entry, args.workers)
        tried += rows
        if blocks is None:
            last = rows[-1 - len(VARIANTS)]
            print(f"| {' | '.join(map(str, entry))} | none passes: {last['problems']} |", flush=True)
            continue
        table[entry] = blocks
        row = rows[-1 - len(VARIANTS)]  # the chosen candidate, plain
        print(f"| sm_{entry[0]} | {' | '.join(map(str, entry[1:]))} | {blocks.rows} | {blocks.tile_keys} | "
              f"{blocks.num_warps} | {blocks.num_stages} | {row['registers']} | {row['shared']} | {len(rows)} |",
              flush=True)
    print(f"{len(table)}/{len(entries)} entries, {len(tried)} compiles, {time.time() - start:.0f} s")
    if not args.smoke:
        write_table(table)
        print(f"wrote {TABLE_FILE}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            entries = [dict(zip(("arch", "mode", "dtype", "head_dim", "block_size"), key), **dataclasses.asdict(b))
                       for key, b in table.items()]
            json.dump({"table": entries, "tried": tried}, f, indent=1, default=str)
    return 0 if len(table) == len(entries) else 1


if __name__ == "__main__":
    sys.exit(main())
