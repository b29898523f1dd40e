"""Training-process cost of one Prometheus scrape of a 48-layer, 64-head model (CPU, no GPU).

The snapshot is what the monitor flushes for the demo's GPT at 48 layers and 64 heads with the
default config: the parameter and module names come from the real model (built on the meta
device, nothing allocated), the records are laid out as the probes lay them out (one labels dict
per parameter, module or (layer, head), shared by that object's statistics), values are random.

Measured in this process, median of ``--repeats`` (thread CPU time, so other processes on the
machine do not count; wall time alongside; garbage collector off while timing, as in timeit).
Consecutive flushes alternate between two snapshots built independently (new strings and
dicts each, as the monitor makes them), so caches keyed on the previous flush work as in a run:
- emit: the training thread handing a flush to the exporter (at every flush);
- first_scrape_after_a_flush: the collector reduces heads, builds families and renders the
  text exposition (the target: < 20 ms for the default exposition);
- first_scrape_of_the_run: the same with empty caches (once per run);
- cached: a later scrape of the same flush (the rendered bytes are reused);
- registry_collect_after_a_flush: ``sink.registry``'s path (prometheus_client Metric objects), for
  users who expose the registry their own way; the HTTP server does not use it;
- http: wall time of a full GET over loopback, seen by a client in this process.
For heads = 'layer' (default), 'top_k' (k = 4) and 'all', with the default exclude list and with
every statistic exported (exclude = []).

    python bench/bench_scrape.py --out bench/results/scrape.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time
import urllib.request
from importlib.metadata import version

import torch

from numwatch.config import PrometheusSinkConfig
from numwatch.demo import GPTConfig, TinyGPT
from numwatch.sinks.prometheus import HEAD_REDUCTIONS, PrometheusSink
from numwatch.snapshot import MetricRecord, Snapshot

TENSOR_STATS = [
    "numel", "absmax", "min", "max", "mean", "rms", "nan", "posinf", "neginf", "nonfinite",
    "zeros", "zero_fraction", "subnormal", "underflow_fraction", "headroom",
]  # fmt: skip
ATTENTION_HEAD = [n for n in HEAD_REDUCTIONS if not n.startswith(("attn_q_", "attn_k_", "attn_qk"))]
WEIGHT_HEAD = ["attn_q_spectral_norm", "attn_k_spectral_norm", "attn_qk_logit_bound"]


def synthetic_snapshot(layers: int, heads: int, seed: int = 0) -> Snapshot:
    rng = random.Random(seed)
    cfg = GPTConfig(vocab=50304, seq_len=2048, d_model=64 * heads, n_heads=heads, n_layers=layers)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    records: list[MetricRecord] = []

    def stats(prefix: str, label: str, name: str) -> None:
        labels = {label: name}  # shared by the object's statistics, as stat_records does
        records.extend(MetricRecord(f"{prefix}_{s}", labels, rng.random()) for s in TENSOR_STATS)

    params = [name for name, _ in model.named_parameters()]
    for name in params:
        stats("grad", "param", name)
    records.append(MetricRecord("grad_norm", {}, 1.0))
    records.append(MetricRecord("grad_norm_max", {}, 2.0))
    for name, _ in list(model.named_modules())[1:]:
        stats("activation", "module", name)
    attention = [f"blocks.{i}.attn" for i in range(layers)]
    for layer in attention:
        records.append(MetricRecord("attn_calls", {"layer": layer}, 1.0))
        for h in range(heads):
            labels = {"layer": layer, "head": str(h)}
            records.extend(MetricRecord(n, labels, rng.random()) for n in ATTENTION_HEAD)
    for layer in attention:  # the weight probe's records come later, with their own dicts
        for h in range(heads):
            labels = {"layer": layer, "head": str(h)}
            records.extend(MetricRecord(n, labels, rng.random()) for n in WEIGHT_HEAD)
        records.append(MetricRecord("attn_kernel_stabilized", {"layer": layer}, 0.0))
    for name, p in model.named_parameters():
        if p.ndim == 2:
            records.append(MetricRecord("weight_spectral_norm", {"param": name}, rng.random()))
        labels = {"param": name}
        records.append(MetricRecord("optimizer_update_ratio", labels, rng.random()))
        records.append(MetricRecord("optimizer_absorbed_fraction", labels, rng.random()))
    records += [
        MetricRecord("optimizer_lr", {"group": "0"}, 3e-4),
        MetricRecord("loss", {}, 2.5),
        MetricRecord("step_seconds", {}, 0.5),
        MetricRecord("monitor_overhead_seconds", {}, 0.004),
        MetricRecord("events_total", {"kind": "precursor", "rule": "attn_repeated_max"}, 3.0),
        MetricRecord("mitigation_skipped_steps_total", {}, 0.0),
        MetricRecord("mitigation_lr_factor", {}, 1.0),
    ]
    records += [
        MetricRecord("monitor_errors_total", {"component": c}, 0.0)
        for c in ("gradients", "weights", "activations", "attention", "step", "flush", "sinks")
    ]
    return Snapshot(1000, records, time=time.time())


def timed(fn, repeats: int) -> dict[str, float]:
    """Median/min thread CPU time and median wall time; the garbage collector is off while
    timing (as timeit does): a collection would charge the whole heap's traversal to us."""
    cpu, wall = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            c0, w0 = time.thread_time(), time.perf_counter()
            fn()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
    finally:
        gc.enable()
    return {
        "cpu_ms_median": 1e3 * statistics.median(cpu),
        "cpu_ms_min": 1e3 * min(cpu),
        "wall_ms_median": 1e3 * statistics.median(wall),
    }


