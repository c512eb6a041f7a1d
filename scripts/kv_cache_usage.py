"""KV cache a long request holds, by the KV cache manager's own count: with the model's sliding windows (KV cache
groups, models/paged.KVCacheGroups) and without them. One request of --context tokens is prefilled in --chunk
token chunks and then decodes --decode tokens through engine.core.kv_cache_manager.KVCacheManager, exactly as
the scheduler drives it (the full-attention groups' blocks for the whole prompt at admission, a sliding group's
for each chunk, blocks behind a window freed after each step); no model runs. Prints a table and writes JSON.

    python scripts/kv_cache_usage.py --model path/to/gemma-3-27b-it --context 32768
"""

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.core.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.core.request import Request, RequestStatus  # noqa: E402
from engine.worker.kv_cache import kv_bytes_per_block  # noqa: E402
from models.loading import read_checkpoint  # noqa: E402
from models.paged import kv_cache_groups  # noqa: E402


def held_blocks(group_windows: tuple[int, ...], context: int, chunk: int, decode: int, block_size: int) -> dict:
    """Block ids one request holds: at its peak, after its prefill, after its decodes. Each id is a page in
    every slot of the pool."""
    groups = len(group_windows)
    kv = KVCacheManager(num_blocks=2 + (context + decode) // block_size * groups + groups, num_host_blocks=0,
                        block_size=block_size, enable_prefix_caching=False, group_windows=group_windows)
    request = Request("r", [1] * context, max_tokens=decode + 1)
    assert kv.allocate_prefill(request) is not None
    request.status = RequestStatus.RUNNING
    held = lambda: kv.num_total - kv.num_free  # noqa: E731
    peak = 0
    while request.num_computed_tokens < request.prefill_target:  # the chunks, each step's update after it
        end = min(request.num_computed_tokens + chunk, request.prefill_target)
        assert kv.allocate_chunk(request, end) is not None
        peak = max(peak, held())
        request.num_computed_tokens = end
        kv.free_behind_window(request)
    after_prefill = held()
    request.append_output(1, context + decode + 1)  # the prefill's last chunk samples the first token
    for _ in range(decode):  # each a step: its slot, then its update
        if kv.needs_decode_slot(request):
            assert kv.allocate_decode_slots([request])
            peak = max(peak, held())
        request.num_computed_tokens = request.num_tokens
        request.append_output(1, context + decode + 1)
        kv.free_behind_window(request)
    return {"peak": peak, "after_prefill": after_prefill, "after_decode": held()}


def usage(model: str, context: int, chunk: int, decode: int, block_size: int, dtype: str) -> list[dict]:
    cfg = read_checkpoint(model).cfg
    rows = []
    for name, windows in (("windows", kv_cache_groups(cfg).windows), ("no window", (0,))):
        layout_cfg = cfg if name == "windows" else dataclasses.replace(cfg, sliding_window=None, layer_types=())
        block_bytes = kv_bytes_per_block(layout_cfg, block_size, dtype)
        held = held_blocks(windows, context, chunk, decode, block_size)
        groups = kv_cache_groups(layout_cfg)
        rows.append({"model": os.path.basename(os.path.normpath(model)), "layout": name,
                     "groups": groups.num_groups, "slots": groups.num_slots, "block_bytes": block_bytes,
                     **{f"{k}_blocks": v for k, v in held.items()},
                     **{f"{k}_gib": v * block_bytes / 2**30 for k, v in held.items()}})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True,
                        help="checkpoint dir, GGUF file, or a dir with only config.json (repeatable)")
    parser.add_argument("--context", type=int, default=32768, help="prompt tokens")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk tokens")
    parser.add_argument("--decode", type=int, default=256, help="tokens decoded after the prompt")
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", help="the KV cache's")
    parser.add_argument("--json_out", help="write the rows here")
    args = parser.parse_args(argv)
    rows = [r for m in args.model for r in usage(m, args.context, args.chunk, args.decode, args.block_size,
                                                 args.dtype)]
    print(f"{args.context} prompt tokens in {args.chunk}-token chunks, then {args.decode} decoded; block size "
          f"{args.block_size}, {args.dtype}")
    print(f"{'model':<22} {'layout':<10} {'groups':>6} {'slots':>5} {'peak GiB':>9} {'prefilled GiB':>13} "
          f"{'decoded GiB':>11} {'blocks':>7}")
    for r in rows:
        print(f"{r['model']:<22} {r['layout']:<10} {r['groups']:>6} {r['slots']:>5} {r['peak_gib']:>9.3f} "
              f"{r['after_prefill_gib']:>13.3f} {r['after_decode_gib']:>11.3f} {r['after_decode_blocks']:>7}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
