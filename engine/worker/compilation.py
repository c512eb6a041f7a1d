"""Compilation: the bucketed step shapes, compiling them ahead of time (warm-up), and counting compilations."""

import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import threading
import time

import jax
import jaxlib
import numpy as np
from tqdm import tqdm

from engine.worker.packing import StepLayout, bucket
from engine.worker.sampler import build_sampling_metadata
from engine.worker.step import pooling_step, prompt_logprobs_step, sample_step

log = logging.getLogger("ferry")

MIN_PREFILL_TOKENS = 16
# Warm-up compiles scored prompts' programs (echo, prompt_logprobs) at this many top logprobs: lm-eval's
SCORED, SCORED_TOP = "scored", 1


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2lo, ... up to the first power of two >= hi."""
    out, n = [], bucket(lo)
    while True:
        out.append(n)
        if n >= hi:
            return out
        n *= 2


@dataclasses.dataclass(frozen=True, slots=True)
class Buckets:
    decode_batch: tuple[int, ...]     # decode rows
    prefill_tokens: tuple[int, ...]   # flat token rows of a prefill call
    # its sequences: the step's decodes (one row each), then its prefill chunks; scored prompts' calls the first
    prefill_seqs: tuple[int, ...]
    width: int                        # block-table width: every sequence's most pages. One width:
                                      # the kernels loop over the pages a sequence uses, not the table
    swap_blocks: tuple[int, ...]      # blocks per swap copy
    kv_groups: int = 1                # KV cache groups: a block of each per page of a sequence

    @classmethod
    def make(cls, max_num_seqs, max_num_batched_tokens, max_blocks_per_seq, max_prefill_seqs=8, kv_groups=1):
        return cls(tuple(powers_of_two(1, max_num_seqs)),
                   tuple(powers_of_two(MIN_PREFILL_TOKENS, max_num_batched_tokens)),
                   tuple(powers_of_two(min(max_num_seqs, max_prefill_seqs), max_num_seqs)), max_blocks_per_seq,
                   tuple(powers_of_two(1, max_blocks_per_seq * kv_groups)), kv_groups)

    def pick(self, sizes, n):
        for size in sizes:
            if size >= n:
                return size
        raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")

    def decode_layout(self, rows: int) -> StepLayout:
        return StepLayout(rows, rows, self.width, rows, decode=True, kv_groups=self.kv_groups)

    def prefill_layout(self, tokens: int, seqs: int | None = None, all_logits: bool = False) -> StepLayout:
        seqs = seqs or self.prefill_seqs[0]
        return StepLayout(tokens, seqs, self.width, tokens if all_logits else seqs, decode=False,
                          kv_groups=self.kv_groups)

    def decode_layouts(self, min_rows: int = 0) -> list[StepLayout]:
        """The decode layouts of at least `min_rows` rows, smallest first."""
        return [self.decode_layout(rows) for rows in self.decode_batch if rows >= min_rows]

    def prefill_layouts(self, min_tokens: int = 0, min_seqs: int = 0) -> list[StepLayout]:
        """The plain prefill layouts of at least `min_tokens` token rows and `min_seqs` sequences, smallest first
        (by tokens, then sequences). A call has at most one sequence per token row."""
        return [self.prefill_layout(tokens, seqs) for tokens in self.prefill_tokens if tokens >= min_tokens
                for seqs in self.prefill_seqs if seqs >= min_seqs and (seqs == self.prefill_seqs[0] or seqs <= tokens)]

    def step_layouts(self) -> list[StepLayout]:
        """Every layout a plain (not prompt-scoring) step can take: what warm-up compiles."""
        return self.decode_layouts() + self.prefill_layouts()

    def scoring_layouts(self) -> list[StepLayout]:
        """Every layout a prompt-scoring call (echo, prompt_logprobs) can take: every row's logits, the fewest
        sequences."""
        return [self.prefill_layout(tokens, all_logits=True) for tokens in self.prefill_tokens]


@functools.cache
def ferry_source_hash() -> str:
    """A hash of the code that shapes the compiled programs (engine/, models/, pallas_kernels/: Python and C++)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in ("engine", "models", "pallas_kernels"):
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".cc", ".h"):
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def warm_records_dir() -> pathlib.Path | None:
    """Where warm-up records go (CompilationManager._warm_record): inside JAX's persistent compilation cache, so
    emptying the cache empties them too. None while the cache is off."""
    cache_dir = jax.config.jax_compilation_cache_dir
    return pathlib.Path(cache_dir) / "ferry-warm" if cache_dir else None


