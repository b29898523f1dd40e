"""Cost of one flush's cross-rank aggregation (numwatch.distributed.Aggregator) on 2 processes.

Workload: the example's GPT (examples/distributed_train.py) shaped like GPT-2 small in everything
that sets the size of numwatch's tables (12 layers, 12 heads, ~150 parameters, ~100 modules;
narrow d so that it trains fast on a CPU), under DDP, with every probe on and sampling every step
(flush_every=1, activations/attention/weights every step): the largest layout a flush carries.
What is timed, per real flush of a real training step (after a barrier, so that a rank still
finishing its step is not counted): ``Aggregator.aggregate`` (pack into two buffers, the layout
check on the CPU, the SUM and MAX all-reduces in flight together, unpack), and per step
``Aggregator.step_values`` (the skip_step decision's one small all-reduce); and ``aggregate``
repeated on the last flush's tensors.
Peers, in the same processes on the same captured tensors: one all-reduce per tensor and op
(what aggregating table by table costs), an object all-gather of the tensors (the
gather-everything-to-one-rank way), and the floor: one all-reduce of a single float64.

Usage: python bench/bench_flush_collectives.py --out bench/results/flush_collectives_cpu.json
       (2 CPU processes, gloo; with 2 GPUs it runs NCCL: --backend nccl)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD = 2
ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location(
        "distributed_train", ROOT / "examples/distributed_train.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ms(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "median_ms": 1e3 * statistics.median(samples),
        "p90_ms": 1e3 * samples[int(0.9 * (len(samples) - 1))],
        "n": len(samples),
    }


def _timed(fn, reps: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def _worker(rank: int, rendezvous: str, backend: str, steps: int, reps: int, out: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
    import numwatch

    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=rendezvous, rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ex = _example()
    torch.manual_seed(0)
    vocab, block = 64, 16
    model = ex.GPT(vocab, d=96, n_head=12, n_layer=12, block_size=block).to(device)
    table = torch.softmax(torch.randn(vocab, vocab) * 3, dim=-1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    monitor = numwatch.Monitor(
        model,
        flush_every=1,
        activations__every=1,
        attention__every=1,
        weights__every=1,
        sinks__console__enabled=False,
        sinks__jsonl__enabled=False,
        rules={"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]},
    ).attach(opt)
    agg = monitor._dist  # the object under test (benchmarks may reach inside)
    flush_s, step_s, captured = [], [], {}
    aggregate, step_values = agg.aggregate, agg.step_values

    def timed_aggregate(tensors, *args):
        captured.update(tensors)
        dist.barrier()  # leave out the wait for a rank still finishing its step
        start = time.perf_counter()
        result = aggregate(tensors, *args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        flush_s.append(time.perf_counter() - start)
        return result

    def timed_step_values(loss, *args):
        dist.barrier()
        start = time.perf_counter()
        result = step_values(loss, *args)
        step_s.append(time.perf_counter() - start)
        return result

    agg.aggregate, agg.step_values = timed_aggregate, timed_step_values
    gen = torch.Generator().manual_seed(rank)
    before = agg.collectives
    for _ in range(steps):
        x, y = (t.to(device) for t in ex.bigram_batch(table, gen, 8, block))
        loss = F.cross_entropy(ddp(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
    per_step_collectives = (agg.collectives - before) / steps
    warm = 3  # the first flushes build the plan and the CPU group

    # Peers on the last flush's tensors.
    tensors = {k: v.detach().to(device, torch.float64) for k, v in captured.items()}

    def per_tensor():
        for t in tensors.values():
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                dist.all_reduce(t.clone().reshape(-1), op=op)

    def gather_objects():
        got = [None] * WORLD
        dist.all_gather_object(got, {k: v.cpu() for k, v in tensors.items()})

    one = torch.zeros(1, dtype=torch.float64, device=device)
    floor = _timed(lambda: dist.all_reduce(one), reps, device)
    repeated = _timed(lambda: aggregate(tensors, None, None), reps, device)
    naive = _timed(per_tensor, reps, device)
    objects = _timed(gather_objects, max(10, reps // 5), device)
    plan = next(iter(agg._plans.values()))[0]
    n_values = sum(t.numel() for t in tensors.values())
    result = {
        "flush_aggregate": _ms(flush_s[warm:]),
        "flush_aggregate_repeated_on_last_tensors": _ms(repeated),
        "step_values": _ms(step_s[warm:]),
        "collectives_per_step_and_flush": per_step_collectives,
        "peers": {
            "one_allreduce_per_tensor_and_op": {**_ms(naive), "collectives": 2 * len(tensors)},
            "all_gather_object_of_tensors": _ms(objects),
            "floor_one_float64_allreduce": _ms(floor),
        },
        "layout": {
            "tensors": len(tensors),
            "values": n_values,
            "sum_buffer_values": int(plan.i_sum.numel()),
            "max_buffer_values": int(2 * plan.n_max),  # values and their NaN flags
            "bytes_on_the_wire_per_rank": 8 * int(plan.i_sum.numel() + 2 * plan.n_max),
            "parameters": sum(1 for _ in model.parameters()),
            "layers": 12,
            "heads": 12,
        },
    }
    monitor.detach()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "rank0.json"
        rendezvous = f"file://{Path(tmp) / 'rendezvous'}"
        worker_args = (rendezvous, args.backend, args.steps, args.reps, str(part))
        mp.start_processes(_worker, args=worker_args, nprocs=WORLD, start_method="spawn")
        measured = json.loads(part.read_text())
    flush = measured["flush_aggregate"]["median_ms"]
    peers = measured["peers"]
    report = {
        "benchmark": "flush_collectives",
        "device": "cuda" if args.backend == "nccl" else f"cpu ({platform.processor() or 'x86_64'})",
        "gpu": torch.cuda.get_device_name(0) if args.backend == "nccl" else None,
        "cpu_count": os.cpu_count(),
        "world_size": WORLD,
        "backend": args.backend,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": args.steps,
        "load_average_1min": [load_before, os.getloadavg()[0]],  # before, after: a shared box
        **measured,
        "ratios": {
            "aggregate_vs_per_tensor": flush
            / peers["one_allreduce_per_tensor_and_op"]["median_ms"],
            "aggregate_vs_all_gather_object": flush
            / peers["all_gather_object_of_tensors"]["median_ms"],
            "aggregate_vs_floor": flush / peers["floor_one_float64_allreduce"]["median_ms"],
        },
        "notes": "2 processes on one machine; times are wall-clock per call on rank 0 "
        "(medians over real flushes after 3 warm-up ones; peers after a barrier).",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
