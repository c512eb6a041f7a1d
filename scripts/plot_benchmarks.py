"""Plots from benchmark JSON: serving throughput and latency percentiles against concurrency
(benchmark_serving.py), and throughput per backend (benchmark_throughput.py). PNG files, Agg backend.

    python scripts/plot_benchmarks.py --serving_json=serving.json --throughput_json=throughput.json \
        --out_dir=plots

Several files of a kind are drawn together, one series each (labelled by file name or --labels).
A serving run without --max_concurrency is drawn at concurrency = its number of requests (all in
flight at once, at most).
"""

import os

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import bench_common as bc  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("serving_json", [], "benchmark_serving.py results")
flags.DEFINE_list("throughput_json", [], "benchmark_throughput.py results")
flags.DEFINE_list("labels", None, "series labels, serving files first (default: file names)")
flags.DEFINE_string("out_dir", "plots", "where the PNG files go")


def series_labels(paths: list[str], offset: int) -> list[str]:
    given = FLAGS.labels or []
    return [given[offset + i] if offset + i < len(given) else os.path.splitext(os.path.basename(p))[0]
            for i, p in enumerate(paths)]


def concurrency(run: dict) -> int:
    return run["max_concurrency"] or run["num_requests"]


def sorted_runs(result: dict) -> list[dict]:
    return sorted(result["runs"], key=concurrency)


def save(fig, name: str) -> str:
    path = os.path.join(FLAGS.out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def setup_concurrency_axis(ax, xs):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(xs)), [str(x) for x in sorted(set(xs))])
    ax.set_xlabel("max concurrency")
    ax.grid(True, alpha=0.3)


def plot_serving_throughput(results: list[dict], labels: list[str]) -> str:
    fig, (tokens_ax, requests_ax) = plt.subplots(1, 2, figsize=(11, 4))
    xs = []
    for result, label in zip(results, labels):
        runs = sorted_runs(result)
        x = [concurrency(r) for r in runs]
        xs += x
        tokens_ax.plot(x, [r["output_throughput"] for r in runs], "o-", label=label)
        requests_ax.plot(x, [r["request_throughput"] for r in runs], "o-", label=f"{label} requests")
        if any(r["goodput"] is not None for r in runs):
            requests_ax.plot(x, [r["goodput"] or 0.0 for r in runs], "s--", label=f"{label} goodput")
    tokens_ax.set_ylabel("output tokens/s")
    tokens_ax.set_title("output throughput")
    requests_ax.set_ylabel("requests/s")
    requests_ax.set_title("request throughput and goodput")
    for ax in (tokens_ax, requests_ax):
        ax.set_ylim(bottom=0)
        setup_concurrency_axis(ax, xs)
        ax.legend(fontsize=8)
    return save(fig, "serving_throughput.png")


def plot_serving_latency(results: list[dict], labels: list[str]) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = []
    for ax, metric, title in zip(axes, ("ttft_ms", "itl_ms"), ("time to first token", "inter-token latency")):
        for result, label in zip(results, labels):
            runs = sorted_runs(result)
            x = [concurrency(r) for r in runs]
            xs += x
            for pct, style in (("p50", "o-"), ("p99", "^--")):
                ax.plot(x, [r[metric][pct] for r in runs], style, label=f"{label} {pct}")
        ax.set_ylim(bottom=0)
        ax.set_ylabel("ms")
        ax.set_title(title)
    for ax in axes:
        setup_concurrency_axis(ax, xs)
        ax.legend(fontsize=8)
    return save(fig, "serving_latency.png")


def plot_backend_throughput(results: list[dict], labels: list[str]) -> str:
    """Median output tokens/s per backend, whiskers from the slowest to the fastest repeat; and the
    single-request ms per token where measured."""
    single = [r for r in results if r.get("single_request")]
    fig, axes = plt.subplots(1, 2 if single else 1, figsize=(11 if single else 6, 4), squeeze=False)
    ax = axes[0][0]
    bars, names = [], []
    for result, label in zip(results, labels):
        for name, r in result["results"].items():
            reps = [rep["output_tokens_per_s"] for rep in r["repeats"]]
            med = r["median"]["output_tokens_per_s"]
            bars.append((med, med - min(reps), max(reps) - med))
            names.append(name if len(results) == 1 else f"{label}\n{name}")
    positions = range(len(bars))
    ax.bar(positions, [b[0] for b in bars], yerr=[[b[1] for b in bars], [b[2] for b in bars]], capsize=4,
           color="tab:blue")
    ax.set_xticks(list(positions), names, fontsize=8)
    ax.set_ylabel("output tokens/s (median of repeats)")
    ax.set_title("offline throughput by backend")
    ax.grid(True, axis="y", alpha=0.3)
    if single:
        plot_single_request(axes[0][1], single, [label for r, label in zip(results, labels) if r.get("single_request")],
                            len(results) > 1)
    return save(fig, "throughput_backends.png")


def plot_single_request(ax, results: list[dict], labels: list[str], prefix: bool):
    values, names = [], []
    for result, label in zip(results, labels):
        single = result["single_request"]
        for name, s in single["backends"].items():
            values.append(s["median"]["ms_per_token"])
            names.append(f"{label}\n{name}" if prefix else name)
    ax.bar(range(len(values)), values, color="tab:orange")
    ax.set_xticks(list(range(len(values))), names, fontsize=8)
    ax.set_ylabel("ms per output token (median)")
    first = results[0]["single_request"]
    ax.set_title(f"one request alone (prompt {first['prompt_len']}, output {first['output_len']})")
    ax.grid(True, axis="y", alpha=0.3)


def main(argv):
    del argv
    if not FLAGS.serving_json and not FLAGS.throughput_json:
        raise app.UsageError("give --serving_json and/or --throughput_json")
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    written = []
    if FLAGS.serving_json:
        serving = [bc.read_json(p) for p in FLAGS.serving_json]
        labels = series_labels(FLAGS.serving_json, 0)
        written += [plot_serving_throughput(serving, labels), plot_serving_latency(serving, labels)]
    if FLAGS.throughput_json:
        throughput = [bc.read_json(p) for p in FLAGS.throughput_json]
        written.append(plot_backend_throughput(throughput, series_labels(FLAGS.throughput_json,
                                                                         len(FLAGS.serving_json))))
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
