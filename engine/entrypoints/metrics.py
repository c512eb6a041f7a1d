"""Prometheus metrics of the OpenAI-compatible server, named as vLLM's with a `ferry:` prefix.

Every server owns a `ServerMetrics` with its own CollectorRegistry, so several servers (or tests) in one
process never share or collide on metrics. The engine thread records everything; prometheus-client's
metric objects are thread-safe, so /metrics renders from the event loop without further locking.
"""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.core.scheduler import PREEMPTION_MODES

# vLLM's buckets: latencies from milliseconds (a decode step on a GPU) to minutes (a long queue).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

PREFIX = "ferry:"


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc, extra_labels=()):
            metric = Counter(PREFIX + name, doc, labels + list(extra_labels), registry=self.registry)
            return metric if extra_labels else metric.labels(model_name)

        self.model_name = model_name
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival at the server to the first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between a request's successive token deltas.", INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival at the server to the request's last token.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival at the server to the request's first scheduling.",
            REQUEST_LATENCY_BUCKETS)
        self.num_requests_running = gauge("num_requests_running", "Sequences holding device KV blocks.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Sequences swapped out to host memory.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of device KV blocks in use (1 = 100%).")
        self._preemptions = counter("num_preemptions", "Preemptions by the scheduler.", ["mode"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that began generating.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens (all n samples).")
        self._request_success = counter(
            "request_success", "Finished samples (each of a request's n), by finish reason.", ["finished_reason"])
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache (prefill targets of admitted requests).")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Of those tokens, the ones found in the prefix cache.")
        self.prefix_cache_hit_rate = gauge("prefix_cache_hit_rate",
                                           "Prefix-cache hits / queries since start (1 = 100%).")
        self._memory = {key: gauge(key, doc) for key, doc in (
            ("weight_bytes", "Bytes the model's weights take as stored (quantized weights packed), all replicas."),
            ("kv_cache_bytes", "Bytes of the device KV cache, all replicas."),
            ("kv_bytes_per_token", "KV-cache bytes a token takes (every layer, K and V, scales included)."))}
        # Data parallel (engine/data_parallel.py): the gauges above are the replicas' totals; these split them.
        self._replica_gauges = {
            key: Gauge(PREFIX + "replica_" + name, doc, labels + ["replica"], registry=self.registry)
            for key, name, doc in (
                ("num_running", "num_requests_running", "Sequences holding device KV blocks, per replica."),
                ("num_waiting", "num_requests_waiting", "Sequences waiting to be scheduled, per replica."),
                ("kv_usage", "kv_cache_usage_perc", "Fraction of the replica's KV blocks in use."))}
        self._totals_seen: dict[str, int] = {}  # cumulative scheduler counts already turned into increments
        # Every label value exists from the start, so a scrape shows zeros rather than missing series.
        for mode in PREEMPTION_MODES:
            self._preemptions.labels(model_name, mode)
        for reason in ("stop", "length", "abort", "error"):
            self._request_success.labels(model_name, reason)

    def record_memory(self, memory: dict) -> None:
        """The engine's memory accounting (LLMEngine.memory), once at start."""
        for key, metric in self._memory.items():
            metric.set(memory[key])

    def record_scheduler_stats(self, stats: dict) -> None:
        """Gauges from `Scheduler.stats()`; its cumulative preemption and prefix-cache counts become counter
        increments."""
        self.num_requests_running.set(stats["num_running"])
        self.num_requests_waiting.set(stats["num_waiting"])
        self.num_requests_swapped.set(stats["num_swapped"])
        self.kv_cache_usage.set(stats["kv_usage"])
        self.prefix_cache_hit_rate.set(stats["prefix_cache_hit_rate"])
        for mode, total in stats["preemptions"].items():
            self._increment(self._preemptions.labels(self.model_name, mode), f"preemptions/{mode}", total)
        self._increment(self.prefix_cache_queries, "prefix_cache_queries", stats["prefix_cache_queries"])
        self._increment(self.prefix_cache_hits, "prefix_cache_hits", stats["prefix_cache_hits"])
        for i, replica in enumerate(stats.get("replicas", ())):
            for key, metric in self._replica_gauges.items():
                metric.labels(self.model_name, str(i)).set(replica[key])

    def _increment(self, counter, key: str, total: int) -> None:
        new = total - self._totals_seen.get(key, 0)
        if new:
            counter.inc(new)
        self._totals_seen[key] = total

    def record_finished_sample(self, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
