"""Probe inputs the statistics kernels cannot read, or can read wrongly: sparse gradients and
outputs, dtypes that change between steps, outputs changed in place after their module."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from numwatch.kernels import tensor_stats as ts


def no_errors(monitor) -> bool:
    return not any(monitor.errors.values())


def min_max(snap, prefix: str, **labels) -> tuple[float, float]:
    return snap.value(f"{prefix}_min", **labels), snap.value(f"{prefix}_max", **labels)


def test_sparse_gradient_is_left_out_alone(make_monitor, caplog):
    """nn.Embedding(sparse=True)'s uncoalesced gradient is not measured (said once); the other
    parameters keep their statistics, the gradient norm and their update ratios."""
    model = nn.Sequential(nn.Embedding(4, 2, sparse=True), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0], [3.0, -1.0]]))
        model[1].weight.copy_(torch.tensor([[0.5, -2.0]]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = make_monitor(model, flush_every=1, optimizer__every=1).attach(opt)
    tokens = torch.tensor([1, 1, 3])  # row 1 twice: the sparse gradient repeats an index
    with caplog.at_level("WARNING", logger="numwatch"):
        model(tokens).sum().backward()  # 1.weight's gradient: [1, 2] + [1, 2] + [3, -1]
        assert model[0].weight.grad.layout == torch.sparse_coo
        monitor.step()
        snap = monitor.snapshot()
        opt.step()  # 1.weight: [0.5, -2] - 0.1 * [5, 3] = [0, -2.3]
        after = monitor.flush()
        opt.zero_grad()
        model(tokens).sum().backward()
        monitor.step()
    assert no_errors(monitor)
    assert snap.value("grad_norm") == math.sqrt(34.0)
    assert min_max(snap, "grad", param="1.weight") == (3.0, 5.0)
    assert snap.get("grad_numel", param="0.weight") is None
    want = 0.1 * math.sqrt(34.0) / 2.3
    assert after.value("optimizer_update_ratio", param="1.weight") == pytest.approx(want, rel=1e-6)
    assert after.get("optimizer_update_ratio", param="0.weight") is None
    warned = [r.getMessage() for r in caplog.records if "not measured" in r.getMessage()]
    assert len(warned) == 1 and "0.weight (torch.sparse_coo, torch.float32)" in warned[0]


class ToSparse(nn.Module):
    def forward(self, x):
        return x.to_sparse()


class SparseBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        self.sp = ToSparse()
        self.out = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -2.0]]))
            self.out.weight.copy_(torch.tensor([[1.0, 1.0]]))

    def forward(self, x):
        h = self.lin(x)
        self.sp(h)
        return self.out(h)


def test_sparse_module_output_is_left_out_alone_and_said_once(make_monitor, caplog):
    """A sparse output was left out silently, where complex ones and sparse gradients are
    warned about."""
    model = SparseBranch()
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    with caplog.at_level("WARNING", logger="numwatch"):
        for _ in range(2):
            model(torch.tensor([[1.0, 3.0]]))  # lin: [1, -6]; out: -5
            monitor.step()
    snap = monitor.snapshot()
    assert no_errors(monitor)
    assert min_max(snap, "activation", module="lin") == (-6.0, 1.0)
    assert snap.value("activation_min", module="out") == -5.0
    assert snap.get("activation_numel", module="sp") is None
    warned = [r.getMessage() for r in caplog.records if "not measured" in r.getMessage()]
    assert warned == [
        "numwatch: an output of module 'sp' is not measured (torch.sparse_coo Tensor of "
        "torch.float32); its activation_* statistics leave it out"
    ]


class NestedBranch(nn.Module):
    """A module that hands on a strided nested tensor (nn.TransformerEncoder's fast path does)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        self.nest = Nest()

    def forward(self, x):
        h = self.lin(x)
        return self.nest(h)


class Nest(nn.Module):
    def forward(self, h):
        return torch.nested.nested_tensor([h[0], h[1, :1]])


def test_nested_module_output_is_left_out_alone(make_monitor):
    model = NestedBranch()
    with torch.no_grad():
        model.lin.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -2.0]]))
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    out = model(torch.tensor([[1.0, 3.0], [2.0, 0.5]]))  # lin: [[1, -6], [2, -1]]
    assert out.is_nested
    monitor.step()
    snap = monitor.snapshot()
    assert no_errors(monitor)
    assert min_max(snap, "activation", module="lin") == (-6.0, 2.0)
    assert snap.get("activation_numel", module="nest") is None


