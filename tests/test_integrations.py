"""Lightning and Hugging Face Trainer callbacks with the real frameworks on a tiny GPT: where the
gradient statistics are taken (before / after clipping), loss and attention metrics, detach at
the end, and stop requests (event kinds, request_stop, the halt action)."""

from __future__ import annotations

import logging
import math
from functools import partial
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from numwatch.demo import GPTConfig, TinyGPT, bigram_batches
from numwatch.sinks.jsonl import read_jsonl

CFG = GPTConfig(vocab=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)
CLIP = 1e-3  # far below the gradient norm of a fresh model: clipping always acts


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = bigram_batches(CFG, 4, seed=1)
    return [next(data) for _ in range(n)]


def loader(n: int) -> DataLoader:
    """n batches of 4 sequences, in order."""
    x, y = (torch.cat(parts) for parts in zip(*batches(n), strict=True))
    return DataLoader(TensorDataset(x, y), batch_size=4)


def monitor_options(**extra):
    return {
        "flush_every": 1,
        "attention__every": 1,
        "sinks__jsonl__enabled": False,
        "sinks__console__enabled": False,
        **extra,
    }


HALT_ON_ANY_LOSS = {
    "defaults": False,
    "add": [
        {
            "type": "threshold",
            "name": "loss_seen",
            "metric": "loss",
            "threshold": -1.0,
            "actions": ["halt"],
        }
    ],
}


# ------------------------------------------------------------------------------ Lightning
@pytest.fixture(scope="module")
def pl():
    return pytest.importorskip("lightning.pytorch", reason="lightning (test extra) not installed")


def recording_module(pl):
    """A Lightning module whose training_step keeps each micro-batch's loss (the list)."""
    module, losses = lightning_module(pl), []
    training_step = module.training_step

    def recorded(batch, batch_idx):
        loss = training_step(batch, batch_idx)
        losses.append(loss.item())
        return loss

    module.training_step = recorded
    return module, losses


