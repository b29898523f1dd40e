"""The warp-specialized Gluon forward (kernels/flash_attention_gluon.py).

Gluon has no interpreter. On a CPU these tests compile the kernel to sm_90 code (Triton's
bundled ptxas), which catches what a Triton upgrade breaks in its API; on a Hopper GPU they run
it against the Triton forward and a float64 reference, and check which calls it serves.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from numwatch.kernels import flash_attention_gluon as fag
from numwatch.kernels import flash_attention_triton as tri
from numwatch.kernels.flash_attention import flash_attention
from numwatch.testing import planted_tie_attention

# the module (numwatch.kernels exports its function under the same name)
fa = importlib.import_module("numwatch.kernels.flash_attention")

needs_gluon = pytest.mark.skipif(not fag.AVAILABLE, reason="this Triton has no Gluon Hopper API")
needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs a Hopper GPU",
)


_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from numwatch.kernels import flash_attention_gluon as fag
stabilize, causal, persistent = (a == "1" for a in sys.argv[1:4])
d = int(sys.argv[4])
def desc(rows):
    layout = fag.gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], fag.gl.bfloat16)
    return f"tensordesc<bf16[1, 1, {rows}, {d}],{layout!r}>"
cfg = fag.DEFAULT_CONFIGS[d]
constants = {
    "SAT2": -0.0028, "STABILIZE": stabilize, "CAUSAL": causal, "PAIRED": causal and persistent,
    "PERSISTENT": persistent, "BLOCK_N": cfg.block_n, "HEAD_DIM": d,
    "NUM_STAGES": cfg.num_stages, "CONSUMER_REGS": cfg.consumer_regs,
    "PRODUCER_REGS": cfg.producer_regs,
}
signature = {
    "q_desc": desc(64), "k_desc": desc(cfg.block_n), "v_desc": desc(cfg.block_n),
    "o_desc": desc(64), "LSE": "*fp32", "H": "i32", "GROUP": "i32", "T_Q": "i32", "T_K": "i32",
    "n_units": "i32", "units_per_head": "i32", "qk_scale": "fp32", "beta_m1": "fp32",
    "dmin2": "fp32", "dmax2": "fp32", **dict.fromkeys(constants, "constexpr"),
}
src = GluonASTSource(fag._fwd_ws_kernel, signature, constants)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
assert kernel.asm["cubin"]
sys.stdout.write(kernel.asm["ptx"])
"""


