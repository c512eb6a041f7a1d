#!/usr/bin/env python
"""Compile every program Ferry's engine would run on a TPU slice, on this host, with no TPU: whether a model fits
and compiles before a slice is rented.

  pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"   # libtpu, the real compilers
  python scripts/aot_compile.py --model /path/to/checkpoint --topology v6e:1x1
  python scripts/aot_compile.py --model config-only-dir --topology v6e:2x2 --tensor_parallel_size 4 --json_out t.json

--model is a checkpoint directory, a GGUF file, or a directory holding only a Hugging Face config.json (shapes need
no weights). The mesh comes from jax.experimental.topologies (the TPU devices of `--topology`, none of them on this
host), the parameters and the KV cache are ShapeDtypeStructs sharded as the engine shards them, and each program is
lowered and compiled by the engine's own path (engine/worker/compilation.compile_step): every decode and prefill
bucket for both samplers, and the swap copies. Per program: compiled or the error, XLA's memory analysis (temp,
argument, output, alias bytes, per device) and cost analysis. For the whole: HBM per device (weights + KV cache +
the largest temporaries) against the chip's.

XLA's cost analysis counts a loop body once, so the layer scan's program undercounts: the flops and bytes of the
decode programs come from compiles of the same step with the layers unrolled (the engine's --no-scan_layers
form), where every layer counts: of the model cut to one layer and to two, since its layers are identical,
cost(L) = cost(1) + (L - 1) x (cost(2) - cost(1)) (an unrolled compile of every layer would also compile the
attention kernel once per layer; DeepSeek's first dense-MLP layers are costed as its sparse ones). The Pallas
attention kernel reports its own pl.CostEstimate (every sequence at the table's full width, padding included).
`ideal` is what a decode step must read: every weight of the shard once (the embedding's gathered rows only, unless
tied to the head), the live KV cache at full length (unpadded), and the float32 logits rows; `ratio` is XLA's bytes
accessed over it, `padded` over the same with the KV cache at the pages' padded size (what the TPU kernel must copy:
docs/kernels.md).

Environment: JAX_PLATFORMS=cpu, TPU_SKIP_MDS_QUERY=1, TPU_WORKER_HOSTNAMES=localhost and TPU_ACCELERATOR_TYPE are
set here before jax is imported (a TPU host's metadata server is not asked).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time

# chip -> (TPU_ACCELERATOR_TYPE prefix, cores per chip as that name counts them, HBM bytes per chip)
CHIPS = {
    "v4": ("v4", 2, 32 << 30),
    "v5e": ("v5litepod", 1, 16 << 30),
    "v5p": ("v5p", 2, 95 << 30),
    "v6e": ("v6e", 1, 32 << 30),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint dir, GGUF file, or a dir with only config.json")
    p.add_argument("--topology", default="v6e:1x1", help="chip:AxB[xC], e.g. v5e:1x1, v6e:2x2, v5p:2x2x1")
    p.add_argument("--tensor_parallel_size", type=int, default=None, help="default: every chip of the topology")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv_cache_dtype", default=None, help="default: --dtype; int8 / fp8: quantized")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "fp8"],
                   help="weight-only quantized linears, as the engine's --quantization")
    p.add_argument("--quantization_group_size", type=int, default=128)
    p.add_argument("--max_num_seqs", type=int, default=64)
    p.add_argument("--max_model_len", type=int, default=2048)
    p.add_argument("--max_num_batched_tokens", type=int, default=512)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--num_blocks", type=int, default=None,
                   help="KV blocks (default: every sequence at full length, as the engine caps it)")
    p.add_argument("--samplers", default="greedy,full", help="comma-separated: greedy, full")
    p.add_argument("--programs", default="all", choices=["all", "decode", "largest"],
                   help="all buckets; decode buckets only; or the largest decode and prefill")
    p.add_argument("--expert_parallel", action="store_true", help="an MoE model's experts split whole over the "
                   "devices (EngineConfig.expert_parallel)")
    p.add_argument("--no_costs", action="store_true", help="skip the unrolled compiles for flops and bytes")
    p.add_argument("--json_out", default=None)
    return p.parse_args(argv)


def set_tpu_env(topology: str) -> tuple[str, tuple[int, ...]]:
    chip, _, dims = topology.partition(":")
    if chip not in CHIPS:
        raise SystemExit(f"--topology: unknown chip {chip!r}; expected one of {sorted(CHIPS)}")
    shape = tuple(int(x) for x in dims.split("x"))
    prefix, cores, _ = CHIPS[chip]
    os.environ.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost",
                      TPU_ACCELERATOR_TYPE=f"{prefix}-{math.prod(shape) * cores}")
    return chip, shape


def tpu_devices(topology: str, shape):
    from jax.experimental import topologies  # noqa: PLC0415
    bounds = (*shape, 1, 1)[:3]
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu", chip_config_name="default",
                                        chips_per_host_bounds=bounds, num_slices=1, wrap=(False,) * 3)
    return topo.devices


def abstract_params(cfg, dtype, mesh, tp: int, scan: bool, quantization=None, group_size=None):
    """graphdef and the state as ShapeDtypeStructs sharded on `mesh` as models/sharding.shard_model places them;
    with `quantization`, its linears quantized as the engine's --quantization makes them."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415

    from models.loading import abstract_model  # noqa: PLC0415
    from models.sharding import param_spec  # noqa: PLC0415
    from models.transformer import quantize_kernels  # noqa: PLC0415
    graphdef, state = abstract_model(cfg, dtype, scan=scan)
    if quantization:
        state = jax.eval_shape(lambda s: quantize_kernels(graphdef, s, quantization, group_size), state)
    params = nnx.to_pure_dict(state)
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    placed = []
    for path, leaf in flat:
        name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        placed.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                           sharding=NamedSharding(mesh, param_spec(name, leaf.shape, tp,
                                                                                   cfg.expert_parallel))))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(tree, placed))
    return graphdef, state