def measure(flushes: list[Snapshot], heads: str, exclude: list[str], repeats: int) -> dict:
    """``flushes``: snapshots of the same model, each built anew as the monitor does."""
    cfg = PrometheusSinkConfig(enabled=True, port=0, heads=heads, exclude=exclude)
    sink = PrometheusSink.from_config(cfg, rank=0, local_rank=0, run_name="bench")
    collector = sink.collector
    turn = iter(range(10**9))

    def next_flush() -> Snapshot:
        return flushes[next(turn) % len(flushes)]

    try:
        emit = timed(lambda: sink.emit(next_flush(), []), repeats)

        def first_scrape() -> None:
            collector.update(next_flush())
            collector.exposition()

        # the very first scrape also builds the caches later flushes reuse (labels, layout)
        fresh = PrometheusSink(serve=False, heads=heads, exclude=exclude)
        fresh.collector.update(flushes[0])
        very_first = timed(fresh.collector.exposition, 1)
        first = timed(first_scrape, repeats)
        cached = timed(collector.exposition, repeats)
        body = collector.exposition()

        def collect() -> None:
            collector.update(next_flush())
            list(collector.collect())  # prometheus_client Metric objects (sink.registry users)

        registry_collect = timed(collect, repeats)

        def http() -> None:
            with urllib.request.urlopen(sink.url, timeout=30) as r:
                r.read()

        collector.update(next_flush())
        get = timed(http, repeats)
    finally:
        sink.close()
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return {
        "heads": heads,
        "exclude": "default" if exclude == PrometheusSinkConfig().exclude else exclude,
        "series": series,
        "bytes": len(body),
        "emit": emit,
        "first_scrape_after_a_flush": first,
        "first_scrape_of_the_run": very_first,
        "cached_scrape": cached,
        "registry_collect_after_a_flush": registry_collect,
        "http_get_wall": {"ms_median": get["wall_ms_median"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    flushes = [synthetic_snapshot(args.layers, args.heads, seed) for seed in range(2)]
    default_exclude = PrometheusSinkConfig().exclude
    runs = [
        measure(flushes, heads, exclude, args.repeats)
        for heads in ("layer", "top_k", "all")
        for exclude in (default_exclude, [])
    ]
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    result = {
        "benchmark": "prometheus scrape, training-process time",
        "model": f"{args.layers} layers x {args.heads} heads (demo GPT layout)",
        "snapshot_records": len(flushes[0]),
        "target": "first scrape after a flush (build + render), heads='layer', default "
        "exclude: < 20 ms",
        "cpu": names[0] if names else platform.processor(),
        "cores": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "python": platform.python_version(),
        "prometheus_client": version("prometheus-client"),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
