"""Test helper: the tiny GPT-2 of examples/gpt2.py, built on CUDA."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt2 import GPT, PRESETS


def tiny_gpt_on_cuda():
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), device="cuda")
    return model, opt, x, torch.roll(x, -1, 1)