class CompilationManager:
    """Which compiled program each step runs, and compiling them ahead of time (tpu-inference's compilation
    manager): `warmup()` compiles every bucketed step shape, for the greedy sampler and the full one, and every
    swap copy; after it, `compile_guard` makes any new compilation an error. `layout_for` picks a step's bucket
    (while a cold lazy warm-up compiles on its thread, the smallest program already compiled)."""

    def __init__(self, runner, buckets: Buckets):
        self.runner = runner  # the ModelRunner whose steps these are
        self.buckets = buckets
        self._background: threading.Thread | None = None  # warm-up's background compiles, if any
        # the last warm-up's step programs: (compiled before it returned, left to the thread)
        self.warmup_split = (0, 0)
        self._stop_background = threading.Event()
        # While a cold lazy warm-up compiles on its thread: the (layout, sampler) programs compiled so far,
        # which steps pad up to (layout_for). None: every program is there, or compiles when first used.
        self._ready: set[tuple[StepLayout, str]] | None = None

    @property
    def warming(self) -> bool:
        """A cold lazy warm-up is still compiling: steps pad up to the programs it has (layout_for)."""
        return self._ready is not None

    def layout_for(self, seqs, decode: bool, mode: str = "greedy", all_logits: bool = False,
                   decodes: int = 0) -> StepLayout:
        """The bucketed layout for `seqs` (SeqSlices; for a decode step anything with a length), with
        `decodes` one-token sequences before them in a prefill call, and the sampler `mode`. While a cold lazy
        warm-up is still compiling (`_ready` is not None), the smallest program already compiled that holds
        them, which may be a larger bucket than theirs: padding a step costs less than compiling its program
        in it."""
        b = self.buckets
        if decode:
            exact = b.decode_layout(b.pick(b.decode_batch, len(seqs)))
        else:
            num_seqs = b.prefill_seqs[0] if all_logits else b.pick(b.prefill_seqs, decodes + len(seqs))
            exact = b.prefill_layout(b.pick(b.prefill_tokens, decodes + sum(len(s.token_ids) for s in seqs)), num_seqs,
                                     all_logits)
        ready = self._ready
        if ready is not None and not all_logits:  # a scored prompt takes its own (warmed in the background)
            larger = (b.decode_layouts(exact.num_seqs) if decode else
                      b.prefill_layouts(exact.num_tokens, exact.num_seqs))
            for layout in larger:
                if (layout, mode) in ready:
                    return layout
        return exact

    def pooling_layout(self, seqs) -> StepLayout:
        """A pooling call's layout (pooling_step, embeddings): the plain prefill bucket of `seqs` (SeqSlices), its
        own program whatever a lazy warm-up has compiled (those are the samplers')."""
        b = self.buckets
        return b.prefill_layout(b.pick(b.prefill_tokens, sum(len(s.token_ids) for s in seqs)),
                                b.pick(b.prefill_seqs, len(seqs)))

    def warmup_pooling(self) -> float:
        """EngineConfig.task "embed": compile pooling_step for every prefill layout, and the swap copies, before
        returning (no sampler program: such an engine never decodes). Returns the seconds it took."""
        t0 = time.perf_counter()
        layouts = self.buckets.prefill_layouts()
        cache = self.runner.kv.shapes()
        with (concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool,
              tqdm(total=len(layouts), desc="warm-up", unit="program") as bar):
            for future in concurrent.futures.as_completed([pool.submit(self.compile_pooling, layout, cache)
                                                           for layout in layouts]):
                future.result()
                bar.update(1)
        self.runner.kv.warm_swaps()
        self.runner.timings = {"device_s": 0.0, "pack_s": 0.0}
        elapsed = time.perf_counter() - t0
        log.info("warm-up: %d pooling programs and %d swap sizes in %.1f s", len(layouts),
                 len(self.buckets.swap_blocks), elapsed)
        return elapsed

    def compile_pooling(self, layout: StepLayout, cache=None):
        """pooling_step compiled ahead of time for `layout`, as compile_step does sample_step."""
        runner = self.runner
        buf = np.zeros(layout.size, np.int32)
        with jax.set_mesh(runner.mesh):
            return pooling_step.lower(runner.graphdef, runner.model.state, cache or runner.kv.shapes(), buf, layout,
                                      runner.kernels).compile()

    def warmup(self, sampling: bool, background: bool) -> float:
        """Compile every step layout for the greedy sampler and, if `sampling`, for the full one too,
        and every swap size.

        With `background`, only the programs that can run any step compile before this returns: for each
        sampler, the largest decode batch and the largest prefill. Steps pad up to the smallest program
        compiled so far (layout_for), and the rest compile on a thread, smallest first (`wait_for_warmup`
        joins it), then the swap copies. When the persistent cache is known to hold them all
        (`_warm_record`), nothing compiles before this returns: loading a program costs only its trace, so a
        warm start serves at once and a request that comes first loads its own program.

        Ahead of time (lower + compile: nothing runs and the cache is not touched), on one thread per
        core: tracing holds the GIL, XLA's compile does not. Returns the seconds it took."""
        t0 = time.perf_counter()
        layouts = self.buckets.step_layouts()
        modes = ("greedy", "full") if sampling else ("greedy",)
        groups = [[(layout, mode) for layout in layouts] for mode in modes]
        if sampling:  # scored prompts at lm-eval's one top logprob, offline (greedy) and served (with logprobs)
            groups.append([(layout, mode, SCORED) for mode in modes for layout in self.buckets.scoring_layouts()])
        groups = [(programs, self._warm_record(programs)) for programs in groups]
        now, later, self._ready = groups, [], None
        if background:
            greedy_record = groups[0][1]
            if greedy_record is not None and greedy_record.exists():
                now, later = [], groups
            else:
                largest = {(max((layout for layout in layouts if layout.decode == decode),
                                key=lambda layout: (layout.num_tokens, layout.num_seqs)), mode)
                           for decode in (True, False) for mode in modes}
                now = [([p for programs, _ in groups for p in programs if p in largest], None)]
                later = [(sorted([p for p in programs if p not in largest], key=lambda p: p[0].num_tokens), record)
                         for programs, record in groups]
                self._ready = set(largest)
        # Shapes only: the background thread must not touch the cache, which steps donate meanwhile.
        cache = self.runner.kv.shapes()
        self._compile_steps(now, cache, threads=os.cpu_count() or 1, progress=True)
        if not background:
            self.runner.kv.warm_swaps()
        if later:
            self._background = threading.Thread(target=self._compile_in_background, args=(later, cache),
                                                name="ferry-warmup", daemon=True)
            self._stop_background.clear()
            # At exit, stop after the compile in progress: the interpreter must not finalize under it (an
            # abort), nor wait for every queued program (a SIGTERM'd server took a minute to exit).
            atexit.register(self.stop_background_warmup)
            self._background.start()
        self.runner.timings = {"device_s": 0.0, "pack_s": 0.0}
        elapsed = time.perf_counter() - t0
        count = lambda gs: sum(len(programs) for programs, _ in gs)  # noqa: E731
        self.warmup_split = (count(now), count(later))
        log.info("warm-up: %d step programs%s in %.1f s%s", count(now),
                 "" if background else f" and {len(self.buckets.swap_blocks)} swap sizes", elapsed,
                 f"; {count(later)} programs and the swap copies compiling in the background" + (
                     "" if now else ", where an earlier start left them all in the persistent cache") if later else "")
        return elapsed

    def wait_for_warmup(self):
        """Join the background compilation `warmup(background=True)` started, if any."""
        if self._background is not None:
            self._background.join()
            self._background = None
            atexit.unregister(self.stop_background_warmup)

    def stop_background_warmup(self):
        """Let the background compilation finish the program in progress and stop; the rest compile on use."""
        self._stop_background.set()
        self.wait_for_warmup()

    def _warm_record(self, programs) -> pathlib.Path | None:
        """A file in JAX's persistent compilation cache that a finished compile of exactly `programs`
        (layout, sampler) leaves there, so the next start knows they load from it; None when the cache is
        off. A stale one (the cache emptied by hand) only costs compiles after serving starts. Its name
        hashes everything the compiled programs depend on: jax and jaxlib, Ferry's source, the model's
        config and parameter shapes, the cache's (block size included), the kernels, the devices, XLA_FLAGS."""
        records = warm_records_dir()
        if records is None:
            return None
        arrays = lambda tree: [(jax.tree_util.keystr(path), a.shape, str(a.dtype), str(a.sharding))  # noqa: E731
                               for path, a in jax.tree_util.tree_leaves_with_path(tree)]
        runner = self.runner
        key = repr((jax.__version__, jaxlib.__version__, ferry_source_hash(), runner.model.cfg,
                    arrays(runner.model.state), arrays(runner.kv.pages), programs, runner.kernels,
                    [(d.platform, d.device_kind) for d in runner.mesh.devices.flat], os.environ.get("XLA_FLAGS")))
        return records / hashlib.sha256(key.encode()).hexdigest()

    def _compile_steps(self, groups, cache, threads: int, progress: bool):
        """Compile each program of each group (programs, warm record or None) against `cache` (ShapeDtypeStructs),
        on `threads` threads; a group's record is left once it is done. A program: (layout, sampler mode) for
        sample_step, (layout, sampler mode, SCORED) for prompt_logprobs_step."""
        def compile_one(program):
            layout, mode, *scored = program
            self.compile_step(layout, mode, cache, scored=bool(scored))
            if self._ready is not None:
                self._ready.add(program)

        for programs, record in groups:
            if threads == 1:  # the background warm-up: stops early when asked (stop_background_warmup)
                for i, program in enumerate(programs):
                    if self._stop_background.is_set():
                        log.info("warm-up: background compilation stopped, %d programs left to compile on first use",
                                 len(programs) - i)
                        return
                    compile_one(program)
            else:
                with (concurrent.futures.ThreadPoolExecutor(threads) as pool,
                      tqdm(total=len(programs), desc="warm-up", unit="program", disable=not progress) as bar):
                    for future in concurrent.futures.as_completed([pool.submit(compile_one, p) for p in programs]):
                        future.result()
                        bar.update(1)
            if record is not None:
                try:
                    record.parent.mkdir(parents=True, exist_ok=True)
                    record.touch()
                except OSError as e:  # a read-only cache: the next start just loads in the foreground
                    log.warning("warm-up: cannot leave a record in %s: %s", record.parent, e)

    def compile_step(self, layout: StepLayout, mode: str, cache=None, scored: bool = False):
        """sample_step (`scored`: prompt_logprobs_step, at SCORED_TOP logprobs) compiled ahead of time for `layout`
        and sampler `mode`, against `cache` (default: the KV cache's shapes) and the arguments a step passes
        (shapes only: nothing runs)."""
        runner = self.runner
        return compile_step(runner.graphdef, runner.model.state, cache or runner.kv.shapes(), runner.fed, layout, mode,
                            runner.kernels, runner.mesh, runner.block_size, runner.model.cfg.vocab_size, scored)

    def _compile_in_background(self, groups, cache) -> None:
        t0 = time.perf_counter()
        self._compile_steps(groups, cache, threads=1, progress=False)
        if not self._stop_background.is_set():
            self._ready = None  # every step program is compiled: each step takes its own bucket again
            self.runner.kv.compile_swaps(cache)
            log.info("warm-up: the background thread compiled %d step programs and the swap copies in %.1f s",
                     sum(len(programs) for programs, _ in groups), time.perf_counter() - t0)


