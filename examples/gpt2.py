"""A nanoGPT-style GPT-2 trained with numwatch attached.

    python examples/gpt2.py --preset tiny --steps 200            # CPU, a minute or two
    python examples/gpt2.py --preset gpt2 --steps 2000 --lr 6e-4  # GPT-2 124M on a GPU

Attention is selectable: ``sdpa`` (native F.scaled_dot_product_attention, cuDNN/FA2 on a GPU),
``stabilized`` (numwatch's stabilized flash attention), ``paper_repro`` (numwatch's emulation of
the failing BF16-accumulating kernel of arXiv 2510.04212: for reproductions only) or ``eager``
(scores materialized and passed to softmax). Data is generated locally: a random sparse bigram
language with a BOS token (``--data bigram``), the same language after a run of identical BOS
tokens (``--data sinks``), the bigram language interrupted by batches of repeated n-grams
(``--data bursts``), or uniform random tokens (``--data random``, for timing), so nothing is
downloaded. ``--no-pos-emb`` drops the learned position embedding (NoPE: causal masking alone
tells positions apart); with ``--data sinks`` the leading BOS tokens then have identical keys in
every layer, so rows that attend to the sink have a repeated maximum, the setting in which
arXiv 2510.04212's failure starts.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import numwatch
from numwatch.kernels.flash_attention import flash_attention

ATTENTION = ("sdpa", "stabilized", "paper_repro", "eager")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    attention: str = "sdpa"
    qk_norm: bool = False
    pos_emb: bool = True  # False: no position embedding (NoPE)


PRESETS = {
    "gpt2": GPTConfig(),
    "small": GPTConfig(block_size=256, vocab_size=512, n_layer=6, n_head=8, n_embd=512),
    "tiny": GPTConfig(block_size=64, vocab_size=64, n_layer=2, n_head=4, n_embd=128),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.attention = cfg.attention
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        hd = cfg.n_embd // cfg.n_head
        self.q_norm = nn.LayerNorm(hd) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(hd) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        q, k = self.q_norm(q), self.k_norm(k)  # (B, nh, T, hs)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.attention == "eager":
            att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            y = att @ v
        else:
            y = flash_attention(q, k, v, is_causal=True, mode=self.attention)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos_emb else None
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


SINK_TOKENS = 4  # leading BOS tokens of --data sinks
# --data bursts: every BURST_EVERY steps, BURST_LEN batches in a row of one random n-gram
# repeated over the whole sequence (OLMo 2 traced loss spikes to such repeated n-grams)
BURST_EVERY, BURST_LEN, BURST_NGRAM = 250, 2, 8


def is_burst(step: int) -> bool:
    """Whether ``--data bursts`` feeds a repeated-n-gram batch at ``step`` (0-based)."""
    return step >= BURST_EVERY and step % BURST_EVERY < BURST_LEN


def batches(cfg: GPTConfig, batch: int, kind: str, seed: int, device: str):
    """Endless (x, y) batches of a synthetic language (no downloads)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, V = cfg.block_size, cfg.vocab_size
    if kind == "random":
        while True:
            seq = torch.randint(0, V, (batch, T + 1), generator=g).to(device)
            yield seq[:, :-1], seq[:, 1:]
    if kind == "bursts":
        normal = batches(cfg, batch, "bigram", seed, device)
        vocab = min(V, 512)
        step = 0
        while True:
            if is_burst(step):
                gram = torch.randint(1, vocab, (batch, BURST_NGRAM), generator=g)
                seq = gram.repeat(1, T // BURST_NGRAM + 1)[:, : T + 1].to(device)
                seq[:, 0] = 0
                yield seq[:, :-1], seq[:, 1:]
            else:
                yield next(normal)
            step += 1
    vocab = min(V, 512)  # a bigram table over at most 512 tokens; token 0 is BOS
    logits = torch.randn(vocab, vocab, generator=g) * 3.0
    logits[:, 0] = -math.inf
    probs = logits.softmax(-1).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = torch.empty(max(256, 4 * batch), T + 1, dtype=torch.long, device=device)
    bos = SINK_TOKENS if kind == "sinks" else 1
    pool[:, :bos] = 0
    for t in range(bos, T + 1):  # one pass builds a pool; batches are drawn from it
        pool[:, t] = torch.multinomial(probs[pool[:, t - 1]], 1, generator=gen).squeeze(1)
    while True:
        pick = torch.randint(0, pool.shape[0], (batch,), generator=gen, device=device)
        seq = pool[pick]
        yield seq[:, :-1], seq[:, 1:]


def lr_at(step: int, *, lr: float, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    monitor: numwatch.Monitor | None = None,
    clip: float = 1.0,
) -> torch.Tensor:
    """One bf16-autocast step: forward, backward, monitor.step (before clipping), update.
    ``clip``: the gradient-norm limit (0: no clipping)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    if monitor is not None:
        monitor.step(loss)  # before clipping: clip_grad_norm_ would spread a NaN everywhere
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--attention", choices=ATTENTION, default="sdpa")
    p.add_argument("--qk-norm", action="store_true")
    p.add_argument("--no-pos-emb", action="store_true", help="NoPE: no position embedding")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--data", choices=("bigram", "sinks", "bursts", "random"), default="bigram")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-monitor", action="store_true")
    p.add_argument("--config", default=None, help="numwatch config YAML")
    p.add_argument("--jsonl", default=None, help="numwatch JSONL log path")
    p.add_argument(
        "--flush-every", type=int, default=None, help="steps per flush (10; with --config, its)"
    )
    p.add_argument("--no-mitigation", action="store_true", help="rules report, actions off")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    cfg = PRESETS[args.preset]
    cfg = GPTConfig(
        **{
            **cfg.__dict__,
            "attention": args.attention,
            "qk_norm": args.qk_norm,
            "pos_emb": not args.no_pos_emb,
        }
    )
    model = GPT(cfg).to(args.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    fused = torch.device(args.device).type == "cuda"
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=fused)
    return model, opt


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse(argv)
    model, opt = build(args)
    monitor = None
    if not args.no_monitor:
        overrides: dict = {}
        if args.flush_every is not None:  # a flag given wins over --config's value
            overrides["flush_every"] = args.flush_every
        elif args.config is None:
            overrides["flush_every"] = 10
        if args.jsonl:
            overrides["sinks__jsonl__path"] = args.jsonl
        if args.no_mitigation:
            overrides["rules__act"] = False
        monitor = numwatch.Monitor(model, args.config, **overrides).attach(opt)
    data = batches(model.cfg, args.batch, args.data, args.seed, args.device)
    start = time.perf_counter()
    loss = torch.zeros(())
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=args.lr, warmup=args.warmup, total=args.steps)
        loss = train_step(model, opt, *next(data), monitor)
    final = loss.item()
    elapsed = time.perf_counter() - start
    if monitor is not None:
        monitor.detach()
    print(f"{args.steps} steps in {elapsed:.1f} s, final loss {final:.4f}")
    return {"loss": final, "seconds": elapsed}


if __name__ == "__main__":
    main()
