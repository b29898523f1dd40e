"""`numwatch demo`: a small GPT trained on a synthetic bigram language with the monitor attached.

Everything is generated locally (no downloads). On a 2-core CPU the default run (300 steps,
bf16 autocast) takes well under two minutes. The model calls F.scaled_dot_product_attention, the
path the attention probe intercepts.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from numwatch.errors import NumwatchError

__all__ = ["GPTConfig", "TinyGPT", "bigram_batches", "main"]


@dataclass
class GPTConfig:
    vocab: int = 64
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.plant_sinks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        if self.plant_sinks:
            k = _planted_sinks(q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def _planted_sinks(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keys 0 and 1 become one shared "attention sink" aligned with the head's mean query.

    Every row that sees both then has a repeated maximum (the paper's trigger), which the
    attention probe reports as attn_repeated_max_rows. For the demo only.
    """
    sink = q.mean(dim=2, keepdim=True)  # (B, nh, 1, hs)
    sink = sink / sink.norm(dim=-1, keepdim=True) * 4.0 * q.shape[-1] ** 0.5
    return torch.cat([sink, sink, k[:, :, 2:]], dim=2)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def bigram_batches(
    cfg: GPTConfig, batch: int, seed: int = 0, device: str = "cpu"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of a random sparse bigram language; token 0 is BOS at every position 0."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(cfg.vocab, cfg.vocab, generator=g) * 3.0
    logits[:, 0] = -math.inf  # BOS never follows anything
    probs = logits.softmax(-1)
    while True:
        seq = torch.empty(batch, cfg.seq_len + 1, dtype=torch.long)
        seq[:, 0] = 0
        for t in range(1, cfg.seq_len + 1):
            seq[:, t] = torch.multinomial(probs[seq[:, t - 1]], 1, generator=g).squeeze(1)
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)


def _count(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low`` (a bad value is a usage error, not a traceback)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse names the type in its message
    return parse


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value}")
    return value


def _learning_rate(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


_learning_rate.__name__ = "learning rate"


def _seed(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**64:  # torch.manual_seed's range
        raise argparse.ArgumentTypeError(f"must be in [-2**63, 2**64), got {value}")
    return value


_seed.__name__ = "seed"


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None
    if device.type not in ("cpu", "cuda"):  # bf16 autocast and the kernels: these two
        raise argparse.ArgumentTypeError(f"{text!r}: the demo trains on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this torch has no usable CUDA device")
    return text


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="numwatch demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=_count(1), default=300, help="training steps (300)")
    p.add_argument("--batch", type=_count(1), default=16, help="sequences per batch (16)")
    p.add_argument("--lr", type=_learning_rate, default=3e-3, help="AdamW learning rate (3e-3)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the model and the data (0)")
    p.add_argument(
        "--device",
        type=_device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (cuda when there is one, else cpu)",
    )
    p.add_argument(
        "--flush-every", type=_count(1), default=10, help="steps per flush and console line (10)"
    )
    p.add_argument(
        "--jsonl",
        default=None,
        help="JSONL log path, as sinks.jsonl.path: {run_name} and {rank} are filled in (a "
        "literal brace is written {{ or }}); default: numwatch-runs/demo.rank{rank}.jsonl",
    )
    p.add_argument(
        "--nan-at", type=_count(0), default=None, help="plant a NaN gradient at this step"
    )
    p.add_argument(
        "--plant-sinks",
        action="store_true",
        help="duplicate an attention-sink key in every layer (repeated row maxima)",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=0,
        help="serve Prometheus metrics on 127.0.0.1 at this port (0 = any free port)",
    )
    p.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoint")
    p.add_argument("--no-monitor", action="store_true", help="train without numwatch (baseline)")
    args = p.parse_args(argv)
    if args.nan_at is not None and args.nan_at >= args.steps:
        p.error(f"argument --nan-at: step {args.nan_at} is past the last step ({args.steps - 1})")
    return args


def _run_name() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("demo-%Y%m%dT%H%M%SZ")


def main(argv: list[str] | None = None) -> int:
    import numwatch

    args = _parse(argv)
    torch.manual_seed(args.seed)
    cfg = GPTConfig()
    model = TinyGPT(cfg).to(args.device)
    for block in model.blocks:
        block.attn.plant_sinks = args.plant_sinks
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = bigram_batches(cfg, args.batch, args.seed, args.device)
    # The demo samples every probe at each flush, so every console line shows all of them.
    every = args.flush_every
    overrides = {
        "flush_every": every,
        # One log path for every demo (README's commands read it), one run name each: a second
        # demo appending there is a new run, not the first one continued.
        "run_name": _run_name(),
        "sinks__jsonl__path": args.jsonl or "numwatch-runs/demo.rank{rank}.jsonl",
        "activations__every": every,
        "attention__every": every,
        "weights__every": every,
        "optimizer__every": every,
    }
    if not args.no_metrics:
        overrides |= {
            "sinks__prometheus__enabled": True,
            "sinks__prometheus__port": args.metrics_port,
        }
    try:
        monitor = None if args.no_monitor else numwatch.Monitor(model, **overrides).attach(opt)
    except (NumwatchError, OSError) as err:  # a port in use, a log path not writable, ...
        print(f"numwatch demo: {err}", file=sys.stderr)
        print(
            "numwatch demo: --metrics-port N picks another port, --no-metrics serves none, "
            "--jsonl PATH writes another log",
            file=sys.stderr,
        )
        return 2
    if monitor is not None:
        print(
            f"numwatch demo: every probe sampled every {every} steps, with a flush each time "
            "(the defaults sample and flush every 50): the overhead printed is this setting's, "
            "see README 'Overhead' for the defaults on a GPU"
        )
    if monitor is not None and monitor.jsonl_path:
        print(f"numwatch demo: JSONL log at {monitor.jsonl_path}")
    if monitor is not None and monitor.prometheus_url:
        print(f"numwatch demo: Prometheus metrics at {monitor.prometheus_url} while it runs")
    dtype = torch.bfloat16
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = next(data)
        with torch.autocast(device_type=torch.device(args.device).type, dtype=dtype):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        if step == args.nan_at:
            model.blocks[-1].mlp[2].weight.grad[0, 0] = float("nan")
        if monitor is not None:
            monitor.step(loss)  # before clipping: a NaN would be spread by clip_grad_norm_
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    if monitor is not None:
        monitor.detach()
        n_events = len(monitor.events)
        print(f"numwatch demo: {args.steps} steps in {elapsed:.1f} s, {n_events} events")
    else:
        print(f"numwatch demo (no monitor): {args.steps} steps in {elapsed:.1f} s")
    return 0
