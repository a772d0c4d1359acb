"""Argument checks: integer arguments, direct torch.ops.lutb calls, autograd, LutbConfig's fitter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lutb


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(0)
    w13 = lutb.quantize((torch.randn(4, 128, 64, generator=g) * 0.05).to(torch.bfloat16))
    w2 = lutb.quantize((torch.randn(4, 64, 64, generator=g) * 0.05).to(torch.bfloat16))
    return w13, w2


# 1. integer arguments ----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, exc", [
    ({"threads": 10**6}, ValueError),
    ({"threads": 4097}, ValueError),
    ({"threads": -1}, ValueError),
    ({"threads": "4"}, TypeError),
    ({"threads": 2.0}, TypeError),
    ({"threads": True}, TypeError),
    ({"forced_scale": "7"}, TypeError),
    ({"forced_scale": 7.5}, TypeError),
    ({"forced_scale": False}, TypeError),
    ({"forced_scale": 300}, ValueError),
    ({"name": 3}, TypeError),
])
def test_quantize_integer_arguments(kw, exc):
    arg = next(iter(kw))
    with pytest.raises(exc, match=f"^{arg}: "):
        lutb.quantize(torch.randn(8, 64), **kw)


def test_quantize_accepts_numpy_integers():
    a = lutb.quantize(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)), threads=np.int64(4096),
                      forced_scale=np.int32(120))
    assert int(a.scale[0, 0]) == 120
    lutb.quantize(torch.randn(8, 64), threads=np.int32(1))


@pytest.mark.parametrize("kw, exc", [
    ({"k": "2"}, TypeError), ({"k": 2.0}, TypeError), ({"k": True}, TypeError),
    ({"n_group": "2"}, TypeError), ({"n_group": 2.0}, TypeError),
    ({"topk_group": "1"}, TypeError), ({"topk_group": 1.0}, TypeError),
])
def test_router_integer_arguments(kw, exc):
    args = {"k": 2, "n_group": 2, "topk_group": 1} | kw
    arg = next(iter(kw))
    with pytest.raises(exc, match=f"^{arg}: "):
        lutb.route_deepseek(torch.randn(3, 8), None, **args)
    if arg == "k":
        with pytest.raises(exc, match="^k: "):
            lutb.route_softmax_topk(torch.randn(3, 8), kw["k"])


def test_router_accepts_numpy_integers():
    ids, _ = lutb.route_softmax_topk(torch.randn(3, 8), np.int64(2))
    assert ids.shape == (3, 2)
    ids, _ = lutb.route_deepseek(torch.randn(3, 8), None, np.int32(2), np.int64(2), np.int64(1))
    assert ids.shape == (3, 2)


@pytest.mark.parametrize("renormalize", ["False", "no", None, 0, 1.0])
def test_router_renormalize_is_a_bool(renormalize):
    # bool("False") is True: a string or a number would renormalise, or not, silently.
    with pytest.raises(TypeError, match="^renormalize: expected a bool"):
        lutb.route_softmax_topk(torch.randn(3, 8), 2, renormalize)
    with pytest.raises(TypeError, match="^renormalize: expected a bool"):
        lutb.route_deepseek(torch.randn(3, 8), None, 2, 2, 1, renormalize)


def test_router_renormalize_accepts_numpy_bool():
    lg = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    for flag in (True, False):
        ref = lutb.route_softmax_topk(lg, 2, flag)
        got = lutb.route_softmax_topk(lg, 2, np.bool_(flag))
        assert torch.equal(ref[1], got[1])
    assert not torch.allclose(lutb.route_softmax_topk(lg, 2, False)[1].sum(1), torch.ones(3))


# 2. torch.ops.lutb called directly --------------------------------------------------------------
def _args(layer, x, ids, wts):
    w13, w2 = layer
    return (x, ids, wts, w13.packed, w13.codebook, w13.scale, w2.packed, w2.codebook, w2.scale, 64, "mxfp8", False)


def test_ops_moe_experts_checks(layer):
    x = torch.randn(64, 3).to(torch.bfloat16).t()
    ids = torch.zeros(3, 2, dtype=torch.int32)
    wts = torch.ones(3, 2)
    with pytest.raises(ValueError, match="^x: must be contiguous"):
        torch.ops.lutb.moe_experts(*_args(layer, x, ids, wts))
    x = x.contiguous()
    with pytest.raises(ValueError, match="^topk_ids: must be contiguous"):
        torch.ops.lutb.moe_experts(*_args(layer, x, torch.zeros(2, 3, dtype=torch.int32).t(), wts))
    with pytest.raises(TypeError, match="^x: dtype float32"):
        torch.ops.lutb.moe_experts(*_args(layer, x.float(), ids, wts))
    with pytest.raises(TypeError, match="^topk_ids: "):
        torch.ops.lutb.moe_experts(*_args(layer, x, ids.float(), wts))
    a = list(_args(layer, x, ids, wts))
    a[3] = a[3].float()
    with pytest.raises(TypeError, match="^w13_packed: dtype float32"):
        torch.ops.lutb.moe_experts(*a)
    a = list(_args(layer, x, ids, wts))
    a[6] = a[6][:, :4].contiguous()
    with pytest.raises(ValueError, match="^w2_packed: shape"):
        torch.ops.lutb.moe_experts(*a)
    a = list(_args(layer, x, ids, wts))
    a[9] = 32
    with pytest.raises(ValueError, match="^w13_packed: shape"):
        torch.ops.lutb.moe_experts(*a)
    a = list(_args(layer, x, ids, wts))
    a[10] = "fp4"
    with pytest.raises(ValueError, match="^act_format: "):
        torch.ops.lutb.moe_experts(*a)
    # the same values as lutb.moe_experts with bf16 weights widened exactly
    y = torch.ops.lutb.moe_experts(*_args(layer, x, ids, wts.to(torch.bfloat16)))
    assert torch.equal(y, lutb.moe_experts(x, ids, wts, *layer))


def test_ops_quantize_checks():
    w = torch.randn(64, 8).t()
    with pytest.raises(ValueError, match="^w: must be contiguous"):
        torch.ops.lutb.quantize(w, "binned-dp", -1, 0, "w")
    with pytest.raises(TypeError, match="^w: dtype int32"):
        torch.ops.lutb.quantize(torch.zeros(8, 64, dtype=torch.int32), "binned-dp", -1, 0, "w")
    with pytest.raises(ValueError, match="^threads: "):
        torch.ops.lutb.quantize(w.contiguous(), "binned-dp", -1, 10**6, "w")
    with pytest.raises(ValueError, match="^forced_scale: "):
        torch.ops.lutb.quantize(w.contiguous(), "binned-dp", 1, 0, "w")
    with pytest.raises(ValueError, match="fitter"):
        torch.ops.lutb.quantize(w.contiguous(), "nope", -1, 0, "w")


def test_ops_dequantize_checks():
    a = lutb.quantize(torch.randn(16, 128))
    with pytest.raises(TypeError, match="^packed: dtype float32"):
        torch.ops.lutb.dequantize(a.packed.float(), a.codebook, a.scale, [16, 128])
    with pytest.raises(ValueError, match="^packed: shape"):
        torch.ops.lutb.dequantize(a.packed, a.codebook, a.scale, [32, 128])
    with pytest.raises(ValueError, match="^scale: must be contiguous"):
        torch.ops.lutb.dequantize(a.packed, a.codebook, a.scale.t().contiguous().t(), [16, 128])


def test_ops_mxfp8_qdq_checks():
    x = torch.randn(64, 3).t()
    with pytest.raises(ValueError, match="^x: must be contiguous"):
        torch.ops.lutb.mxfp8_qdq(x, "rceil")
    with pytest.raises(TypeError, match="^x: dtype int32"):
        torch.ops.lutb.mxfp8_qdq(torch.ones(2, 32, dtype=torch.int32), "rceil")
    with pytest.raises(ValueError, match="^rule: "):
        torch.ops.lutb.mxfp8_qdq(x.contiguous(), "up")


def test_ops_routers_check_and_widen():
    lg = torch.randn(5, 8)
    ref = lutb.route_softmax_topk(lg.to(torch.bfloat16), 2)
    got = torch.ops.lutb.route_softmax_topk(lg.to(torch.bfloat16), 2, True)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    with pytest.raises(ValueError, match="^logits: must be contiguous"):
        torch.ops.lutb.route_softmax_topk(torch.randn(8, 5).t(), 2, True)
    with pytest.raises(ValueError, match="^k: "):
        torch.ops.lutb.route_softmax_topk(lg, 9, True)
    with pytest.raises(TypeError, match="^logits: dtype int32"):
        torch.ops.lutb.route_softmax_topk(torch.ones(5, 8, dtype=torch.int32), 2, True)
    with pytest.raises(ValueError, match="^n_group: "):
        torch.ops.lutb.route_deepseek(lg, None, 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="^correction_bias: shape"):
        torch.ops.lutb.route_deepseek(lg, torch.zeros(7), 2, 2, 1, True, 1.0)
    ref = lutb.route_deepseek(lg.half(), torch.randn(8).half(), 2, 2, 1)
    assert ref[0].shape == (5, 2)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["int32", "uint8", "bool", "complex64", "other library"])
def test_dequantize_dtype_is_a_float_dtype_of_the_same_library(kind, dtype):
    # int32 truncated the weights and uint8 wrapped -4 to 252 without a word.
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 3).numpy()
    a = lutb.quantize(torch.from_numpy(w) if kind == "torch" else w)
    lib = torch if kind == "torch" else np
    d = (np.float32 if kind == "torch" else torch.float32) if dtype == "other library" else getattr(lib, dtype)
    with pytest.raises(TypeError, match="^dtype: "):
        a.dequantize(d)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_dequantize_float_dtypes(kind):
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 3).numpy()
    a = lutb.quantize(torch.from_numpy(w) if kind == "torch" else w)
    ref = np.asarray(a.dequantize(torch.float32 if kind == "torch" else np.float32), dtype=np.float64)
    dtypes = ((torch.float16, torch.float64, torch.bfloat16) if kind == "torch"
              else (np.float16, np.float64, "float64"))
    for d in dtypes:
        got = a.dequantize(d)
        assert got.dtype == (d if kind == "torch" else np.dtype(d))
        got = got.float().numpy() if kind == "torch" else got
        # LUT-B values (E4M3 times a power of two) are exact in FP16 here (|w| < 2^15, exponents >= -14)
        assert np.array_equal(np.asarray(got, dtype=np.float64), ref)


# 3. autograd ----------------------------------------------------------------------------------
def test_moe_experts_backward_raises(layer):
    x = torch.randn(3, 64).to(torch.bfloat16).requires_grad_()
    ids = torch.zeros(3, 2, dtype=torch.int32)
    y = lutb.moe_experts(x, ids, torch.ones(3, 2), *layer)
    with pytest.raises(RuntimeError, match="moe_experts: no backward"):
        y.float().sum().backward()


# 4f. LutbConfig's fitter -----------------------------------------------------------------------
def test_lutb_config_rejects_unknown_fitter():
    hf = pytest.importorskip("lutb.hf")
    with pytest.raises(ValueError, match="fitter.*'nope'.*binned-dp"):
        hf.LutbConfig(fitter="nope")
    assert hf.LutbConfig(fitter="optimal").fitter == "optimal"