class OddOutputs(nn.Module):
    """Beside a Linear, modules that hand on what the kernels cannot read: packed fp4 bytes, a
    complex spectrum, and a MaskedTensor (a __torch_dispatch__ subclass)."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        self.odd = OddOutput(kind)

    def forward(self, x):
        h = self.lin(x)
        self.odd(h)
        return h.sum()


class OddOutput(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, h):
        h = h.detach()
        if self.kind == "fp4":
            return h.to(torch.uint8).view(torch.float4_e2m1fn_x2)
        if self.kind == "complex":
            return torch.fft.rfft(h)
        from torch.masked import masked_tensor

        return (masked_tensor(h, h > 0), h)  # a measurable tensor beside it


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["fp4", "complex", "masked"])
def test_an_unreadable_output_is_left_out_alone_and_said_once(make_monitor, kind, caplog):
    if kind == "fp4" and not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("no float4_e2m1fn_x2 in this torch")
    model = OddOutputs(kind)
    with torch.no_grad():
        model.lin.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -2.0]]))
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    for _ in range(3):
        model(torch.tensor([[1.0, 3.0]])).backward()  # lin: [1, -6]
        monitor.step()
    snap = monitor.snapshot()
    assert no_errors(monitor)
    assert min_max(snap, "activation", module="lin") == (-6.0, 1.0)
    warned = [r for r in caplog.records if "module 'odd' is not measured" in r.getMessage()]
    assert len(warned) == 1
    if kind == "masked":  # the plain tensor beside it is still measured
        assert min_max(snap, "activation", module="odd") == (-6.0, 1.0)
    else:
        assert snap.get("activation_numel", module="odd") is None
    monitor.detach()


def test_an_unreadable_output_raises_in_strict_mode(make_monitor):
    model = OddOutputs("masked")
    monitor = make_monitor(model, flush_every=1, activations__every=1, strict=True).attach()
    with pytest.raises(TypeError), pytest.warns(UserWarning):
        model(torch.tensor([[1.0, 3.0]]))
    monitor.detach()


class Scaled(torch.Tensor):
    """A minimal __torch_dispatch__ wrapper (quantization-library style): mul and sum only."""

    @staticmethod
    def __new__(cls, data, scale):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)

    def __init__(self, data, scale):
        self.data_, self.scale = data, scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.sum.default:
            return (args[0].data_ * args[0].scale).sum()
        raise NotImplementedError(f"Scaled: {func}")


class Uncollectable(nn.Module):
    """Beside a Linear, a module whose output the collection cannot walk or detach."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(2, 2, bias=False)
        self.odd = nn.Identity()
        self.odd.register_forward_hook(lambda m, i, o: self.wrap(o))
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -2.0]]))

    def wrap(self, h):
        if self.kind == "subclass":
            return Scaled(h, 2.0)
        out = {"h": h}
        out["self"] = out  # a back reference: the walk never ends
        return out

    def forward(self, x):
        out = self.odd(self.lin(x))
        return out.sum() if self.kind == "subclass" else out["h"].sum()


@pytest.mark.parametrize("kind", ["subclass", "cyclic"])
def test_an_output_the_collection_fails_on_is_counted_not_raised(make_monitor, kind):
    """The activation hook collected outputs unguarded: an output it could not detach (a
    subclass without aten.detach) or walk (a structure holding itself: RecursionError) raised
    into the user's forward, with strict off."""
    model = Uncollectable(kind)
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    for _ in range(2):
        out = model(torch.tensor([[1.0, 3.0]]))  # lin: [1, -6]
        monitor.step()
    assert out.item() == (-10.0 if kind == "subclass" else -5.0)
    assert monitor.errors == {"activations": 2}
    assert min_max(monitor.snapshot(), "activation", module="lin") == (-6.0, 1.0)
    monitor.detach()
    strict = make_monitor(model, activations__every=1, strict=True).attach()
    with pytest.raises(NotImplementedError if kind == "subclass" else RecursionError):
        model(torch.tensor([[1.0, 3.0]]))
    strict.detach()