@needs_gluon
@pytest.mark.parametrize(
    ("stabilize", "causal", "persistent", "d"),
    [
        (False, True, True, 128),
        (False, False, True, 128),
        (True, True, False, 128),
        (True, False, True, 128),
        (True, True, True, 64),
        (False, False, False, 64),
    ],
)
def test_compiles_to_sm90_code(stabilize, causal, persistent, d):
    """In a fresh process: the interpreter that the CPU tests run Triton kernels in patches
    triton.language's tensor operators, which a compile in the same process would then use."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    flags = [str(int(x)) for x in (stabilize, causal, persistent)] + [str(d)]
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, *flags], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = run.stdout
    # asynchronous wgmma, the register hand-over between partitions, TMA copies
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group" in ptx
    assert "setmaxnreg" in ptx
    assert "cp.async.bulk.tensor.4d" in ptx


def test_serves_head_dims_128_and_64_without_mask_in_plain_and_stabilized_modes():
    """Head dim 64 in the stabilized mode only from 8192 keys (shorter: the Triton forward)."""
    if not torch.cuda.is_available():
        meta = torch.empty(1, 1, 4, 128, device="meta", dtype=torch.bfloat16)
        assert not fag.supports(meta, meta, meta, None, 0, False)  # not on CUDA
        return
    q = torch.empty(1, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] == 9 and fag.AVAILABLE
    mask = torch.ones(1, 1, 8, 8, device="cuda", dtype=torch.bool)
    for causal in (False, True):
        assert fag.supports(q, q, q, None, 0, causal) == hopper
        assert fag.supports(q, q, q, None, 1, causal) == hopper
        assert not fag.supports(q, q, q, None, 2, causal)  # paper_repro: the Triton emulation
        assert not fag.supports(q, q, q, mask, 1, causal)
        assert not fag.supports(q.float(), q.float(), q.float(), None, 1, causal)
        assert not fag.supports(q[..., :32], q[..., :32], q[..., :32], None, 0, causal)
        q64 = q[..., :64]
        k64 = torch.empty(1, 2, 8192, 64, device="cuda", dtype=torch.bfloat16)
        assert fag.supports(q64, q64, q64, None, 0, causal) == hopper
        assert not fag.supports(q64, q64, q64, None, 1, causal)
        assert not fag.supports(q64, k64[:, :, 1:], k64[:, :, 1:], None, 1, causal)
        assert fag.supports(q64, k64, k64, None, 1, causal) == hopper


@pytest.mark.skipif(fa._tri is None, reason="triton is not installed")
def test_a_failing_gluon_forward_switches_to_the_triton_forward(monkeypatch):
    """Gluon is experimental: if its kernel fails (another Triton's API, a compile error), the
    call still returns the Triton forward's result, a warning says why once, and later calls
    go straight to Triton. Planted on whatever device runs the Triton kernels here."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not fa._tri.INTERPRET:
        pytest.skip("needs the Triton interpreter or a GPU")
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise AttributeError("module 'gluon' has no attribute 'thread_barrier'")

    monkeypatch.setattr(fag, "supports", lambda *args: fag.ENABLED)
    monkeypatch.setattr(fag, "gluon_forward", broken)
    monkeypatch.setattr(fag, "ENABLED", True)
    monkeypatch.setattr(fag, "DISABLED_BY", None)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).to(device, torch.bfloat16) for _ in range(3))
    want = fa._tri.triton_forward(q, k, v, None, True, 0.125, 1, 2.0)[0]
    with pytest.warns(RuntimeWarning, match="Gluon flash-attention forward failed"):
        got = flash_attention(q, k, v, is_causal=True)
    assert torch.equal(got, want)
    assert fag.DISABLED_BY.startswith("AttributeError") and not fag.ENABLED
    flash_attention(q, k, v, is_causal=True)  # no second attempt, no second warning
    assert calls == [1]


@needs_gluon
def test_fast_descriptors_equal_the_checked_constructor():
    """_desc fills the descriptor's fields in without the constructor's checks
    (launch.direct_constructor): the same fields, including those a later Triton adds (with
    their defaults)."""
    x = torch.empty(2, 3, 40, 128, dtype=torch.bfloat16)[:, :, 3:]  # an offset view
    fast = fag._desc(x, 64)
    checked = fag.TensorDescriptor(
        x, list(x.shape), list(x.stride()), [1, 1, 64, 128], fag._smem_layout(64, 128, x.dtype)
    )
    assert fag._make_desc is not fag.TensorDescriptor  # the fast path is the one in use
    for field in dataclasses.fields(fag.TensorDescriptor):
        a, b = getattr(fast, field.name), getattr(checked, field.name)
        assert a is b if field.name == "base" else a == b, field.name