def lightning_module(pl, nan_at: int | None = None, optimizer=None):
    """``optimizer``: made from the parameters (SGD, lr 0.1, where None)."""

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT(CFG)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def on_after_backward(self):
            if self.global_step == nan_at:
                self.model.head.weight.grad[0, 0] = float("nan")

        def configure_optimizers(self):
            return (optimizer or partial(torch.optim.SGD, lr=0.1))(self.parameters())

    return Module()


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization: ``step(closure)`` needs its closure, which it calls again
    at a perturbed point (the update uses the gradients there)."""

    def __init__(self, params, lr=0.1, rho=0.05):
        super().__init__(params, {"lr": lr, "rho": rho})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None:
            raise RuntimeError("SAM needs its closure")
        loss = torch.enable_grad()(closure)()
        (group,) = self.param_groups
        params = [p for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        shifts = [p.grad * (group["rho"] / (norm + 1e-12)) for p in params]
        torch._foreach_add_(params, shifts)
        self.zero_grad()
        torch.enable_grad()(closure)()
        torch._foreach_sub_(params, shifts)
        torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])
        return loss


def two_optimizer_module(pl, nan_at: int | None = None, optimizer=torch.optim.SGD):
    """Manual optimization with two ``optimizer``s (a GAN's shape); a NaN activation at batch
    ``nan_at``."""

    class Two(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            h = self.a(batch[0])
            if batch_idx == nan_at:
                h = h * float("nan")
            loss = self.b(h).pow(2).mean()
            o1, o2 = self.optimizers()
            o1.zero_grad()
            o2.zero_grad()
            self.manual_backward(loss)
            o1.step()
            o2.step()

        def configure_optimizers(self):
            return [optimizer(self.a.parameters(), lr=0.1),
                    optimizer(self.b.parameters(), lr=0.1)]  # fmt: skip

    return Two()


def grad_norm(module: nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def lightning_trainer(pl, callbacks, steps: int, clip: float | None = None, **kwargs):
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=clip,
        callbacks=callbacks,
        **kwargs,
    )


def test_lightning_statistics_are_before_clipping(pl):
    from numwatch.integrations.lightning import NumwatchCallback

    before_clipping, norms = [], []

    class After(pl.Callback):  # runs after NumwatchCallback: the same, unclipped gradients
        def on_before_optimizer_step(self, trainer, module, optimizer):
            before_clipping.append(grad_norm(module))

        def on_train_batch_end(self, trainer, module, *args):
            norms.append(callback.monitor.snapshot().value("grad_norm"))

    callback = NumwatchCallback(**monitor_options())
    module = lightning_module(pl)
    lightning_trainer(pl, [callback, After()], steps=3, clip=CLIP).fit(module, loader(3))
    assert len(norms) == 3 and all(n > 10 * CLIP for n in norms)  # not clipped
    assert norms == pytest.approx(before_clipping, rel=1e-5)
    assert not callback.monitor.attached  # detached at train end, still readable
    assert not module.model._forward_hooks
    assert all(not p._post_accumulate_grad_hooks for p in module.parameters())


def test_lightning_loss_attention_and_optimizer_metrics(pl):
    from numwatch.integrations.lightning import NumwatchCallback

    snapshots = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            snap = callback.monitor.snapshot()
            snapshots.append((outputs["loss"].item(), snap))

    callback = NumwatchCallback(**monitor_options())
    lightning_trainer(pl, [callback, Keep()], steps=3).fit(lightning_module(pl), loader(3))
    for loss, snap in snapshots:
        assert snap.value("loss") == pytest.approx(loss)
    last = snapshots[-1][1]
    assert {r.labels["layer"] for r in last.series("attn_max_logit")} == {
        "model.blocks.0.attn",
        "model.blocks.1.attn",
    }
    assert last.series("optimizer_lr")  # the optimizer was attached (optimizer probe)


def test_lightning_validation_attention_is_measured_outside_training(pl, tmp_path):
    """attention.training_only false: a validation_step calling submodules (not the
    LightningModule's forward) ran outside any forward the probe follows, and its attention
    went unmeasured; the validation after the last step never reached the log at all."""
    from numwatch.integrations.lightning import NumwatchCallback
    from numwatch.sinks.jsonl import read_jsonl

    module = lightning_module(pl)

    def validation_step(batch, batch_idx):
        x, y = batch
        return F.cross_entropy(module.model(x).flatten(0, 1), y.flatten())

    module.validation_step = validation_step
    log = tmp_path / "run.jsonl"
    callback = NumwatchCallback(**monitor_options(
        flush_every=3, attention__training_only=False, sinks__jsonl__enabled=True,
        sinks__jsonl__path=str(log),
    ))  # fmt: skip
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[callback],
    )  # fmt: skip
    trainer.fit(module, loader(3), loader(2))  # 3 training batches, then 2 validation batches
    calls = [
        m["value"] for r in read_jsonl(log) for m in r["metrics"]
        if m["name"] == "attn_calls" and m["labels"]["layer"] == "model.blocks.0.attn"
    ]  # fmt: skip
    assert calls == [3.0, 2.0]  # the training steps' flush, then detach's: the validation


def test_lightning_loss_under_accumulation_is_the_mean_of_the_micro_batches(pl):
    """With accumulate_grad_batches=k the loss was the last micro-batch's divided by k."""
    from numwatch.integrations.lightning import NumwatchCallback

    module, micro = recording_module(pl)
    callback = NumwatchCallback(**monitor_options())
    trainer = lightning_trainer(pl, [callback], steps=2)
    trainer.accumulate_grad_batches = 4
    trainer.fit(module, loader(8))
    assert len(micro) == 8
    losses = [s.value("loss") for s in callback.monitor.history]
    assert losses == pytest.approx([sum(micro[:4]) / 4, sum(micro[4:]) / 4], rel=1e-6)


def test_lightning_loss_of_a_partial_accumulation_window_is_its_mean(pl):
    """accumulate_grad_batches=4 with 5 batches an epoch: Lightning steps on the epoch's last
    batch alone, its loss divided by 4 all the same, and the step reported a quarter of it."""
    from numwatch.integrations.lightning import NumwatchCallback

    module, micro = recording_module(pl)
    callback = NumwatchCallback(**monitor_options())
    trainer = lightning_trainer(pl, [callback], steps=4, accumulate_grad_batches=4)
    trainer.fit(module, loader(5))  # two epochs: windows of 4 and 1 batches each
    assert len(micro) == 10
    losses = [s.value("loss") for s in callback.monitor.history]
    expected = [sum(micro[:4]) / 4, micro[4], sum(micro[5:9]) / 4, micro[9]]
    assert losses == pytest.approx(expected, rel=1e-6)


def test_lightning_lbfgs_step_loss_is_its_first_closure_calls(pl):
    """LBFGS calls the closure again in its line search, after the step closed: those losses
    were added to the next step's, and averaged with it as micro-batches."""
    from numwatch.integrations.lightning import NumwatchCallback

    module = lightning_module(pl, optimizer=partial(torch.optim.LBFGS, lr=0.1, max_iter=3))
    calls = []  # (batch, loss) of every closure call
    training_step = module.training_step

    def recorded(batch, batch_idx):
        loss = training_step(batch, batch_idx)
        calls.append((batch_idx, loss.item()))
        return loss

    module.training_step = recorded
    callback = NumwatchCallback(**monitor_options())
    lightning_trainer(pl, [callback], steps=3).fit(module, loader(3))
    assert len(calls) > 3  # the line search ran
    first = {}
    for batch, loss in calls:
        first.setdefault(batch, loss)
    losses = [s.value("loss") for s in callback.monitor.history]
    assert losses == pytest.approx([first[0], first[1], first[2]], rel=1e-6)


def test_lightning_skip_step_skips_the_step_it_judged(pl):
    from numwatch.integrations.lightning import NumwatchCallback

    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    callback = NumwatchCallback(**monitor_options(rules=rules))
    weights = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            weights.append([p.detach().clone() for p in module.parameters()])

    module = lightning_module(pl, nan_at=2)
    trainer = lightning_trainer(pl, [callback, Keep()], steps=5)
    trainer.fit(module, loader(5))  # the closure ran on every step (Lightning checks it)
    assert trainer.global_step == 5
    same = [
        all(torch.equal(a, b) for a, b in zip(w0, w1, strict=True)) for w0, w1 in pairwise(weights)
    ]
    assert same == [False, True, False, False]  # only the NaN step (the third) left them
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert "step" not in trainer.optimizers[0].__dict__  # wrappers removed at the end


@pytest.mark.parametrize(
    "optimizer", [SAM, partial(torch.optim.LBFGS, lr=0.1, max_iter=3)], ids=["sam", "lbfgs"]
)
def test_lightning_an_optimizer_that_calls_its_closure_again_trains_as_without_it(pl, optimizer):
    """The closure-first wrapper ran the closure, then called step() without it: a step that
    needs it (SAM) raised and the fit failed."""
    from numwatch.integrations.lightning import NumwatchCallback

    def fit(callbacks):
        module = lightning_module(pl, optimizer=optimizer)
        lightning_trainer(pl, callbacks, steps=3).fit(module, loader(3))
        return [p.detach() for p in module.parameters()]

    callback = NumwatchCallback(**monitor_options())
    watched, plain = fit([callback]), fit([])
    assert all(torch.equal(a, b) for a, b in zip(watched, plain, strict=True))
    assert callback.monitor.steps == 3


def test_lightning_a_second_optimizer_that_needs_its_closure_gets_it(pl):
    """Manual optimization, the second optimizer a SAM: its wrapper called step() without the
    closure too."""
    from numwatch.integrations.lightning import NumwatchCallback

    class Two(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            def closure():
                self.zero_grad()
                loss = self.b(self.a(batch[0])).pow(2).mean()
                self.manual_backward(loss)
                return loss

            for optimizer in self.optimizers():
                optimizer.step(closure=closure)

        def configure_optimizers(self):
            return [torch.optim.SGD(self.a.parameters(), lr=0.1), SAM(self.b.parameters())]

    def fit(callbacks):
        module = Two()
        data = DataLoader(TensorDataset(torch.randn(12, 8)), batch_size=4)
        lightning_trainer(pl, callbacks, steps=6).fit(module, data)  # 3 batches, 2 steps each
        return [p.detach() for p in module.parameters()]

    callback = NumwatchCallback(**monitor_options())
    watched, plain = fit([callback]), fit([])
    assert all(torch.equal(a, b) for a, b in zip(watched, plain, strict=True))
    assert callback.monitor.steps == 3


def test_lightning_two_optimizers_one_step_per_batch_and_the_skip_holds_both(pl):
    """Manual optimization with two optimizers: each batch closed two monitor steps (the second
    with the first one's loss), and a skip_step held only the first optimizer's NaN update
    while logging that it had skipped: the second one's parameters went NaN."""
    from numwatch.integrations.lightning import NumwatchCallback

    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    callback = NumwatchCallback(**monitor_options(rules=rules))
    module = two_optimizer_module(pl, nan_at=2)
    data = DataLoader(TensorDataset(torch.randn(20, 8)), batch_size=4)
    trainer = lightning_trainer(pl, [callback], steps=10)  # 5 batches, 2 optimizer steps each
    trainer.fit(module, data)
    assert callback.monitor.steps == 5
    skips = [e.step for e in callback.monitor.events if e.kind == "action"]
    assert skips == [2]
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert all("step" not in o.__dict__ for o in trainer.optimizers)  # wrappers removed


def test_lightning_a_skip_clears_a_second_optimizer_whose_zero_grad_takes_no_argument(pl):
    """The second optimizer's skip called zero_grad(set_to_none=True): an optimizer whose
    zero_grad() takes no argument raised a TypeError from its step() and stopped the fit."""
    from numwatch.integrations.lightning import NumwatchCallback

    class PlainZeroGrad(torch.optim.SGD):
        def zero_grad(self):
            super().zero_grad()

    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    callback = NumwatchCallback(**monitor_options(rules=rules))
    module = two_optimizer_module(pl, nan_at=2, optimizer=PlainZeroGrad)
    data = DataLoader(TensorDataset(torch.randn(20, 8)), batch_size=4)
    trainer = lightning_trainer(pl, [callback], steps=10)  # 5 batches, 2 optimizer steps each
    trainer.fit(module, data)
    assert trainer.global_step == 10 and callback.monitor.steps == 5
    assert [e.step for e in callback.monitor.events if e.kind == "action"] == [2]
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_lightning_a_nan_in_the_first_step_is_skipped(pl):
    """The optimizer was attached after the first step closed: skip_step on step 0 raised
    'skip_step needs the optimizer: monitor.attach(optimizer)' and the NaN update went through."""
    from numwatch.integrations.lightning import NumwatchCallback

    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    callback = NumwatchCallback(**monitor_options(rules=rules))
    module = lightning_module(pl, nan_at=0)
    lightning_trainer(pl, [callback], steps=3).fit(module, loader(3))
    assert callback.monitor.errors == {}
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_lightning_wrappers_keep_the_lr_schedulers_mark(pl, recwarn):
    """The closure-first wrapper lacked the scheduler's mark: PyTorch warned that
    optimizer.step() had been overridden after the scheduler was built."""
    from numwatch.integrations.lightning import NumwatchCallback

    class Scheduled(type(lightning_module(pl))):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    callback = NumwatchCallback(**monitor_options())
    lightning_trainer(pl, [callback], steps=3).fit(Scheduled(), loader(3))
    assert not [w for w in recwarn if "overridden" in str(w.message)]


def test_lightning_halt_in_the_step_of_a_skip_still_skips_it(pl):
    """A halt in the same step close as a skip_step decision detached the monitor, and the
    optimizer wrapper with it: the NaN update went through (the log said it was skipped)."""
    from numwatch.integrations.lightning import NumwatchCallback

    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step", "halt"]}]}
    callback = NumwatchCallback(**monitor_options(rules=rules))
    module = lightning_module(pl, nan_at=2)
    lightning_trainer(pl, [callback], steps=6).fit(module, loader(6))
    assert callback.halt is not None
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert any(e.kind == "action" and "skip_step" in e.message for e in callback.monitor.events)


def test_lightning_stops_on_event_kind(pl):
    from numwatch.integrations.lightning import NumwatchCallback

    callback = NumwatchCallback(stop_on=["nonfinite"], **monitor_options())
    trainer = lightning_trainer(pl, [callback], steps=6)
    trainer.fit(lightning_module(pl, nan_at=1), loader(6))
    assert trainer.global_step == 2  # the step with the NaN ran to its end, then the fit stopped
    assert "nonfinite event" in callback.stop_reason


def test_lightning_halt_becomes_should_stop(pl):
    from numwatch.integrations.lightning import NumwatchCallback

    callback = NumwatchCallback(**monitor_options(rules=HALT_ON_ANY_LOSS))
    trainer = lightning_trainer(pl, [callback], steps=6)
    trainer.fit(lightning_module(pl), loader(6))  # no exception escapes the fit
    assert trainer.global_step == 1
    assert callback.halt.report["rule"] == "loss_seen"


def test_lightning_request_stop(pl):
    from numwatch.integrations.lightning import NumwatchCallback

    callback = NumwatchCallback(**monitor_options())

    class Stopper(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                callback.request_stop("enough")

    trainer = lightning_trainer(pl, [callback, Stopper()], steps=6)
    trainer.fit(lightning_module(pl), loader(6))
    assert trainer.global_step == 2 and callback.stop_reason == "enough"


def test_lightning_scaler_overflows_are_not_nonfinite_events(pl):
    """precision="16-mixed": the callback never gave the monitor the plugin's GradScaler, so its
    overflow steps (skipped by design) were critical nonfinite events and stop_on stopped the
    fit at step 0."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from numwatch.integrations.lightning import NumwatchCallback

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # overflows fp16 gradients
    callback = NumwatchCallback(stop_on=["nonfinite"], **monitor_options())
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = lightning_trainer(pl, [callback], steps=3, plugins=[plugin])
    trainer.fit(lightning_module(pl), loader(3))
    assert trainer.global_step == 3 and callback.stop_reason is None
    events = [(e.kind, e.rule, e.severity) for e in callback.monitor.events]
    assert events == [("anomaly", "scaler_overflow", "info")] * 3
    assert scaler.get_scale() == 2.0**21  # each of the three steps overflowed and was skipped


def test_lightning_a_fit_interrupted_after_backward_leaves_no_loss_behind(pl):
    """The loss of a step that never closed stayed in the callback: the next fit's first step
    reported it added to its own."""
    from numwatch.integrations.lightning import NumwatchCallback

    module, losses = recording_module(pl)
    seen = []

    def interrupt():
        if module.global_step == 1:
            raise RuntimeError("interrupted after backward")

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(callback.monitor.snapshot().value("loss"))

    module.on_after_backward = interrupt
    callback = NumwatchCallback(**monitor_options())
    with pytest.raises(RuntimeError, match="interrupted after backward"):
        lightning_trainer(pl, [callback], steps=3).fit(module, loader(3))
    module.on_after_backward = lambda: None
    losses.clear()
    lightning_trainer(pl, [callback, Keep()], steps=2).fit(module, loader(2))
    assert seen == pytest.approx(losses, rel=1e-6)


def test_lightning_loss_under_16_mixed_is_not_the_scaled_loss(pl):
    """precision="16-mixed" passes on_before_backward the loss multiplied by the GradScaler's
    scale: the monitor reported that (x16 here, x65536 at fp16's default scale)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from numwatch.integrations.lightning import NumwatchCallback

    losses = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append((outputs["loss"].item(), callback.monitor.snapshot().value("loss")))

    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)  # low enough: no overflow
    callback = NumwatchCallback(**monitor_options())
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = lightning_trainer(pl, [callback, Keep()], steps=3, plugins=[plugin])
    trainer.fit(lightning_module(pl), loader(3))
    assert scaler.get_scale() == 16.0 and len(losses) == 3
    for loss, seen in losses:
        assert seen == pytest.approx(loss, rel=1e-6)


_LIGHTNING_DDP_FAILS = """
import sys
from datetime import timedelta
import torch, torch.nn.functional as F
import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset
sys.path.insert(0, sys.argv[1])
import test_integrations as t
from numwatch.integrations.lightning import NumwatchCallback

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = t.TinyGPT(t.CFG)
    def training_step(self, batch, batch_idx):
        if batch_idx == 3 and self.global_rank == 1:
            raise RuntimeError("rank 1 fails (simulated)")
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

trainer = pl.Trainer(
    max_steps=8, accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=60)),
    logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, use_distributed_sampler=False,
    callbacks=[NumwatchCallback(**t.monitor_options(flush_every=10))],
)
trainer.fit(Module(), t.loader(8))
"""


def test_lightning_ddp_a_failing_rank_raises_its_own_error(pl, tmp_path):
    """Rank 1 raises in training_step while rank 0 waits in DDP's gradient all-reduce:
    on_exception detached with the final flush, a collective rank 1 ran alone; gloo aborted
    ('collective mismatch') and rank 1's own error was never printed."""
    import subprocess
    import sys

    script = tmp_path / "ddp_fails.py"  # Lightning starts rank 1 by running this file again
    script.write_text(_LIGHTNING_DDP_FAILS)
    run = subprocess.run(
        [sys.executable, str(script), str(Path(__file__).parent)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0
    assert "RuntimeError: rank 1 fails (simulated)" in run.stderr
    assert "collective mismatch" not in run.stderr


# ------------------------------------------------------------------------------ HF Trainer
@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("accelerate", reason="accelerate (test extra) not installed")
    return pytest.importorskip("transformers", reason="transformers (test extra) not installed")


class LMWrapper(nn.Module):
    """A model the Trainer can train: input_ids and labels in, {'loss', 'logits'} out."""

    def __init__(self, nan_at: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(CFG)
        self.nan_at = nan_at
        self.calls = 0

    def forward(self, input_ids, labels):
        logits = self.model(input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if self.calls == self.nan_at:
            loss = loss + self.model.head.weight[0, 0] * float("nan")
        self.calls += 1
        return {"loss": loss, "logits": logits}


def hf_trainer(hf, tmp_path, model, callbacks, steps: int, clip: float = 0.0, **args):
    args = hf.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        max_grad_norm=clip,
        logging_strategy=args.pop("logging_strategy", "no"),
        save_strategy=args.pop("save_strategy", "no"),
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **args,
    )
    micro = steps * args.gradient_accumulation_steps
    rows = [{"input_ids": x[i], "labels": y[i]} for x, y in batches(micro) for i in range(4)]
    return hf.Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)


class TokenSumLMWrapper(LMWrapper):
    """A model that takes the Trainer's num_items_in_batch: under gradient accumulation each
    micro-batch's loss is its share of the step's token-weighted mean (transformers 5)."""

    def forward(self, input_ids, labels, **kwargs):  # **kwargs: the Trainer's sign to pass it
        logits = self.model(input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return {"loss": loss / kwargs["num_items_in_batch"], "logits": logits}


@pytest.mark.parametrize("wrapper", [LMWrapper, TokenSumLMWrapper])
def test_hf_loss_is_the_trainers_training_loss_under_accumulation(hf, tmp_path, wrapper):
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    losses = []

    class Keep(hf.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            losses.append(callback.monitor.snapshot().value("loss"))

    callback = NumwatchTrainerCallback(**monitor_options())
    trainer = hf_trainer(
        hf, tmp_path, wrapper(), [callback, Keep()], steps=3, gradient_accumulation_steps=4,
        logging_strategy="steps", logging_steps=1,
    )  # fmt: skip
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == len(losses) == 3
    assert losses == pytest.approx(logged, rel=1e-5)  # not a micro-batch's, nor a quarter of it


class TupleLMWrapper(LMWrapper):
    """A model returning (loss, logits): the Trainer takes outputs[0] as the loss."""

    def forward(self, input_ids, labels):
        out = super().forward(input_ids, labels)
        return out["loss"], out["logits"]


class LogitsLMWrapper(LMWrapper):
    """Logits only: the Trainer computes the loss (label smoothing, compute_loss_func)."""

    config = None  # the Trainer reads model.config.problem_type

    def forward(self, input_ids, labels=None):
        return {"logits": self.model(input_ids)}


def cross_entropy(outputs, labels, num_items_in_batch=None):
    return F.cross_entropy(outputs["logits"].flatten(0, 1), labels.flatten())


def doubled_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
    """A compute_loss override: the loss is the Trainer's, not the model's."""
    outputs = model(**inputs)
    return (2 * outputs["loss"], outputs) if return_outputs else 2 * outputs["loss"]


@pytest.mark.parametrize("case", ["tuple", "label_smoothing", "compute_loss_func", "compute_loss"])
def test_hf_loss_computed_outside_the_model_is_the_trainers(hf, tmp_path, case):
    """The loss was read from the model's outputs' ``loss``: none was recorded for a tuple
    output, ``label_smoothing_factor``, ``compute_loss_func`` or a ``compute_loss`` of the
    Trainer's own."""
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    losses = []

    class Keep(hf.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            losses.append(callback.monitor.snapshot().value("loss"))

    callback = NumwatchTrainerCallback(**monitor_options())
    model = {"tuple": TupleLMWrapper, "compute_loss": LMWrapper}.get(case, LogitsLMWrapper)()
    smoothing = {"label_smoothing_factor": 0.1} if case == "label_smoothing" else {}
    trainer = hf_trainer(
        hf, tmp_path, model, [callback, Keep()], steps=3, gradient_accumulation_steps=2,
        logging_strategy="steps", logging_steps=1, **smoothing,
    )  # fmt: skip
    if case == "compute_loss_func":  # taken as scaled for accumulation: the sum is logged
        trainer.compute_loss_func = cross_entropy
    if case == "compute_loss":
        trainer.compute_loss = doubled_loss
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and losses == pytest.approx(logged, rel=1e-5)
    assert "training_step" not in trainer.__dict__  # the Trainer's own method again


_HF_DDP_LOSS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
import transformers as hf
import test_integrations as t
from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

losses = []
class Keep(hf.TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        losses.append(callback.monitor.snapshot().value("loss"))

callback = NumwatchTrainerCallback(**t.monitor_options())
trainer = t.hf_trainer(
    hf, sys.argv[2], t.TokenSumLMWrapper(), [callback, Keep()], steps=3,
    gradient_accumulation_steps=2, logging_strategy="steps", logging_steps=1, ddp_backend="gloo",
)
trainer.train()
if dist.get_rank() == 0:
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    world = dist.get_world_size()
    print("RESULT", json.dumps({"world": world, "monitor": losses, "logged": logged}))
"""


def test_hf_ddp_loss_is_the_trainers_for_a_model_taking_num_items_in_batch(hf, tmp_path):
    """Under average_tokens_across_devices (the default) the Trainer multiplies each rank's
    share of the token-weighted loss by the number of ranks; the monitor's loss was the logged
    loss divided by the world size."""
    import json
    import subprocess
    import sys

    script = tmp_path / "hf_ddp.py"
    script.write_text(_HF_DDP_LOSS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)]
    run = subprocess.run(
        [*cmd, str(Path(__file__).parent), str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["world"] == 2 and len(result["logged"]) == 3
    assert result["monitor"] == pytest.approx(result["logged"], rel=1e-5)


def test_hf_train_again_after_an_interrupted_train(hf, tmp_path):
    """A train() that raised (Ctrl-C) never reaches on_train_end; the next train() counted each
    loss twice (two loss hooks) and left a hook on the model."""
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    losses = []

    class Interrupt(hf.TrainerCallback):
        armed = True

        def on_step_end(self, args, state, control, **kw):
            if self.armed and state.global_step == 2:
                self.armed = False
                raise KeyboardInterrupt

    class Keep(hf.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            losses.append(callback.monitor.snapshot().value("loss"))

    callback = NumwatchTrainerCallback(**monitor_options())
    model = TokenSumLMWrapper()
    trainer = hf_trainer(
        hf, tmp_path, model, [callback, Interrupt(), Keep()], steps=4, logging_strategy="steps",
        logging_steps=1,
    )  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    losses.clear()
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h][-4:]
    assert losses == pytest.approx(logged, rel=1e-5)
    assert not callback.monitor.attached
    assert not model._forward_hooks


def test_hf_statistics_are_after_clipping(hf, tmp_path):
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    norms, losses = [], []

    class Keep(hf.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            snap = callback.monitor.snapshot()
            norms.append(snap.value("grad_norm"))
            losses.append(snap.value("loss"))

    callback = NumwatchTrainerCallback(**monitor_options())
    model = LMWrapper()
    hf_trainer(hf, tmp_path, model, [callback, Keep()], steps=3, clip=CLIP).train()
    assert norms == pytest.approx([CLIP] * 3, rel=1e-3)  # the clipped gradients
    assert all(math.isfinite(v) and v > 0 for v in losses)
    assert not callback.monitor.attached and not model._forward_hooks  # detached, readable


def test_hf_optimizer_attached_and_stop_on_event(hf, tmp_path):
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    callback = NumwatchTrainerCallback(stop_on=["nonfinite"], **monitor_options())
    seen = []

    class Keep(hf.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if callback.monitor is not None:
                seen.append(bool(callback.monitor.snapshot().series("optimizer_lr")))

    trainer = hf_trainer(hf, tmp_path, LMWrapper(nan_at=1), [callback, Keep()], steps=6)
    trainer.train()
    assert trainer.state.global_step == 2 and "nonfinite event" in callback.stop_reason
    assert seen and all(seen)


def test_hf_skip_step_reaches_the_optimizer_inside_accelerate(hf, tmp_path):
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    callback = NumwatchTrainerCallback(**monitor_options(rules=rules))
    weights, lrs = [], []

    class Keep(hf.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kw):
            weights.append([p.detach().clone() for p in model.parameters()])
            lrs.append(lr_scheduler.get_last_lr()[0])

    model = LMWrapper(nan_at=2)
    hf_trainer(hf, tmp_path, model, [callback, Keep()], steps=4).train()
    same = [
        all(torch.equal(a, b) for a, b in zip(w0, w1, strict=True)) for w0, w1 in pairwise(weights)
    ]
    assert same == [False, True, False]  # the NaN step (the third) did not update
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # linear decay from 0.05 over 4 steps, not advanced by the withheld step (step_was_skipped)
    assert lrs == pytest.approx([0.0375, 0.025, 0.025, 0.0125])


def test_attach_takes_accelerates_optimizer_and_its_scaler():
    """Monitor.attach(accelerator.prepare(...)'s optimizer) raised a raw AttributeError
    ('_optimizer_step_pre_hooks'): an AcceleratedOptimizer is a torch Optimizer by type, with no
    hooks of its own. Its steps run the wrapped optimizer's: one monitor step per update (none
    for the micro-batches Accelerate accumulates), its scaler's overflows anomalies."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate (test extra) not installed")
    from accelerate.optimizer import AcceleratedOptimizer

    from numwatch import Monitor, NumwatchError

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, sgd)
    monitor = Monitor(model, **monitor_options()).attach(optimizer)
    for x, y in batches(6):
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
            optimizer.step()
            optimizer.zero_grad()
    monitor.detach()
    assert monitor.steps == 3 and monitor.snapshot().series("optimizer_lr")
    assert not sgd._optimizer_step_pre_hooks and not sgd._optimizer_step_post_hooks

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    wrapped = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    monitor = Monitor(model, **monitor_options()).attach(wrapped)
    for x, y in batches(2):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        model.head.weight.grad[0, 0] = float("inf")  # an overflow of the scaled gradients
        monitor.step(loss)  # the scaler skips the update: no hook of the optimizer runs
        wrapped.step()
        wrapped.zero_grad()
    monitor.detach()
    events = [(e.kind, e.rule) for e in monitor.events]
    assert events == [("anomaly", "scaler_overflow")] * 2
    assert wrapped.step_was_skipped and scaler.get_scale() == 2.0**14

    class Hookless(torch.optim.Optimizer):
        def __init__(self):  # no Optimizer.__init__, and nothing wrapped
            pass

    monitor = Monitor(model, **monitor_options())
    with pytest.raises(NumwatchError, match="Hookless is a torch Optimizer without step hooks"):
        monitor.attach(Hookless())
    assert not monitor.attached


def _accelerated_sgd_with_scaler():
    """A one-weight model, its SGD at LR 1 and Accelerate's wrapper of it around a CPU GradScaler
    (scale 4, never grown)."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate (test extra) not installed")
    from accelerate.optimizer import AcceleratedOptimizer

    accelerate.Accelerator(cpu=True)
    model = nn.Linear(1, 1, bias=False)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=10**6)
    return model, sgd, scaler, AcceleratedOptimizer(sgd, scaler=scaler)


def test_actions_act_on_the_steps_of_accelerates_grad_scaler(caplog):
    """With a GradScaler, AcceleratedOptimizer.step runs the method it saved at prepare and then
    sets optimizer.step back to it: the monitor's step wrapper was gone after the first step, so
    skip_step and lr_backoff did nothing and a plain loop closed no step. Detach gives Accelerate
    back its own methods."""
    from numwatch import Monitor

    model, sgd, scaler, wrapped = _accelerated_sgd_with_scaler()
    saved = (wrapped._optimizer_original_step_method, wrapped._optimizer_patched_step_method)
    actions = ["skip_step", {"type": "lr_backoff", "factor": 0.5, "steps": 2}]
    rule = {"type": "threshold", "name": "big", "metric": "loss", "threshold": 100.0}
    rules = {"defaults": False, "add": [{**rule, "actions": actions}]}
    monitor = Monitor(model, **monitor_options(rules=rules)).attach(wrapped)

    def train(steps, big_at=None, overflow_at=None):
        used, skipped = [], []
        for step in range(steps):
            before = model.weight.item()
            scaler.scale(model(torch.ones(1, 1)).sum()).backward()  # d/dw = 1: the update is -lr
            if step == overflow_at:
                model.weight.grad.fill_(math.inf)
            if monitor.attached:
                monitor.step(1000.0 if step == big_at else 1.0)
            wrapped.step()
            wrapped.zero_grad()
            used.append(before - model.weight.item())
            skipped.append(wrapped.step_was_skipped)
        return used, skipped

    used, skipped = train(6, big_at=2, overflow_at=4)
    # step 2 withheld; the 2 updates that run next at half the LR (the scaler's skip of the
    # step 4 overflow does not use one up)
    assert used == pytest.approx([1.0, 1.0, 0.0, 0.5, 0.0, 0.5])
    assert skipped == [False, False, True, False, True, False]
    assert scaler.get_scale() == 2.0
    assert monitor.steps == 6
    assert [e.rule for e in monitor.events if e.kind == "action"] == ["big", "big"]
    monitor.detach()
    assert wrapped._optimizer_original_step_method is saved[0]
    assert wrapped._optimizer_patched_step_method is saved[1]
    assert sgd.__dict__.get("step", saved[0]) is saved[0]
    assert train(2, big_at=0) == (pytest.approx([1.0, 1.0]), [False, False])

    del wrapped._optimizer_patched_step_method  # an Accelerate of another layout: said
    with caplog.at_level(logging.WARNING, logger="numwatch"):
        Monitor(model, **monitor_options(rules=rules)).attach(wrapped).detach()
    assert "skip_step, lr_backoff and qk_clip cannot act on its steps" in caplog.text


@pytest.mark.parametrize("pass_scaler", [False, True])
def test_actions_act_on_accelerates_steps_when_attached_to_the_optimizer_inside(
    pass_scaler, caplog
):
    """attach(accelerated.optimizer) under a GradScaler: Accelerate's steps call the step
    method it saved at prepare, so the wrapper installed on the optimizer never ran, and skip_step
    and lr_backoff did nothing, silently. The first of those steps puts ours where Accelerate's
    steps call (as attach(accelerated) does) and is closed and withheld itself; detach gives
    Accelerate back its own methods."""
    from numwatch import Monitor

    model, sgd, scaler, wrapped = _accelerated_sgd_with_scaler()
    saved = (wrapped._optimizer_original_step_method, wrapped._optimizer_patched_step_method)
    backoff = {"type": "lr_backoff", "factor": 0.5, "steps": 2, "min_interval_steps": 0}
    rule = {"type": "threshold", "name": "big", "metric": "loss", "threshold": 100.0}
    rules = {"defaults": False, "add": [{**rule, "actions": ["skip_step", backoff]}]}
    monitor = Monitor(model, **monitor_options(rules=rules, optimizer__every=1))
    monitor.attach(sgd, scaler=scaler if pass_scaler else None)

    absorbed = []  # the optimizer probe's: a withheld update is no update, not an absorbed one

    def train(steps, big_at=()):
        used = []
        for step in range(steps):
            before = model.weight.item()
            scaler.scale(model(torch.ones(1, 1)).sum()).backward()  # d/dw = 1: the update is -lr
            if monitor.attached:
                monitor.step(1000.0 if step in big_at else 1.0)
                absorbed.extend(
                    r.value for r in monitor.snapshot().series("optimizer_absorbed_fraction")
                )
            wrapped.step()
            wrapped.zero_grad()
            used.append(before - model.weight.item())
        return used

    with caplog.at_level(logging.WARNING, logger="numwatch"):
        used = train(6, big_at=(0, 3))
    assert used == pytest.approx([0.0, 0.5, 0.5, 0.0, 0.5, 0.5])
    assert absorbed == [0.0] * 3  # the updates of steps 1, 2 and 4, read at the next step close
    assert monitor.steps == 6
    assert [e.rule for e in monitor.events if e.kind == "action"] == ["big"] * 4
    assert "numwatch" not in caplog.text
    monitor.detach()
    assert wrapped._optimizer_original_step_method is saved[0]
    assert wrapped._optimizer_patched_step_method is saved[1]
    assert train(2, big_at=(0,)) == pytest.approx([1.0, 1.0])


def test_a_loop_without_monitor_step_closes_accelerates_steps_through_the_optimizer_inside():
    """attach(accelerated.optimizer) under a GradScaler: the monitor closes a step at each of
    Accelerate's updates, the first (which runs without the step wrapper) included."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate (test extra) not installed")
    from accelerate.optimizer import AcceleratedOptimizer

    from numwatch import Monitor

    accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    wrapped = AcceleratedOptimizer(sgd, scaler=scaler)
    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step"]}]}
    monitor = Monitor(model, **monitor_options(rules=rules)).attach(sgd)
    for x, y in batches(3):
        scaler.scale(F.cross_entropy(model(x).flatten(0, 1), y.flatten())).backward()
        wrapped.step()
        wrapped.zero_grad()
    assert monitor.steps == 3
    monitor.detach()


def _accelerated_sgd(accelerate, scaled: bool, model: nn.Module, lr: float = 1.0):
    """A real Accelerator's (model, optimizer, LR schedule halving at each step, inner SGD). On
    the CPU Accelerate makes no GradScaler: ``scaled`` plants one where fp16=True puts it, with
    a scale that does not overflow."""
    accelerator = accelerate.Accelerator(cpu=True)
    if scaled:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=10**6)
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    return (accelerator, *accelerator.prepare(model, sgd, schedule), sgd)


@pytest.mark.parametrize("attach", ["wrapper", "inner"])
@pytest.mark.parametrize("scaled", [False, True], ids=["no scaler", "scaler"])
def test_a_withheld_update_is_a_skipped_step_for_accelerate(scaled, attach):
    """A step skip_step withheld read as not skipped in AcceleratedOptimizer.step_was_skipped
    (it is only ever set for the GradScaler's own overflow skips), so AcceleratedScheduler and
    the Hugging Face Trainer advanced the LR schedule over it. It reads as skipped now, with or
    without a GradScaler, whichever of the two optimizers was attached; the next step clears
    it, and so does detach."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate (test extra) not installed")
    from numwatch import Monitor

    model = nn.Linear(1, 1, bias=False)
    accelerator, model, optimizer, schedule, sgd = _accelerated_sgd(accelerate, scaled, model)
    rule = {"type": "threshold", "name": "big", "metric": "loss", "threshold": 100.0}
    rules = {"defaults": False, "add": [{**rule, "actions": ["skip_step"]}]}
    monitor = Monitor(model, **monitor_options(rules=rules))
    monitor.attach(optimizer if attach == "wrapper" else sgd)
    used, skipped, lrs = [], [], []
    for step in range(5):
        before = model.weight.item()
        accelerator.backward(model(torch.ones(1, 1)).sum())  # d/dw = 1: the update is -lr
        monitor.step(1000.0 if step in (0, 2, 3) else 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        used.append(before - model.weight.item())
        skipped.append(accelerator.optimizer_step_was_skipped)
        lrs.append(schedule.get_last_lr()[0])
    assert used == pytest.approx([0.0, 1.0, 0.0, 0.0, 0.5])
    assert skipped == [True, False, True, True, False]
    assert lrs == [1.0, 0.5, 0.5, 0.5, 0.25]  # the schedule steps once per update
    accelerator.backward(model(torch.ones(1, 1)).sum())
    monitor.step(1000.0)
    optimizer.step()
    assert optimizer.step_was_skipped
    monitor.detach()
    # without a scaler nothing would ever clear it: detach does; with one, Accelerate's next step
    assert optimizer.step_was_skipped == scaled


def test_an_accelerate_whose_step_was_skipped_reads_otherwise_is_said_once(caplog, monkeypatch):
    """An accelerate whose step_was_skipped does not read the attributes numwatch sets: one
    warning that withheld updates read as not skipped there; skip_step still withholds them."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate (test extra) not installed")
    from accelerate.optimizer import AcceleratedOptimizer

    from numwatch import Monitor

    monkeypatch.setattr(AcceleratedOptimizer, "step_was_skipped", property(lambda self: False))
    model = nn.Linear(1, 1, bias=False)
    accelerator, model, optimizer, _, sgd = _accelerated_sgd(accelerate, False, model)
    rule = {"type": "threshold", "name": "always", "metric": "loss", "threshold": -1.0}
    rules = {"defaults": False, "add": [{**rule, "actions": ["skip_step"]}]}
    before = model.weight.item()
    with caplog.at_level(logging.WARNING, logger="numwatch"):
        monitor = Monitor(model, **monitor_options(rules=rules)).attach(sgd)
        for _ in range(2):
            accelerator.backward(model(torch.ones(1, 1)).sum())
            monitor.step(1.0)
            optimizer.step()
            optimizer.zero_grad()
        monitor.detach()
    assert model.weight.item() == before  # both updates withheld
    assert caplog.text.count("step_was_skipped in this accelerate version is not read") == 1


@pytest.mark.parametrize("attach", ["wrapper", "inner"])
@pytest.mark.parametrize("scaled", [False, True], ids=["no scaler", "scaler"])
def test_healthy_accelerate_steps_are_bitwise_those_without_numwatch(scaled, attach):
    """skip_step and lr_backoff armed under Accelerate but never firing: the weights, the LR
    schedule and step_was_skipped are bit for bit those of the run without numwatch."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate (test extra) not installed")
    from numwatch import Monitor

    def run(attach):
        torch.manual_seed(0)
        accelerator, model, optimizer, schedule, sgd = _accelerated_sgd(
            accelerate, scaled, TinyGPT(CFG), lr=0.1
        )
        rule = {"type": "threshold", "name": "huge", "metric": "loss", "threshold": 1e9}
        actions = ["skip_step", {"type": "lr_backoff", "factor": 0.5, "steps": 2}]
        rules = {"add": [{**rule, "actions": actions}]}
        monitor = Monitor(model, **monitor_options(rules=rules))
        if attach != "none":
            monitor.attach(optimizer if attach == "wrapper" else sgd)
        skipped = []
        for x, y in batches(4):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            skipped.append(optimizer.step_was_skipped)
        if monitor.attached:
            assert monitor.steps == 4 and not monitor.events
            monitor.detach()
        return [p.detach().clone() for p in model.parameters()], schedule.get_last_lr(), skipped

    weights, lrs, skipped = run(attach)
    expected_weights, expected_lrs, expected_skipped = run("none")
    assert all(torch.equal(a, b) for a, b in zip(weights, expected_weights, strict=True))
    assert lrs == expected_lrs == [0.1 * 0.5**4] and skipped == expected_skipped == [False] * 4


def test_hf_skip_step_acts_under_accelerates_grad_scaler(hf, tmp_path):
    """fp16: Accelerate's GradScaler steps dropped the monitor's step wrapper, so a skip_step
    decided for every step withheld none. On the CPU the scaler is planted where fp16=True puts
    it, with a scale that does not overflow."""
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    rule = {"type": "threshold", "name": "always", "metric": "loss", "threshold": -1.0}
    rules = {"defaults": False, "add": [{**rule, "actions": ["skip_step"]}]}
    callback = NumwatchTrainerCallback(**monitor_options(rules=rules))
    model = LMWrapper()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = hf_trainer(hf, tmp_path, model, [callback], steps=3)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.accelerator.scaler.get_scale() == 16.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert [e.rule for e in callback.monitor.events if e.kind == "action"] == ["always"] * 3


def test_hf_halt_in_the_step_of_a_skip_still_skips_it(hf, tmp_path):
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    rules = {"add": [{"type": "nonfinite", "name": "nonfinite", "actions": ["skip_step", "halt"]}]}
    callback = NumwatchTrainerCallback(**monitor_options(rules=rules))
    model = LMWrapper(nan_at=2)
    hf_trainer(hf, tmp_path, model, [callback], steps=6).train()
    assert callback.halt is not None
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_bad_stop_on_is_refused_when_the_callback_is_made():
    """A plain string was split into kinds ('n', 'o', ...), refused only at the start of
    training, with the model hooked and (HF) never unhooked."""
    from numwatch.errors import NumwatchConfigError
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    callback = NumwatchTrainerCallback(stop_on="nonfinite", **monitor_options())
    assert callback._driver.stop_on == ("nonfinite",)
    with pytest.raises(NumwatchConfigError, match="unknown event kind"):
        NumwatchTrainerCallback(stop_on=["nonfinit"], **monitor_options())


def test_hf_halt_becomes_should_training_stop(hf, tmp_path):
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    callback = NumwatchTrainerCallback(**monitor_options(rules=HALT_ON_ANY_LOSS))
    trainer = hf_trainer(hf, tmp_path, LMWrapper(), [callback], steps=6)
    trainer.train()
    assert trainer.state.global_step == 1
    assert callback.halt.report["rule"] == "loss_seen"


def test_hf_scaler_overflows_are_not_nonfinite_events(hf, tmp_path):
    """fp16: the callback unwrapped Accelerate's optimizer but dropped its GradScaler, so the
    scaler's overflow steps (skipped by design) were critical nonfinite events and stop_on
    stopped training at step 0. On the CPU Accelerate makes no scaler: one is planted where
    fp16=True puts it, and an overflow of the scaled gradients in each step (a scale of 2**127
    alone overflowed none: this model's gradients stay under 2)."""
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    class Overflow(hf.TrainerCallback):  # before the monitor's: it sees the step's gradients
        def on_pre_optimizer_step(self, args, state, control, **kw):
            trainer.model.model.head.weight.grad[0, 0] = float("inf")

    callback = NumwatchTrainerCallback(stop_on=["nonfinite"], **monitor_options())
    trainer = hf_trainer(hf, tmp_path, LMWrapper(), [Overflow(), callback], steps=3)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    trainer.train()
    assert trainer.state.global_step == 3 and callback.stop_reason is None
    events = [(e.kind, e.rule, e.severity) for e in callback.monitor.events]
    assert events == [("anomaly", "scaler_overflow", "info")] * 3
    assert trainer.accelerator.scaler.get_scale() == 2.0**124  # three overflows, three skips


def test_hf_resumed_training_goes_on_with_the_trainers_step_numbers(hf, tmp_path):
    """A train() resumed from a checkpoint started the monitor at step 0 again while the
    Trainer went on from the checkpoint's step: events and logs pointed at the wrong steps."""
    from numwatch.integrations.hf_trainer import NumwatchTrainerCallback

    def train(resume=None):
        callback = NumwatchTrainerCallback(**monitor_options())
        trainer = hf_trainer(hf, tmp_path, LMWrapper(), [callback], steps=6, save_strategy="steps",
                             save_steps=3)  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return callback.monitor, trainer.state.global_step

    monitor, global_step = train()
    assert (monitor.steps, global_step) == (6, 6)
    monitor, global_step = train(str(tmp_path / "checkpoint-3"))
    assert (monitor.steps, global_step) == (6, 6)
    assert monitor.snapshot().step == 5  # the Trainer's steps 4-6 are the monitor's 3-5


def test_lightning_resumed_fit_goes_on_with_the_trainers_step_numbers(pl, tmp_path):
    from numwatch.integrations.lightning import NumwatchCallback

    callback = NumwatchCallback(**monitor_options())
    trainer = lightning_trainer(pl, [callback], steps=3)
    trainer.fit(lightning_module(pl), loader(6))
    trainer.save_checkpoint(tmp_path / "three.ckpt")
    callback = NumwatchCallback(**monitor_options())
    trainer = lightning_trainer(pl, [callback], steps=6)
    trainer.fit(lightning_module(pl), loader(6), ckpt_path=tmp_path / "three.ckpt")
    assert (callback.monitor.steps, trainer.global_step) == (6, 6)
    assert callback.monitor.snapshot().step == 5


def test_lightning_resume_with_two_optimizers_numbers_batches(pl, tmp_path):
    """global_step counts both optimizers' steps: a resumed GAN fit went on from step 6 after
    3 batches (logged steps 0, 1, 2, 6, 7, 8)."""
    from numwatch.integrations.lightning import NumwatchCallback

    data = DataLoader(TensorDataset(torch.randn(40, 8)), batch_size=4)
    log = tmp_path / "log.jsonl"
    options = monitor_options(run_name="gan", sinks__jsonl__enabled=True,
                              sinks__jsonl__path=str(log))  # fmt: skip
    trainer = lightning_trainer(pl, [NumwatchCallback(**options)], steps=6)
    trainer.fit(two_optimizer_module(pl), data)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    trainer = lightning_trainer(pl, [NumwatchCallback(**options)], steps=12)
    trainer.fit(two_optimizer_module(pl), data, ckpt_path=tmp_path / "c.ckpt")
    assert [r["step"] for r in read_jsonl(log)] == list(range(6))


_HF_CRASH = """
import pathlib, sys
sys.path.insert(0, sys.argv[2])
import test_integrations as t
from numwatch.integrations.hf_trainer import NumwatchTrainerCallback
import transformers
model = t.LMWrapper()
calls = [0]
def crash(module, args, kwargs):
    calls[0] += 1
    if calls[0] == 6:
        raise RuntimeError("out of memory (simulated)")
model.register_forward_pre_hook(crash, with_kwargs=True)
options = t.monitor_options(flush_every=10, sinks__jsonl__enabled=True,
                            sinks__jsonl__path=sys.argv[1] + "/nw.jsonl")
callback = NumwatchTrainerCallback(**options)
t.hf_trainer(transformers, pathlib.Path(sys.argv[1]), model, [callback], steps=20).train()
"""


def test_hf_a_train_that_raises_still_writes_its_last_steps(hf, tmp_path):
    """The Trainer has no exception hook: a train() that raised left the monitor attached and
    the steps since its last flush unwritten (the steps just before a crash, the ones to read).
    The callback detaches at exit, which writes them."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _HF_CRASH, str(tmp_path), str(Path(__file__).parent)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode != 0 and "out of memory (simulated)" in run.stderr
    records = read_jsonl(tmp_path / "nw.jsonl")
    assert [r["step"] for r in records] == [4]  # steps 0-4 closed, no flush before the exit


def test_the_exit_detach_skips_a_distributed_run_even_after_destroy(monkeypatch):
    """It decided 'distributed' from an initialized process group at exit: after the usual
    destroy_process_group() it flushed rank-local shard values into the global log."""
    import weakref

    from numwatch.integrations import _driver

    for world, detached in ((2, False), (1, True)):
        monkeypatch.setattr(_driver, "get_world_size", lambda world=world: world)
        driver = _driver.MonitorDriver(monitor_options(), {}, ())
        driver.start(nn.Linear(2, 1), None)
        _driver._finish_at_exit(weakref.ref(driver))  # no process group now, as after destroy
        assert driver.monitor.attached is not detached
        driver.finish()