def test_per_sample_gradients_through_the_model_are_left_out_alone(make_monitor):
    """torch.func's vmap(grad(...)) over the monitored model (per-sample gradients): its
    batched tensors failed the activation statistics (vmap refuses a value read), an error
    counted and logged at every sampled step. The training forward is still measured."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = make_monitor(model, flush_every=2, activations__every=1).attach(opt)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p, x, y):
        return (functional_call(model, p, (x[None],)) - y).square().mean()

    for _ in range(2):
        x, y = torch.randn(5, 4), torch.randn(5, 1)
        vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, x, y)
        model(x).sub(y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert no_errors(monitor)
    assert monitor.history[-1].value("activation_numel", module="0") == 2 * 5 * 8


def test_a_meta_loss_is_not_recorded(make_monitor):
    """A dry run on the meta device: its loss has no value to read at flush."""
    with torch.device("meta"):
        model = nn.Linear(2, 1)
    monitor = make_monitor(model, flush_every=1).attach()
    loss = model(torch.ones(3, 2, device="meta")).sum()
    loss.backward()
    monitor.step(loss)
    assert no_errors(monitor)
    assert monitor.snapshot().step == 0
    assert monitor.snapshot().get("loss") is None


def test_activation_headroom_follows_autocast(make_monitor):
    """A first step in fp32, the next under fp16 autocast: the second window's headroom is the
    fp16 one, which the activation_overflow_risk rule reads."""
    model = nn.Sequential(nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    x = torch.tensor([[3000.0, 0.0]])
    model(x)
    monitor.step()
    fp32 = monitor.snapshot().value("activation_headroom", module="0")
    assert fp32 == 3000.0 / torch.finfo(torch.float32).max
    with torch.autocast("cpu", dtype=torch.float16):
        assert model(x).dtype == torch.float16
    monitor.step()
    assert monitor.snapshot().value("activation_headroom", module="0") == 3000.0 / 65504.0


def test_gradient_headroom_follows_model_half(make_monitor):
    model = nn.Linear(2, 1, bias=False)
    monitor = make_monitor(model, flush_every=1).attach()
    model.weight.grad = torch.tensor([[4.0, -8.0]])
    monitor.step()
    fp32 = monitor.snapshot().value("grad_headroom", param="weight")
    assert fp32 == 8.0 / torch.finfo(torch.float32).max
    model.half()
    model.weight.grad = torch.tensor([[4.0, -8.0]], dtype=torch.float16)
    monitor.step()
    assert monitor.snapshot().value("grad_headroom", param="weight") == 8.0 / 65504.0


def relu_after_linear() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[0].bias.zero_()
        model[2].weight.fill_(1.0)
    return model


X = torch.tensor([[-1.5, 2.0]])  # '0': [-1.5, 2]; the ReLU makes it [0, 2] in place; '2': 2


def assert_true_rows(snap) -> None:
    row = {k: snap.value(f"activation_{k}", module="0") for k in ("min", "max", "zeros")}
    assert row == {"min": -1.5, "max": 2.0, "zeros": 0.0}
    assert snap.value("activation_zeros", module="1") == 1.0
    assert snap.value("activation_max", module="2") == 2.0


def test_output_changed_in_place_is_never_measured_from_its_alias(make_monitor, monkeypatch):
    """The Linear's held output is what the in-place ReLU overwrote: dropped on the first
    forward, measured in the Linear's own hook from then on; the other modules stay batched."""
    model = relu_after_linear()
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    model(X)
    monitor.step()
    first = monitor.snapshot()
    assert first.get("activation_min", module="0") is None
    assert first.value("activation_zeros", module="1") == 1.0
    calls = []
    stats = ts.tensor_stats
    monkeypatch.setattr(
        ts, "tensor_stats", lambda tensors, *a: calls.append(len(tensors)) or stats(tensors, *a)
    )
    model(X)
    assert calls == [1, 2]  # '0' in its hook; '1' and '2' together when the forward returns
    monitor.step()
    assert_true_rows(monitor.snapshot())
    assert no_errors(monitor)


def test_inference_outputs_are_measured_in_their_hook(make_monitor):
    """Inference tensors have no version counter: measured before the ReLU can change them."""
    model = relu_after_linear()
    monitor = make_monitor(
        model, flush_every=1, activations__every=1, activations__training_only=False
    ).attach()
    with torch.inference_mode():
        model(X)
    monitor.step()
    assert_true_rows(monitor.snapshot())
    assert no_errors(monitor)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_a_no_grad_forward_in_train_mode_is_not_training(make_monitor, context):
    """Validation under no_grad with the model left in train mode was mixed into the step's
    activation and attention statistics (training_only looked at the mode alone)."""
    import torch.nn.functional as F

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            q = self.proj(x).view(1, 2, -1, 4)
            return F.scaled_dot_product_attention(q, q, q)

    model = Attn()
    monitor = make_monitor(
        model, flush_every=1, activations__every=1, attention__every=1, attention__batch=0
    ).attach()
    model(torch.randn(6, 8)).sum().backward()  # training: 6 rows of 8
    with context():
        model(torch.randn(10, 8))  # validation in train mode: not counted
    monitor.step()
    snap = monitor.snapshot()
    assert snap.value("activation_numel", module="proj") == 48
    assert snap.value("attn_calls", layer="") == 1