def shard_bytes(leaves) -> int:
    """Bytes one device holds of these sharded ShapeDtypeStructs (4-bit values at half a byte)."""
    from models.quantization import VALUE_BITS  # noqa: PLC0415
    total = 0
    for a in leaves:
        shard = a.sharding.shard_shape(a.shape)
        total += math.prod(shard) * VALUE_BITS.get(a.dtype, a.dtype.itemsize * 8) // 8
    return total


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes,
            "output_bytes": m.output_size_in_bytes, "alias_bytes": m.alias_size_in_bytes}


def costs(compiled) -> dict:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, list) else c
    return {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c.get("bytes accessed", 0.0))}


def ideal_decode_bytes(cfg, num_seqs, context, dtype, kv_dtype, tp, vocab_shard, page_dims=None,
                       weight_item=None, layer_bytes=None) -> float:
    """Weights of one shard once (the embedding's gathered rows, unless tied), the live KV cache (at the model's
    heads and head_dim, or at the pages' padded `page_dims`), the logits. `weight_item`: a linear weight's
    bytes (quantized: its values' and scales' share), default the dtype's. `layer_bytes`: a shard's decoder-layer
    weights as the model holds them, which MoE and MLA models take in place of the dense formula."""
    import jax.numpy as jnp  # noqa: PLC0415

    from models.transformer import qkv_widths  # noqa: PLC0415
    item = weight_item or jnp.dtype(dtype).itemsize
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    per_layer = h * sum(qkv_widths(cfg)) + cfg.num_heads * cfg.head_dim * h + 3 * h * i
    weights = layer_bytes if (cfg.num_experts or cfg.mla) and layer_bytes else layers * per_layer / tp * item
    embed = cfg.vocab_size * h * item / tp if cfg.tie_word_embeddings else num_seqs * h * item
    head = 0 if cfg.tie_word_embeddings else h * cfg.vocab_size * item / tp
    arrays, heads, dim = cfg.kv_cache_layout
    shards = 1 if cfg.mla else tp  # MLA's latent head: every shard holds it whole
    kv_heads, head_dim = (max(1, heads // shards), dim) if page_dims is None else (page_dims[0] // shards, page_dims[1])
    kv = arrays * layers * num_seqs * context * kv_heads * head_dim * jnp.dtype(kv_dtype).itemsize
    return weights + embed + head + kv + num_seqs * vocab_shard * 4


def main(argv=None):
    args = parse_args(argv)
    chip, shape = set_tpu_env(args.topology)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from engine.worker.compilation import Buckets, compile_step  # noqa: PLC0415
    from engine.worker.kv_cache import gather_blocks, scatter_blocks  # noqa: PLC0415
    from models.loading import read_checkpoint  # noqa: PLC0415
    from models.mesh import kv_cache_sharding, make_mesh  # noqa: PLC0415
    from models.paged import cache_page_dims, kv_cache_groups  # noqa: PLC0415
    from models.quantization import is_quantized  # noqa: PLC0415
    from models.sharding import check_tensor_parallel  # noqa: PLC0415
    from models.transformer import StaticGraphDef  # noqa: PLC0415
    from pallas_kernels.kernels import Kernels  # noqa: PLC0415
    from pallas_kernels.kv_quant import resolve_kv_dtype  # noqa: PLC0415

    devices = tpu_devices(args.topology, shape)
    tp = args.tensor_parallel_size or len(devices)
    mesh = make_mesh(devices[:tp])
    checkpoint = read_checkpoint(args.model)
    cfg = checkpoint.cfg
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads == 0 and not cfg.mla:  # a replica a shard (replicate_kv_heads)
        cfg = dataclasses.replace(cfg, num_kv_heads=tp)
    if cfg.num_experts and tp > 1:
        cfg = dataclasses.replace(cfg, expert_parallel=args.expert_parallel)  # as models/sharding.shard_model sets it
    check_tensor_parallel(cfg, tp)
    dtype = jnp.dtype(args.dtype)
    kv_dtype = resolve_kv_dtype(args.kv_cache_dtype) if args.kv_cache_dtype else jnp.dtype(args.dtype)
    max_model_len = min(args.max_model_len, checkpoint.max_model_len)
    width = math.ceil(max_model_len / args.block_size)
    groups = kv_cache_groups(cfg)
    num_blocks = args.num_blocks or 1 + args.max_num_seqs * width * groups.num_groups
    kernels = Kernels.for_mesh(mesh, dtype, kv_dtype)
    kernels.check_step_limits(args.max_num_seqs, width, max(args.max_num_batched_tokens, args.max_num_seqs))
    buckets = Buckets.make(args.max_num_seqs, max(args.max_num_batched_tokens, args.max_num_seqs), width,
                           kv_groups=groups.num_groups)
    def cache_spec(num_slots):
        spec = jax.ShapeDtypeStruct(
            (num_slots, num_blocks, args.block_size, *cache_page_dims(cfg, kernels, kv_dtype, tp)),
            kv_dtype, sharding=kv_cache_sharding(mesh, replicated=cfg.mla))
        return (spec,) * cfg.kv_cache_layout[0]

    cache = cache_spec(groups.num_slots)
    kv_spec = cache[0]
    fed = jax.ShapeDtypeStruct((buckets.decode_batch[-1],), jnp.int32, sharding=NamedSharding(mesh, P()))
    quantized = dict(quantization=args.quantization, group_size=args.quantization_group_size)
    graphdef, state = abstract_params(cfg, dtype, mesh, tp, scan=True, **quantized)
    graphdef = StaticGraphDef.of(graphdef)
    # the model cut to one and two layers, unrolled: the decode programs' costs (see the docstring); full attention
    # (one KV cache group) in both, whatever the model's windows
    unrolled = None if args.no_costs else [
        abstract_params(dataclasses.replace(cfg, num_layers=n, sliding_window=None, layer_types=(), first_k_dense=0),
                        dtype, mesh, tp, scan=False, **quantized) for n in (1, 2)]
    weight_bytes = shard_bytes(jax.tree.leaves(state))
    # a quantized linear weight's bytes, its scales' share included: the ideal step's
    linears = [q for q in jax.tree.leaves(nnx.to_pure_dict(state)["layers"], is_leaf=is_quantized) if is_quantized(q)]
    layer_item = linears and shard_bytes(jax.tree.leaves(linears)) / sum(
        math.prod(q.values.sharding.shard_shape(q.values.shape)) for q in linears)
    kv_bytes = len(cache) * shard_bytes([kv_spec])
    # MoE and MLA layers: the ideal step reads every layer weight once (at these batches every expert is hit)
    layer_bytes = shard_bytes(jax.tree.leaves({k: v for k, v in nnx.to_pure_dict(state).items()
                                               if k in ("layers", "dense_layers")}))
    print(f"{cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads}x{cfg.head_dim}, vocab {cfg.vocab_size}; {args.topology} ({devices[0].device_kind}), "
          f"TP {tp}; weights {args.quantization or dtype.name}; attention {kernels.attention}; "
          f"KV pages [{', '.join(map(str, kv_spec.shape))}] {kv_dtype.name}; "
          f"jax {jax.__version__}", flush=True)

    layouts = buckets.step_layouts()
    if args.programs == "decode":
        layouts = buckets.decode_layouts()
    elif args.programs == "largest":
        layouts = [buckets.decode_layouts()[-1], buckets.prefill_layouts()[-1]]
    modes = [m for m in args.samplers.split(",") if m]
    rows = []

    def run(name, compile_fn, cost_fn=None, ideal=None):
        row = {"program": name}
        t0 = time.perf_counter()
        try:
            compiled = compile_fn()
            row.update(status="ok", **memory(compiled), scanned=costs(compiled))
            if cost_fn is not None:
                row["unrolled"] = cost_fn()
        except Exception as e:  # noqa: BLE001 (the table reports every failure and goes on)
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            row.update(status="error", error=f"{type(e).__name__}: {' | '.join(lines[:3])[:400]}")
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        if ideal is not None:
            row["ideal_bytes"], row["ideal_padded_bytes"] = ideal
            if "unrolled" in row:
                row["ratio"] = row["unrolled"]["bytes_accessed"] / row["ideal_bytes"]
                row["ratio_padded"] = row["unrolled"]["bytes_accessed"] / row["ideal_padded_bytes"]
        rows.append(row)
        print_row(row)

    print(f"{'program':<34} {'status':<6} {'temp MiB':>9} {'args MiB':>9} {'alias MiB':>9} {'GFLOP':>8} "
          f"{'GB acc.':>8} {'ideal GB':>8} {'ratio':>6} {'padded':>6} {'s':>5}")
    for layout in layouts:
        for mode in modes:
            name = (f"decode b{layout.num_seqs}" if layout.decode else
                    f"prefill t{layout.num_tokens} s{layout.num_seqs}") + f" {mode}"
            step = lambda g, s, c=cache, layout=layout, mode=mode: compile_step(  # noqa: E731
                g, s, c, fed, layout, mode, kernels, mesh, args.block_size, cfg.vocab_size)
            cost_fn = None
            ideal = None
            if unrolled is not None and (layout.decode or args.programs != "all"):
                def cost_fn(layout=layout, mode=mode):
                    one_group = dataclasses.replace(layout, kv_groups=1)
                    one, two = (costs(compile_step(StaticGraphDef.of(g), s, cache_spec(n), fed, one_group, mode,
                                                   kernels, mesh, args.block_size, cfg.vocab_size))
                                for n, (g, s) in zip((1, 2), unrolled))
                    return {k: one[k] + (cfg.num_layers - 1) * (two[k] - one[k]) for k in one}
            if layout.decode:
                vocab_shard = cfg.vocab_size
                ideal = tuple(ideal_decode_bytes(cfg, layout.num_seqs, width * args.block_size, dtype, kv_dtype, tp,
                                                 vocab_shard, dims, layer_item or None, layer_bytes)
                              for dims in (None, kv_spec.shape[3:]))
            run(name, lambda step=step: step(graphdef, state), cost_fn, ideal)
    for n in buckets.swap_blocks:
        ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=NamedSharding(mesh, P()))
        blocks = jax.ShapeDtypeStruct((groups.num_slots, n, *kv_spec.shape[2:]), kv_dtype, sharding=kv_spec.sharding)
        with jax.set_mesh(mesh):
            run(f"swap-out {n} blocks", lambda ids=ids: gather_blocks.lower(cache, ids).compile())
            blocks = (blocks,) * len(cache)
            run(f"swap-in {n} blocks",
                lambda ids=ids, blocks=blocks: scatter_blocks.lower(cache, ids, blocks, False).compile())

    hbm = CHIPS[chip][2]
    ok = [r for r in rows if r["status"] == "ok"]
    largest_temp = max((r["temp_bytes"] for r in ok), default=0)
    need = weight_bytes + kv_bytes + largest_temp
    summary = {"model": args.model, "model_type": cfg.model_type, "topology": args.topology, "tp": tp,
               "quantization": args.quantization,
               "device_kind": devices[0].device_kind, "attention": kernels.attention, "jax": jax.__version__,
               "kv_cache_shape": list(kv_spec.shape), "weights_bytes_per_device": weight_bytes,
               "kv_cache_bytes_per_device": kv_bytes, "largest_temp_bytes": largest_temp,
               "hbm_needed_bytes": need, "hbm_bytes": hbm, "fits": need <= hbm,
               "compiled": len(ok), "failed": len(rows) - len(ok)}
    print(f"per device: weights {weight_bytes / 2**30:.2f} GiB + KV cache {kv_bytes / 2**30:.2f} GiB + largest "
          f"temporaries {largest_temp / 2**30:.3f} GiB = {need / 2**30:.2f} GiB of {hbm / 2**30:.0f} GiB HBM "
          f"({'fits' if need <= hbm else 'DOES NOT FIT'}); {len(ok)}/{len(rows)} programs compiled")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"summary": summary, "programs": rows}, f, indent=1)
    return 0 if len(ok) == len(rows) else 1


def print_row(r):
    mib = lambda key: f"{r[key] / 2**20:9.1f}" if key in r else f"{'':>9}"  # noqa: E731
    cost = r.get("unrolled") or r.get("scanned") or {}
    gflop = f"{cost['flops'] / 1e9:8.1f}" if cost else f"{'':>8}"
    gb = f"{cost['bytes_accessed'] / 1e9:8.3f}" if cost else f"{'':>8}"
    ideal = f"{r['ideal_bytes'] / 1e9:8.3f}" if "ideal_bytes" in r else f"{'':>8}"
    ratio = f"{r['ratio']:6.3f}" if "ratio" in r else f"{'':>6}"
    padded = f"{r['ratio_padded']:6.3f}" if "ratio_padded" in r else f"{'':>6}"
    print(f"{r['program']:<34} {r['status']:<6} {mib('temp_bytes')} {mib('argument_bytes')} {mib('alias_bytes')} "
          f"{gflop} {gb} {ideal} {ratio} {padded} {r['compile_s']:5.1f}", flush=True)
    if r["status"] != "ok":
        print(f"    {r['error']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
