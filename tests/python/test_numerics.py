"""mxfp8_qdq, routing and moe_experts on the CPU against independent references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lutb
from lutb import _impl


def edge_values(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 128, (n,), generator=g).float())
    x[::97] = 0.0
    x[5] = float("nan")
    x[40] = float("inf")
    x[70] = 448.0 * 2.0 ** -130
    x[100:132] = 0.0
    return x.reshape(-1, 64)


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp8_torch_path_equals_the_library(rule):
    """The torch-operation MXFP8 (used on CUDA) against the C++ one, bit for bit, on edge values."""
    for x in (edge_values(), torch.randn(7, 45) * 3, torch.randn(3, 33).to(torch.bfloat16)):
        a = lutb.mxfp8_qdq(x, rule)
        b = _impl.mxfp8_qdq_torch(x, rule)
        assert a.dtype == torch.float32 and a.shape == x.shape
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def softmax_topk_reference(logits: np.ndarray, k: int, renormalize: bool):
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return ids, w


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_softmax_topk(renormalize):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(33, 16, generator=g)
    ids, w = lutb.route_softmax_topk(logits, 4, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    rid, rw = softmax_topk_reference(logits.double().numpy(), 4, renormalize)
    np.testing.assert_array_equal(ids.numpy(), rid)
    np.testing.assert_allclose(w.numpy(), rw, rtol=1e-6)
    nid, nw = lutb.route_softmax_topk(logits.numpy(), 4, renormalize)
    np.testing.assert_array_equal(nid, ids.numpy())
    np.testing.assert_array_equal(nw, w.numpy())


def silu(g):
    return g / (1.0 + torch.exp(-g))


def moe_reference(x, ids, wts, w13: lutb.LutbWeight, w2: lutb.LutbWeight, act_format="mxfp8"):
    """Spec 4 steps 2-6 in float64 from the dequantised weights (exact) and the torch MXFP8 path."""
    qdq = (lambda v: _impl.mxfp8_qdq_torch(v, "rceil").double()) if act_format == "mxfp8" else (lambda v: v.double())
    d13 = w13.dequantize(torch.float32).double()
    d2 = w2.dequantize(torch.float32).double()
    e, two_i, _ = w13.shape
    i = two_i // 2
    a = qdq(x.float())
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ex = int(ids[t, j])
            if ex >= e:
                continue
            gu = d13[ex] @ a[t]
            h = (silu(gu[:i]) * gu[i:]).to(torch.float32).to(torch.bfloat16)
            h = qdq(h.float().unsqueeze(0))[0]
            out[t] += float(wts[t, j]) * (d2[ex] @ h)
    return out


def normalised_error(got, ref):
    return float(torch.linalg.norm(got.double() - ref) / torch.linalg.norm(ref))


def layer(e=6, h=192, i=128, seed=2):
    g = torch.Generator().manual_seed(seed)
    w13 = lutb.quantize((torch.randn(e, 2 * i, h, generator=g) * 0.05).to(torch.bfloat16))
    w2 = lutb.quantize((torch.randn(e, h, i, generator=g) * 0.05).to(torch.bfloat16))
    return w13, w2


def routing(t, k, e, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    return ids, wts


def close_to_reference(out, ref) -> bool:
    """out (BF16) against the float64 reference rounded once to BF16 (step 6).

    The kernels sum in FP32, the reference in float64 (relative difference ~1e-7). That difference
    flips a BF16 rounding of h (step 4, 2^-8 relative) or an E4M3 rounding of its MXFP8 copy (2^-3
    relative) on a few elements of h, and through them a few outputs by an ulp or so: measured, the
    outputs are bit-equal at T = 1 and 5, and 1.5 % of them differ at T = 40 (normalised error 7e-4).
    Bounds: normalised error < 2e-3 and >= 95 % bit-equal; a wrong tile, index, scale or routing
    gives errors of order 1.
    """
    rb = ref.float().to(torch.bfloat16)
    equal = float((out == rb).float().mean())
    return normalised_error(out, rb.double()) < 2e-3 and equal >= 0.95


@pytest.mark.parametrize("act_format", ["mxfp8", "bf16"])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_moe_experts_against_float64_reference(act_format, t):
    w13, w2 = layer()
    ids, wts = routing(t, 2, 6)
    x = (torch.randn(t, 192, generator=torch.Generator().manual_seed(t)) * 2).to(torch.bfloat16)
    out = lutb.moe_experts(x, ids, wts, w13, w2, act_format=act_format)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    ref = moe_reference(x, ids, wts, w13, w2, act_format)
    assert close_to_reference(out, ref)


def test_moe_experts_expert_parallel_marker_and_id_dtypes():
    w13, w2 = layer()
    ids, wts = routing(9, 3, 6)
    ids[::2, 1] = 6        # transformers' marker for experts of other ranks (num_local_experts)
    ids[1, 0] = 1000       # any id >= E contributes nothing
    x = torch.randn(9, 192).to(torch.bfloat16)
    out64 = lutb.moe_experts(x, ids, wts, w13, w2)
    out32 = lutb.moe_experts(x, ids.to(torch.int32), wts, w13, w2)
    assert torch.equal(out64, out32)
    ref = moe_reference(x, ids, wts, w13, w2)
    assert close_to_reference(out64, ref)
    # The marker slot is the same as a slot of weight 0 on a real expert.
    ids0 = torch.where(ids >= 6, torch.zeros_like(ids), ids)
    wts0 = torch.where(ids >= 6, torch.zeros_like(wts), wts)
    assert torch.equal(lutb.moe_experts(x, ids0, wts0, w13, w2), out64)


def test_moe_experts_out_argument_and_bf16_weights():
    w13, w2 = layer()
    ids, wts = routing(4, 2, 6)
    x = torch.randn(4, 192).to(torch.bfloat16)
    out = torch.full((4, 192), 7.0, dtype=torch.bfloat16)
    r = lutb.moe_experts(x, ids, wts.to(torch.bfloat16), w13, w2, out=out)
    assert r is out
    assert torch.equal(out, lutb.moe_experts(x, ids, wts.to(torch.bfloat16).float(), w13, w2))


def test_moe_experts_float32_out_is_the_sum_before_rounding():
    """out=float32 holds step 6's FP32 sum: rounded once it is the BF16 result, and with top-1 and
    weight 1 it is the expert output y itself, so weighted slot-order sums of those rebuild it."""
    w13, w2 = layer()
    ids, wts = routing(7, 3, 6)
    ids[2, 1] = 6  # marker
    x = torch.randn(7, 192, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    f = torch.full((7, 192), 7.0)
    assert lutb.moe_experts(x, ids, wts, w13, w2, out=f) is f
    assert torch.equal(f.to(torch.bfloat16), lutb.moe_experts(x, ids, wts, w13, w2))
    acc = torch.zeros(7, 192)
    for j in range(3):
        y = torch.empty(7, 192)
        lutb.moe_experts(x, ids[:, j:j + 1].contiguous(), torch.ones(7, 1), w13, w2, out=y)
        acc = acc + y * wts[:, j:j + 1]
    assert torch.equal(acc, f)


def test_moe_experts_no_tokens():
    w13, w2 = layer()
    x = torch.empty(0, 192, dtype=torch.bfloat16)
    out = lutb.moe_experts(x, torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2), w13, w2)
    assert out.shape == (0, 192)


def test_inputs_that_require_grad():
    """Tensors that require grad (a training-mode caller) are read through detached views."""
    w13, w2 = layer()
    ids, wts = routing(3, 2, 6)
    x = torch.randn(3, 192).to(torch.bfloat16)
    want = lutb.moe_experts(x, ids, wts, w13, w2)
    got = lutb.moe_experts(x.clone().requires_grad_(), ids, wts.clone().requires_grad_(), w13, w2)
    assert torch.equal(got, want)
    logits = torch.randn(3, 6, requires_grad=True)
    assert torch.equal(lutb.route_softmax_topk(logits, 2)[0], lutb.route_softmax_topk(logits.detach(), 2)[0])