def test_a_submodule_kept_in_eval_mode_is_part_of_the_training_forward(make_monitor):
    """A backbone in eval mode (frozen BatchNorm statistics) inside a training forward was left
    out of the activation statistics, and a NaN it made was named after the next module."""
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)))
    model.append(nn.Linear(8, 1))
    model[0].eval()
    with torch.no_grad():
        model[0][2].weight[0, 0] = float("inf")
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    model(torch.randn(4, 4)).sum().backward()
    monitor.step()
    snap = monitor.snapshot()
    measured = {r.labels["module"] for r in snap.series("activation_numel")}
    assert measured == {"0", "0.0", "0.1", "0.2", "1"}
    (event,) = [e for e in monitor.events if e.kind == "nonfinite"]
    assert event.labels == {"module": "0.2"}
    model.eval()  # the whole model in eval mode, grad on: no training forward
    model(torch.randn(4, 4))
    monitor.step()
    assert monitor.snapshot().get("activation_numel", module="1") is None


def test_a_row_measured_only_by_other_ranks_has_records_without_a_dtype():
    """After cross-rank aggregation a table can hold a row this process never measured (a
    module that ran on another rank only): its records come out, headroom NaN, instead of a
    KeyError that cost every activation record of the flush."""
    from numwatch.probes.tensors import table_records

    merged = ts.tensor_stats_reference([torch.tensor([1.0, -2.0]), torch.tensor([4.0])])
    records = table_records(
        "activation", "module", [("a", None), ("b", None)], merged, {0: torch.float16}
    )
    absmax = {r.labels["module"]: r.value for r in records if r.name == "activation_absmax"}
    headroom = {r.labels["module"]: r.value for r in records if r.name == "activation_headroom"}
    assert absmax == {"a": 2.0, "b": 4.0}
    assert headroom["a"] == 2.0 / 65504.0 and math.isnan(headroom["b"])


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_each_output_once(make_monitor, reentrant):
    """The backward pass recomputes a checkpointed segment's forward: its outputs were counted
    a second time (numel and every count doubled)."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(checkpoint(self.body, x, use_reentrant=reentrant))

    torch.manual_seed(0)
    model = Net()
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    monitor.step()
    snap = monitor.snapshot()
    assert no_errors(monitor)
    for name in ("body.0", "body.1", "body.2"):
        assert snap.value("activation_numel", module=name) == 32
    relu = model.body[1](model.body[0](x))
    assert snap.value("activation_zeros", module="body.1") == (relu == 0).sum().item()


def test_a_forward_opened_by_hand_measures_its_reentrant_checkpoint_and_eval_submodules(
    make_monitor,
):
    """Training code that calls submodules (Lightning's training_step) inside begin_forward():
    reentrant checkpointing runs its blocks' first forward under no_grad, and they were taken
    for a validation forward and left out, as was a submodule kept in eval mode. A model forward
    under no_grad inside (a teacher's targets) is still validation, and the opened forward's
    decision applies again after it."""
    from torch.utils.checkpoint import checkpoint

    model = nn.Sequential(
        nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.BatchNorm1d(8).eval()
    )
    monitor = make_monitor(model, flush_every=1, activations__every=1).attach()
    x = torch.randn(4, 8)
    monitor.begin_forward()
    with torch.no_grad():
        model(x)  # not measured
    h = checkpoint(model[1], model[0](x), use_reentrant=True)
    model[2](h).sum().backward()  # the recompute in backward is not counted again
    monitor.end_forward()
    monitor.step()
    snap = monitor.snapshot()
    numel = {r.labels["module"]: r.value for r in snap.series("activation_numel")}
    assert numel == {"0": 32, "1": 32, "1.0": 32, "1.1": 32, "2": 32}
    assert no_errors(monitor)
    monitor.detach()


def test_a_failure_of_the_statistics_on_plain_tensors_leaves_nothing_out_for_good(
    make_monitor, monkeypatch
):
    """A transient failure (an OOM) of the fused call is counted; it must not mark plain fp32
    outputs unreadable, which would end the activation statistics of every module."""
    model = OddOutputs("complex")
    monitor = make_monitor(
        model, flush_every=1, activations__every=1, gradients__enabled=False
    ).attach()
    real = ts.tensor_stats
    calls = {"n": 0}

    def fail_first(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= 2:  # the fused call, then the first retry (tensor by tensor)
            raise RuntimeError("planted transient failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(ts, "tensor_stats", fail_first)
    for _ in range(2):
        model(torch.tensor([[1.0, 3.0]])).backward()
        monitor.step()
    snap = monitor.snapshot()
    errors = dict(monitor.errors)
    monitor.detach()
    assert calls["n"] > 2 and errors == {"activations": 1}  # counted once
    assert snap.get("activation_numel", module="lin") is not None
