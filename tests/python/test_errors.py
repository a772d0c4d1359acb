"""Bad input raises TypeError / ValueError naming the argument and the reason, never a crash."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("w, exc, words", [
    ([[1.0]], TypeError, "w: expected a torch.Tensor or numpy.ndarray"),
    (torch.zeros(8, 64, dtype=torch.int32), TypeError, "w: dtype int32"),
    (torch.zeros(64), ValueError, "w.shape"),
    (torch.zeros(0, 64), ValueError, "w.shape"),
    (torch.zeros(64, 16).t(), ValueError, "w: must be contiguous"),
])
def test_quantize_bad_arrays(w, exc, words):
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(".", r"\.")):
        lutb.quantize(w)


def test_quantize_nan_names_the_tile():
    w = torch.zeros(2, 16, 128)
    w[1, 9, 70] = float("nan")
    with pytest.raises(ValueError, match=r"quantize: tensor w, expert 1, tile \(1, 1\): NaN at row 9 col 70"):
        lutb.quantize(w)
    w[1, 9, 70] = 3.3e38
    with pytest.raises(ValueError, match=r"tile \(1, 1\): magnitude 3.3e\+38 needs a scale byte above 246"):
        lutb.quantize(w, name="experts.down_proj")


def test_gpu_fit_error_message_words_the_magnitude_as_the_cpu():
    # The CUDA fitter reports a failing tile by code; lutb words it in Python from the tensor (code 4:
    # the magnitude needs a scale byte above 246). Its text must be the CPU fitter's, shortest decimal
    # included ("3.3e+38", not the double 3.299999965482712e+38).
    from lutb import _impl

    w = torch.zeros(2, 16, 128)
    w[1, 9, 70] = 3.3e38
    with pytest.raises(ValueError) as cpu:
        lutb.quantize(w)
    tn, tk = 2, 2
    tile = 1 * tn * tk + 1 * tk + 1  # expert 1, tile (1, 1)
    assert "quantize: " + _impl._fit_error_message(w, "w", 4, tile, 0, tn, tk) == str(cpu.value)


def test_quantize_bad_options():
    w = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="fitter"):
        lutb.quantize(w, "k-means")
    with pytest.raises(ValueError, match="forced_scale: 250"):
        lutb.quantize(w, forced_scale=250)
    with pytest.raises(ValueError, match="forced_scale"):
        lutb.quantize(w, "ct-lloyd", forced_scale=120)


def test_from_tensors_validation(layer):
    w13, _ = layer
    p, c, s = w13.packed, w13.codebook, w13.scale
    with pytest.raises(ValueError, match=r"P\.weight_packed: shape .* does not match"):
        lutb.LutbWeight.from_tensors(p[:, :3], c, s, w13.shape, name="P")
    with pytest.raises(TypeError, match="codebook: dtype float32"):
        lutb.LutbWeight.from_tensors(p, c.float(), s, w13.shape)
    bad = s.clone()
    bad[2, 5, 0] = 255
    with pytest.raises(ValueError, match=r"P\.weight_scale: tile \(expert 2, tn 5, tk 0\) has scale byte 255"):
        lutb.LutbWeight.from_tensors(p, c, bad, w13.shape, name="P")
    bad[2, 5, 0] = 250
    with pytest.raises(ValueError, match=r"scale: tile \(expert 2, tn 5, tk 0\) has scale byte 250 \(outside 3\.\.246"):
        lutb.LutbWeight.from_tensors(p, c, bad, w13.shape)
    badc = c.clone()
    badc[0, 1, 0, 3] = 0xFF
    with pytest.raises(ValueError, match=r"codebook: tile \(expert 0, tn 1, tk 0\) has a NaN codebook entry \(index 3, byte 0xFF\)"):
        lutb.LutbWeight.from_tensors(p, badc, s, w13.shape)
    with pytest.raises(TypeError, match="scale: a ndarray, but packed is a Tensor"):
        lutb.LutbWeight.from_tensors(p, c, s.numpy(), w13.shape)
    with pytest.raises(ValueError, match="shape"):
        lutb.LutbWeight.from_tensors(p, c, s, (4, 128))
    # the logical shape must be a sequence of ints: a str or a float size is refused, naming `shape`
    for bad_shape, shown in [("4,128,64", "str '4,128,64'"), (4, "int"), ((4, 128.0, 64), "holds a float"),
                             ((4, True, 64), "holds a bool"), ([4, "128", 64], "holds a str")]:
        with pytest.raises(TypeError, match=r"^shape: expected a sequence of ints, got .*" + re.escape(shown)):
            lutb.LutbWeight.from_tensors(p, c, s, bad_shape)
    with pytest.raises(ValueError, match=r"^shape: \(4, 0, 64\) is not a logical weight shape"):
        lutb.LutbWeight.from_tensors(p, c, s, (4, 0, 64))
    # list, torch.Size and numpy integers are sequences of ints
    for good in ([4, 128, 64], torch.Size([4, 128, 64]), tuple(np.array([4, 128, 64]))):
        assert lutb.LutbWeight.from_tensors(p, c, s, good).shape == (4, 128, 64)
    nc = torch.empty(4, 16, 1, 384, dtype=torch.uint8)[..., ::2]
    with pytest.raises(ValueError, match="packed: must be contiguous"):
        lutb.LutbWeight.from_tensors(nc, c, s, w13.shape)


def test_moe_experts_bad_inputs(layer):
    w13, w2 = layer
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    wts = torch.ones(3, 2)
    cases = [
        ((x.float(), ids, wts, w13, w2), {}, TypeError, "x: dtype float32 is not bfloat16"),
        ((x[:, :32].contiguous(), ids, wts, w13, w2), {}, ValueError, "w13: shape .* has K=64, x has H=32"),
        ((x, ids.float(), wts, w13, w2), {}, TypeError, "topk_ids: expected an int32 or int64"),
        ((x, ids[:2], wts, w13, w2), {}, ValueError, "topk_ids: shape"),
        ((x, ids, wts[:, :1], w13, w2), {}, ValueError, "topk_weights: shape"),
        ((x, ids, wts, w2, w2), {}, ValueError, "w2: shape"),
        ((x, ids, wts, w13.packed, w2), {}, TypeError, "w13: expected a LutbWeight"),
        ((x, ids, wts, w13, w2), {"act_format": "fp4"}, ValueError, "act_format: 'fp4'"),
        ((x, ids, wts, w13, w2), {"out": torch.zeros(3, 64, dtype=torch.float16)}, ValueError,
         "out: expected a bfloat16 or float32"),
        ((x, ids, wts, w13, w2), {"out": torch.zeros(3, 63)}, ValueError, "out: expected a bfloat16 or float32"),
        ((x, torch.zeros(2, 3, dtype=torch.int64).t(), wts, w13, w2), {}, ValueError, "topk_ids: must be contiguous"),
        ((x, -ids - 1, wts, w13, w2), {}, ValueError, "topk_ids: token 0 slot 0 holds expert id -1 < 0"),
    ]
    for args, kw, exc, words in cases:
        with pytest.raises(exc, match=words):
            lutb.moe_experts(*args, **kw)


def test_routing_bad_inputs():
    lg = torch.zeros(4, 16)
    with pytest.raises(ValueError, match="k: 17 is not in 1..16"):
        lutb.route_softmax_topk(lg, 17)
    with pytest.raises(ValueError, match=r"logits: shape \(16,\)"):
        lutb.route_softmax_topk(torch.zeros(16), 2)
    with pytest.raises(ValueError, match="n_group: 5"):
        lutb.route_deepseek(lg, None, 2, 5, 1)
    with pytest.raises(ValueError, match="topk_group: 3"):
        lutb.route_deepseek(lg, None, 2, 2, 3)
    with pytest.raises(ValueError, match=r"correction_bias: shape \(8,\)"):
        lutb.route_deepseek(lg, torch.zeros(8), 2, 4, 2)
    with pytest.raises(TypeError, match="logits: dtype int64"):
        lutb.route_softmax_topk(torch.zeros(4, 16, dtype=torch.int64), 2)
    for bad in (float("nan"), float("inf"), np.float32("-inf")):
        with pytest.raises(ValueError, match=f"^routed_scaling_factor: {float(bad)} is not finite$"):
            lutb.route_deepseek(lg, None, 2, 4, 2, True, bad)
        with pytest.raises(ValueError, match=f"^routed_scaling_factor: {float(bad)} is not finite$"):
            torch.ops.lutb.route_deepseek(lg, None, 2, 4, 2, True, float(bad))


# Values are not checked (docs: moe_experts never synchronises on CUDA); NaN and Inf propagate.
def test_routing_values_are_not_checked():
    nan, inf = float("nan"), float("inf")
    lg = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    lg[0, 3] = nan           # one NaN: every probability of the row is NaN
    lg[1, 6] = inf           # +Inf: inf - inf in the max-subtracted softmax
    lg[2, :] = -inf          # only -Inf: 0 / 0
    lg[3, 5] = -inf          # one -Inf among numbers: probability 0, the row is fine
    ids, w = lutb.route_softmax_topk(lg, 3)
    assert ids[:3].tolist() == [[0, 1, 2]] * 3 and torch.isnan(w[:3]).all()
    ref = torch.softmax(lg[3:], -1).topk(3)
    assert torch.equal(ids[3:], ref.indices.int()) and not torch.isnan(w[3:]).any()
    torch.testing.assert_close(w[3:], ref.values / ref.values.sum(-1, keepdim=True))
    # DeepSeek: a NaN logit ranks its expert below every number; chosen, it makes the row NaN
    lg = torch.tensor([[0.0, 3.0, nan, 2.0, 1.0, 0.5, -1.0, -2.0],
                       [nan, nan, nan, 2.0, nan, nan, nan, nan]])
    ids, w = lutb.route_deepseek(lg, None, 2, 2, 1)
    assert ids[0].tolist() == [1, 3] and not torch.isnan(w[0]).any()
    assert ids[1].tolist() == [3, 0] and torch.isnan(w[1]).all()  # group 0: 2.0 and NaN beat group 1's NaN, NaN
    ids, w = lutb.route_deepseek(lg[1:], None, 2, 2, 1, renormalize=False)
    assert w[0, 0].item() == pytest.approx(torch.sigmoid(torch.tensor(2.0)).item()) and torch.isnan(w[0, 1])
    # a NaN correction bias only ranks the expert last
    ids, w = lutb.route_deepseek(torch.zeros(1, 8), torch.tensor([nan, 0, 0, 0, 0, 0, 0, 0.5]), 2, 2, 2)
    assert ids.tolist() == [[7, 1]] and w.tolist() == [[0.5, 0.5]]


def test_moe_experts_values_are_not_checked(layer):
    w13, w2 = layer
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [1, 4]])  # 4 >= E: expert of another rank
    wts = torch.full((5, 2), 0.5)
    x[1, 7] = float("nan")
    x[2, 40] = float("inf")
    wts[3, 1] = float("nan")
    wts[4, 1] = float("nan")  # a slot of an id >= E contributes nothing, whatever its weight
    for fmt in ("mxfp8", "bf16"):
        y = lutb.moe_experts(x, ids, wts, w13, w2, act_format=fmt)
        assert torch.isnan(y[1:4]).all() and torch.isfinite(y[[0, 4]]).all(), fmt
        clean = lutb.moe_experts(x[[0, 4]].contiguous(), ids[[0, 4]].contiguous(),
                                 torch.tensor([[0.5, 0.5], [0.5, 0.0]]), w13, w2, act_format=fmt)
        assert torch.equal(y[[0, 4]], clean), fmt


def test_mxfp8_bad_inputs():
    with pytest.raises(ValueError, match="rule: 'ceil'"):
        lutb.mxfp8_qdq(torch.zeros(4, 32), "ceil")
    with pytest.raises(TypeError, match="x: dtype float64"):
        lutb.mxfp8_qdq(np.zeros((4, 32)))
    with pytest.raises(ValueError, match="x: must be contiguous"):
        lutb.mxfp8_qdq(torch.zeros(32, 4).t())