def _inputs(b, h, hk, tq, tk, dtype, seed=0, ties=False, d=128):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g)
    k = torch.randn(b, hk, tk, d, generator=g)
    v = torch.randn(b, hk, tk, d, generator=g)
    if ties:  # two identical keys aligned with the queries: repeated row maxima above 0
        sink = q[:, :: h // hk].mean(2) * 3
        k[:, :, 3] = sink
        k[:, :, min(5, tk - 1)] = sink
    return (x.to("cuda", dtype) for x in (q, k, v))


def _oracle(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v, is_causal=causal)


def _both(monkeypatch, q, k, v, causal, mode):
    """Our output with the Gluon forward, and with the Triton forward, on the same call."""
    o_gluon = flash_attention(q, k, v, is_causal=causal, mode=mode, enable_gqa=True)
    monkeypatch.setattr(fag, "ENABLED", False)
    o_triton = flash_attention(q, k, v, is_causal=causal, mode=mode, enable_gqa=True)
    monkeypatch.setattr(fag, "ENABLED", True)
    return o_gluon, o_triton


SHAPES = [  # b, h, hk, tq, tk, causal: odd lengths, Tq != Tk both ways, GQA/MQA, one query
    (2, 4, 4, 1024, 1024, False),
    (2, 4, 2, 777, 777, True),
    (1, 3, 1, 300, 517, False),
    (1, 2, 2, 517, 300, True),
    (1, 2, 2, 1, 200, False),
    (1, 2, 1, 129, 129, True),
]


def _serve_every_length(monkeypatch):
    """Head dim 64's stabilized calls through the Gluon forward at any length (tests)."""
    monkeypatch.setitem(
        fag.DEFAULT_CONFIGS, 64, fag.DEFAULT_CONFIGS[64]._replace(stabilized_min_t_k=0)
    )


@needs_hopper
@needs_gluon
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("mode", ["plain", "stabilized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_the_triton_forward_and_fp64(monkeypatch, shape, dtype, mode, d):
    b, h, hk, tq, tk, causal = shape
    _serve_every_length(monkeypatch)
    q, k, v = _inputs(b, h, hk, tq, tk, dtype, ties=mode == "stabilized" and tk > 5, d=d)
    calls = []
    monkeypatch.setattr(fag, "gluon_forward", _spy(fag.gluon_forward, calls))
    o_gluon, o_triton = _both(monkeypatch, q, k, v, causal, mode)
    assert len(calls) == 1  # the first call ran the Gluon kernel, the second did not
    o64 = _oracle(q, k, v, causal)
    err_gluon = (o_gluon.double() - o64).abs().max().item()
    err_triton = (o_triton.double() - o64).abs().max().item()
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert err_gluon <= err_triton + ulp * o64.abs().max().item(), (err_gluon, err_triton)
    # Different key-block sizes (128 here, 64 in the Triton tiles) round differently:
    # at most a few units in the last place apart.
    assert (o_gluon.float() - o_triton.float()).abs().max().item() <= 8 * ulp * max(
        1.0, o64.abs().max().item()
    )


def _spy(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(args[0].shape)
        return fn(*args, **kwargs)

    return wrapped


@needs_hopper
@needs_gluon
def test_same_key_blocks_give_bitwise_the_triton_forward(monkeypatch):
    """With the Triton forward's D128 key block (64) the two kernels add the same products in
    the same order: bitwise equal outputs and LSEs, both modes, causal or not."""
    monkeypatch.setitem(fag.DEFAULT_CONFIGS, 128, fag.GluonConfig(64, 2))
    q, k, v = _inputs(1, 4, 2, 1000, 1000, torch.bfloat16, ties=True)
    for causal in (False, True):
        for mode in (0, 1):
            cfg = tri.tile_config("fwd_stab" if mode else "fwd", 128, causal)
            assert cfg.block_n == 64 and cfg.rowsum_mma
            o_g, lse_g = fag.gluon_forward(q, k, v, causal, 128**-0.5, mode, 2.0)
            o_t, lse_t = tri.triton_forward(q, k, v, None, causal, 128**-0.5, mode, 2.0)
            assert torch.equal(o_g, o_t) and torch.equal(lse_g, lse_t), (causal, mode)


@needs_hopper
@needs_gluon
@pytest.mark.parametrize(("programs", "d"), [(None, 128), (3, 128), (3, 64)])
def test_persistent_programs_give_bitwise_one_program_per_row_block(monkeypatch, programs, d):
    """Persistent programs (causal ones pairing a long row block with a short one) compute
    every row block as a program of its own does. With 3 programs, each loops over dozens of
    units: the ring's slots, the turns and the Q buffers carry their phases across them."""
    if programs is not None:
        monkeypatch.setattr(fag, "_sm_count", lambda device: programs)
    # 8 and 9 row blocks (an odd count leaves a causal unit of one row block), GQA, T_q != T_k
    for b, h, hk, tq, tk in [(2, 4, 2, 1000, 1000), (1, 3, 1, 1100, 1100), (1, 2, 2, 1100, 700)]:
        q, k, v = _inputs(b, h, hk, tq, tk, torch.bfloat16, ties=True, d=d)
        for causal in (False, True):
            for mode in (0, 1):
                outs = []
                for persistent in (False, True):
                    cfg = fag.DEFAULT_CONFIGS[d]._replace(
                        persistent_max_t_k=tk if persistent else 0
                    )
                    monkeypatch.setitem(fag.CONFIG_OVERRIDES, (d, causal), cfg)
                    outs.append(fag.gluon_forward(q, k, v, causal, d**-0.5, mode, 2.0))
                (o_one, lse_one), (o_per, lse_per) = outs
                assert torch.equal(o_one, o_per) and torch.equal(lse_one, lse_per), (
                    (b, h, hk, tq, tk),
                    causal,
                    mode,
                )


@needs_hopper
@needs_gluon
def test_relaunched_calls_are_bitwise_the_first():
    """From a key's second call on, the launch goes straight into the compiled launcher
    (launch.Relauncher), with the same results bit for bit; another layout of the same values
    makes another key and the same results."""
    q, k, v = _inputs(1, 4, 2, 333, 333, torch.bfloat16, ties=True)
    first = fag.gluon_forward(q, k, v, True, 128**-0.5, 1, 2.0)
    before = fag._launch.direct_launches
    second = fag.gluon_forward(q, k, v, True, 128**-0.5, 1, 2.0)
    assert fag._launch.direct_launches == before + 1
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, T, H, D) memory
    keys = len(fag._launch._compiled)
    third = fag.gluon_forward(q_t, k, v, True, 128**-0.5, 1, 2.0)
    assert len(fag._launch._compiled) == keys + 1
    for a, b, c in zip(first, second, third, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@needs_hopper
@needs_gluon
def test_stabilized_bias_on_planted_ties_like_the_triton_kernel(monkeypatch):
    """DESIGN.md's planted ties at head dim 128: the Gluon forward's bias ratio is the Triton
    forward's (the same arithmetic), far from the paper kernel's strongly negative one."""
    q, k, v = (x.cuda() for x in planted_tie_attention(2, 14.0, torch.bfloat16, 4, 8, 1024, 128))
    o64 = _oracle(q, k, v, True)

    def bias(o):
        err = o.double() - o64
        return (err.mean() / err.abs().mean()).item()

    o_gluon, o_triton = _both(monkeypatch, q, k, v, True, "stabilized")
    paper = flash_attention(q, k, v, is_causal=True, mode="paper_repro")
    assert abs(bias(o_gluon) - bias(o_triton)) <= 0.05, (bias(o_gluon), bias(o_triton))
    assert bias(paper) < -0.5 < bias(o_gluon)


@needs_hopper
@needs_gluon
@pytest.mark.parametrize("d", [128, 64])
def test_gradients_flow_through_the_gluon_forward(monkeypatch, d):
    """The backward (Triton) takes the Gluon forward's O and LSE: gradients match float64."""
    _serve_every_length(monkeypatch)
    calls = []
    monkeypatch.setattr(fag, "gluon_forward", _spy(fag.gluon_forward, calls))
    q, k, v = (x.requires_grad_() for x in _inputs(1, 4, 2, 600, 600, torch.bfloat16, d=d))
    do = torch.randn_like(q)
    flash_attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)
    assert len(calls) == 1  # the default mode (stabilized) ran the Gluon forward
    grads = [x.grad.double() for x in (q, k, v)]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    _oracle(q64, k64, v64, True).backward(do.double())
    for g, x in zip(grads, (q64, k64, v64), strict=True):
        assert (g - x.grad).norm() / x.grad.norm() < 2e-2