def compile_step(graphdef, state, cache, fed, layout: StepLayout, mode: str, kernels, mesh, block_size: int,
                 vocab_size: int, scored: bool = False):
    """sample_step compiled ahead of time for `layout` and sampler `mode` with the arguments a step passes:
    `state` and `cache` (arrays or ShapeDtypeStructs), `fed` (the decode feedback buffer, or its shape), the
    packed buffer and the sampling metadata as shapes. Lowered and compiled under the mesh context the steps
    run in: it is part of what a compiled program is keyed by (compiled outside it, the steps would compile
    again). Warm-up compiles through here, and so does scripts/aot_compile.py (for a TPU slice, from a CPU
    host)."""
    fed = jax.ShapeDtypeStruct(fed.shape, fed.dtype, sharding=fed.sharding) if layout.decode else None
    buf = np.zeros(layout.size, np.int32)
    sampling_md = (build_sampling_metadata([], layout.num_seqs, layout.width * block_size, vocab_size)
                   if mode == "full" else None)
    with jax.set_mesh(mesh):  # per thread: the mesh context is thread-local
        if scored:  # ModelRunner._dispatch's arguments: each row's next prompt token, each sequence's sample row
            next_ids, sample_rows = np.zeros(layout.num_tokens, np.int32), np.zeros(layout.num_seqs, np.int32)
            return prompt_logprobs_step.lower(graphdef, state, cache, buf, sampling_md, next_ids, sample_rows, layout,
                                              mode, SCORED_TOP, kernels).compile()
        return sample_step.lower(graphdef, state, cache, fed, buf, sampling_md, layout, mode, kernels).compile()


# ------------------------------------------------------------------ compile counting

class CompileCounter:
    """Counts XLA backend compilations through jax.monitoring (one event per compiled executable). A
    program loaded from the persistent compilation cache fires that event too; `cache_hits` counts those."""

    EVENT = "/jax/core/compile/backend_compile_duration"
    CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
    _registered = False
    count = 0
    cache_hits = 0

    @classmethod
    def install(cls):
        if not cls._registered:
            def listener(event, duration, **kwargs):
                if event == cls.EVENT:
                    cls.count += 1

            def hit_listener(event, **kwargs):
                if event == cls.CACHE_HIT_EVENT:
                    cls.cache_hits += 1
            jax.monitoring.register_event_duration_secs_listener(listener)
            jax.monitoring.register_event_listener(hit_listener)
            cls._registered = True
        return cls


@contextlib.contextmanager
def compile_guard(allowed: int = 0):
    """Raise if more than `allowed` compilations happen inside the block."""
    counter = CompileCounter.install()
    start = counter.count
    yield counter
    new = counter.count - start
    if new > allowed:
        raise RuntimeError(f"{new} new XLA compilation(s) after warm-up; a shape escaped the buckets")
