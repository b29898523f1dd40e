"""The monitor observes and never changes training: a monitored run of a randomly built small
model computes bitwise the losses and weights of its unmonitored twin, in strict mode (any probe
failure raises), with every probe on at short cadences, and detaches to the exact model.

The models mix what users attach numwatch to: SDPA attention (causal, GQA, key-padding masks),
``nn.MultiheadAttention`` (with and without ``add_bias_kv``), eager softmax attention, MLPs,
convolutions, GRUs, BatchNorm, tied and frozen weights, bf16 weights. Actions are off: a rule
that swaps a layer's attention kernel is meant to change the numerics.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from numwatch.testing import hook_state

VOCAB = 11


class SdpaAttention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool, gqa: bool):
        super().__init__()
        self.heads, self.kv_heads, self.causal = heads, 1 if gqa else heads, causal
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d // heads * self.kv_heads)
        self.o = nn.Linear(d, d)

    def forward(self, x, keep):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        kv = self.kv(x).view(b, t, 2, self.kv_heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if keep is None else keep[:, None, None, :]
        y = F.scaled_dot_product_attention(
            q, kv[0], kv[1], attn_mask=mask, is_causal=self.causal and mask is None,
            enable_gqa=self.kv_heads != self.heads,
        )  # fmt: skip
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class EagerAttention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, keep):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) * (d // 2) ** -0.5
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, t, d)


class RandomNet(nn.Module):
    """Embedding, one or two residual blocks of random kinds, a norm, a (maybe tied) head."""

    def __init__(self, rng: random.Random, d: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        blocks = []
        for _ in range(rng.choice([1, 2])):
            kind = rng.choice(["sdpa", "mha", "eager", "mlp", "conv", "gru"])
            if kind == "sdpa":
                heads = rng.choice([1, 2, 4])
                blocks.append(SdpaAttention(d, heads, rng.random() < 0.5, rng.random() < 0.3))
            elif kind == "mha":
                blocks.append(nn.MultiheadAttention(
                    d, rng.choice([1, 2]), batch_first=True, bias=rng.random() < 0.5,
                    add_bias_kv=rng.random() < 0.3,
                ))  # fmt: skip
            elif kind == "eager":
                blocks.append(EagerAttention(d))
            elif kind == "mlp":
                blocks.append(
                    nn.Sequential(
                        nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)
                    )
                )
            elif kind == "conv":
                blocks.append(nn.Conv1d(d, d, 3, padding=1))
            else:
                blocks.append(nn.GRU(d, d, batch_first=True))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.BatchNorm1d(d) if rng.random() < 0.3 else nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        if rng.random() < 0.4:
            self.head.weight = self.emb.weight
        elif rng.random() < 0.4:
            self.emb.weight.requires_grad_(False)

    def forward(self, idx, keep=None):
        x = self.emb(idx)
        for block in self.blocks:
            if isinstance(block, nn.MultiheadAttention):
                pad = None if keep is None else ~keep
                y = block(x, x, x, key_padding_mask=pad, need_weights=False)[0]
            elif isinstance(block, (SdpaAttention, EagerAttention)):
                y = block(x, keep)
            elif isinstance(block, nn.Conv1d):
                y = block(x.transpose(1, 2)).transpose(1, 2)
            elif isinstance(block, nn.GRU):
                y = block(x)[0]
            else:
                y = block(x)
            x = x + y
        if isinstance(self.norm, nn.BatchNorm1d):
            return self.head(self.norm(x.transpose(1, 2)).transpose(1, 2))
        return self.head(self.norm(x))


# Seeds 25, 47 and 71 add what the first eight lack: a GRU, eager attention, GQA, add_bias_kv,
# BatchNorm and bf16 attention.
@pytest.mark.parametrize("seed", [*range(8), 25, 47, 71])
def test_a_monitored_run_trains_bitwise_like_its_unmonitored_twin(make_monitor, seed):
    rng = random.Random(seed)
    d, t, b = rng.choice([8, 16]), rng.choice([5, 9, 16]), rng.choice([1, 3])
    torch.manual_seed(seed)
    model = RandomNet(rng, d).to(rng.choice([torch.float32, torch.bfloat16]))
    twin = copy.deepcopy(model)
    hooks_before = hook_state(model)

    def optimizer(m):
        params = [p for p in m.parameters() if p.requires_grad]
        if seed % 2:
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2)

    opt, twin_opt = optimizer(model), optimizer(twin)
    monitor = make_monitor(
        model, strict=True, flush_every=rng.choice([1, 2, 3]), rules__act=False,
        gradients__every=rng.choice([1, 2]), activations__every=rng.choice([1, 2]),
        attention__every=rng.choice([1, 2]), attention__rows=rng.choice([0, 3]),
        attention__batch=rng.choice([0, 1]), weights__every=rng.choice([1, 3]),
        optimizer__every=rng.choice([1, 2]),
    ).attach(opt)  # fmt: skip
    padded = rng.random() < 0.4
    calls_step = rng.random() < 0.5
    for step in range(6):
        g = torch.Generator().manual_seed(100 * seed + step)
        idx, target = (torch.randint(0, VOCAB, (b, t), generator=g) for _ in range(2))
        keep = None
        if padded:
            keep = torch.ones(b, t, dtype=torch.bool)
            keep[:, -1] = step % 2 == 1
        losses = []
        for m, o in ((model, opt), (twin, twin_opt)):
            loss = F.cross_entropy(m(idx, keep).float().reshape(-1, VOCAB), target.reshape(-1))
            loss.backward()
            if m is model and calls_step:
                monitor.step(loss)
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
    assert monitor.snapshot().step >= 0 and len(list(monitor.snapshot())) > 0
    monitor.detach()
    assert hook_state(model) == hooks_before
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name
    for (name, buf), twin_buf in zip(model.named_buffers(), twin.buffers(), strict=True):
        assert torch.equal(buf, twin_buf), name
