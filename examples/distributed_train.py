"""Distributed training under numwatch: one script for CPUs (gloo) and GPUs (NCCL).

    torchrun --nproc_per_node=2 examples/distributed_train.py                 # DDP
    torchrun --nproc_per_node=2 examples/distributed_train.py --fsdp          # FSDP2 fully_shard
    torchrun --nproc_per_node=2 examples/distributed_train.py --nan-step 25   # a fault on rank 1
    torchrun --nproc_per_node=2 examples/distributed_train.py --uneven 20     # rank 0 ends early

A small GPT learns a synthetic bigram language; every rank draws its own batches. numwatch
combines its statistics over the ranks at each flush, so rank 0's log and every rank's rules see
global values. With ``--nan-step``, rank 1 alone gets a NaN in one activation at that step: the
event names rank 1, and every rank skips that optimizer update (skip_step decides on the global
value), so the model stays one model: the script checks at the end that the DDP replicas are
bitwise identical. With ``--uneven N``, rank 0 has N fewer batches than the others: training
runs inside DDP's ``Join([ddp, monitor])``, and once rank 0 is out of data the monitors stop
aggregating (each rank reports its own values) instead of waiting for it.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import numwatch


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.poison = False  # the planted fault of --nan-step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        h = self.mlp(self.ln2(x))
        if self.poison:
            h = h.clone()
            h[0, 0, 0] = float("nan")
        return x + h


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, n_head: int, n_layer: int, block_size: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (B, T, vocab)


def bigram_batch(
    table: torch.Tensor, gen: torch.Generator, batch: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences of a Markov chain whose next-token distribution is ``table[previous]``."""
    idx = torch.empty(batch, length + 1, dtype=torch.long)
    idx[:, 0] = torch.randint(table.shape[0], (batch,), generator=gen)
    for t in range(length):
        idx[:, t + 1] = torch.multinomial(table[idx[:, t]], 1, generator=gen).squeeze(1)
    return idx[:, :-1], idx[:, 1:]


def replicas_identical(model: nn.Module) -> bool:
    """Every rank holds bitwise the same parameters: elementwise max == min over ranks."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    hi, lo = flat.clone(), -flat
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MAX)
    return torch.equal(hi, -lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--nan-step", type=int, default=None, help="plant a NaN on rank 1 then")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--uneven", type=int, default=0, help="rank 0 gets this many fewer batches")
    args = ap.parse_args()
    if args.uneven and args.fsdp:
        ap.error("--uneven uses DDP's Join, which FSDP2 does not support")
    if not 0 <= args.uneven < args.steps:
        ap.error(f"--uneven must be in [0, --steps), got {args.uneven}")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial model on every rank
    vocab, block_size = 64, 64
    table = torch.softmax(torch.randn(vocab, vocab) * 3, dim=-1)
    model = GPT(vocab, d=64, n_head=4, n_layer=2, block_size=block_size).to(device)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        train_model, watched = model, model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model, watched = DDP(model), model  # numwatch watches the wrapped module
    opt = torch.optim.AdamW(train_model.parameters(), lr=args.lr)

    monitor = numwatch.Monitor(
        watched,  # attach after wrapping: FSDP2 replaces the parameters
        run_name=f"distributed-{'fsdp' if args.fsdp else 'ddp'}",
        flush_every=10,
        rules={"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]},
    ).attach(opt)

    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data
    steps = args.steps - (args.uneven if rank == 0 else 0)
    uneven = contextlib.nullcontext()
    if args.uneven:
        from torch.distributed.algorithms.join import Join

        uneven = Join([train_model, monitor])  # the monitor after DDP
    with uneven:
        for step in range(steps):
            x, y = (t.to(device) for t in bigram_batch(table, gen, batch=16, length=block_size))
            model.blocks[0].poison = step == args.nan_step and rank == 1
            logits = train_model(x)
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            monitor.step(loss)  # closes the step; skip_step decides here, on global values
            opt.step()
            opt.zero_grad(set_to_none=True)
    monitor.detach()

    snapshot = monitor.snapshot()
    same = None if args.fsdp else replicas_identical(train_model)
    if rank == 0:
        print(f"{world} ranks, {'FSDP2' if args.fsdp else 'DDP'}, backend {dist.get_backend()}")
        print(f"global loss at step {snapshot.step}: {snapshot.value('loss'):.4f}")
        print(f"skipped optimizer updates: {snapshot.value('mitigation_skipped_steps_total'):g}")
        # spectral norms are sampled (weights.every): the last flush that has one
        sigma = next(
            s.value("attn_q_spectral_norm", layer="blocks.0", head="0")
            for s in reversed(monitor.history)
            if s.get("attn_q_spectral_norm", layer="blocks.0", head="0") is not None
        )
        print(f"sigma(W_Q) of blocks.0 head 0: {sigma:.4f}; monitor errors: {monitor.errors}")
        for event in monitor.events:
            if event.kind in ("nonfinite", "action"):
                print(f"  step {event.step}: {event.message}")
        if same is not None:
            print(f"DDP replicas bitwise identical: {same}")
        if args.uneven:
            stopped = monitor.joined_step
            print(f"steps on rank 0: {steps}; aggregation stopped at step {stopped}")
        print(f"JSONL log (global values): {monitor.jsonl_path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
