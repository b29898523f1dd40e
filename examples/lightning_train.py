"""A Lightning module trained with numwatch through ``NumwatchCallback``.

    python examples/lightning_train.py --steps 40            # CPU, under a minute
    python examples/lightning_train.py --preset small --steps 2000 --accelerator gpu

The module wraps the nanoGPT-style GPT of examples/gpt2.py; gradient statistics are taken in
``on_before_optimizer_step``, before Lightning clips (so they are the true gradients).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2 import GPT, PRESETS, batches

from numwatch.integrations.lightning import NumwatchCallback


class LitGPT(lightning.LightningModule):
    def __init__(self, preset: str, lr: float) -> None:
        super().__init__()
        self.model = GPT(PRESETS[preset])
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95))


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, preset: str, batch: int) -> None:
        self.preset, self.batch = preset, batch

    def __iter__(self):
        yield from batches(PRESETS[self.preset], self.batch, "bigram", 0, "cpu")


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--jsonl", default=None)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    module = LitGPT(args.preset, args.lr)
    overrides = {"flush_every": 10}
    if args.jsonl:
        overrides["sinks__jsonl__path"] = args.jsonl
    callback = NumwatchCallback(stop_on=["nonfinite"], **overrides)
    trainer = lightning.Trainer(
        max_steps=args.steps,
        accelerator=args.accelerator,
        gradient_clip_val=1.0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    loader = torch.utils.data.DataLoader(Stream(args.preset, args.batch), batch_size=None)
    trainer.fit(module, loader)
    loss = float(trainer.callback_metrics["loss"])
    print(f"final loss {loss:.4f}; numwatch events: {len(callback.monitor.events)}")
    return loss


if __name__ == "__main__":
    main()
