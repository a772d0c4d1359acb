"""CUDA: the same bytes and numbers as the CPU, CUDA-graph capture and torch.compile (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import lutb

pytestmark = pytest.mark.cuda
DEV = "cuda"


def weights(shape, seed, dtype=torch.bfloat16, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("fitter", ["binned-dp", "optimal", "ct-lloyd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_same_bytes_as_cpu(fitter, dtype):
    w = weights((3, 20, 130), 1, dtype)
    a = lutb.quantize(w, fitter)
    b = lutb.quantize(w.to(DEV), fitter)
    assert b.device.startswith("cuda")
    for x, y in ((a.packed, b.packed), (a.codebook, b.codebook), (a.scale, b.scale)):
        assert torch.equal(x, y.cpu())


def test_quantize_errors_match_cpu():
    w = torch.zeros(2, 16, 128)
    w[1, 9, 70] = float("nan")
    with pytest.raises(ValueError) as cpu:
        lutb.quantize(w)
    with pytest.raises(ValueError) as gpu:
        lutb.quantize(w.to(DEV))
    assert str(cpu.value) == str(gpu.value)
    w[1, 9, 70] = 3.3e38
    with pytest.raises(ValueError) as cpu:
        lutb.quantize(w)
    with pytest.raises(ValueError) as gpu:
        lutb.quantize(w.to(DEV))
    assert str(cpu.value) == str(gpu.value)


def test_dequantize_and_mxfp8_equal_cpu():
    q = lutb.quantize(weights((2, 20, 130), 2, torch.float32, 10.0))
    assert torch.equal(q.to(DEV).dequantize(torch.float32).cpu(), q.dequantize(torch.float32))
    x = torch.randn(9, 100) * 1e3
    for rule in ("rceil", "floor"):
        assert torch.equal(lutb.mxfp8_qdq(x.to(DEV), rule).cpu(), lutb.mxfp8_qdq(x, rule))


def test_routing_equals_cpu():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 64, generator=g)
    bias = torch.randn(64, generator=g) * 0.1
    for renorm in (True, False):
        a = lutb.route_softmax_topk(logits, 6, renorm)
        b = lutb.route_softmax_topk(logits.to(DEV), 6, renorm)
        assert torch.equal(a[0], b[0].cpu())
        torch.testing.assert_close(a[1], b[1].cpu(), rtol=1e-6, atol=0)
        a = lutb.route_deepseek(logits, bias, 8, 8, 4, renorm, 2.5)
        b = lutb.route_deepseek(logits.to(DEV), bias.to(DEV), 8, 8, 4, renorm, 2.5)
        assert torch.equal(a[0], b[0].cpu())
        torch.testing.assert_close(a[1], b[1].cpu(), rtol=1e-6, atol=0)


def test_routing_of_nan_and_inf_logits_equals_cpu():
    """Logit values are not checked; rows with NaN or +-Inf logits (and a NaN / +-Inf correction bias)
    route as on the CPU: a NaN score ranks below every number, every id is in 0..E-1."""
    g = torch.Generator().manual_seed(5)
    t, e = 64, 64
    logits = torch.randn(t, e, generator=g)
    for r in range(t):
        kind = r % 8
        if kind == 1:
            logits[r, r % e] = float("nan")
        elif kind == 2:
            logits[r] = float("nan")
        elif kind == 3:
            logits[r, (7 * r) % e] = float("inf")
        elif kind == 4:
            logits[r] = -float("inf")
        elif kind == 5:
            logits[r, ::2] = float("nan")
        elif kind == 6:
            logits[r, :40] = float("nan")  # most groups without two numbers
        elif kind == 7:
            logits[r, (3 * r) % e] = -float("inf")
    bias = torch.randn(e, generator=g) * 0.1
    bias[3], bias[9], bias[17] = float("nan"), float("inf"), -float("inf")

    def same(a, b):
        assert torch.equal(a[0], b[0].cpu())
        assert int(b[0].min()) >= 0 and int(b[0].max()) < e
        assert torch.equal(torch.isnan(a[1]), torch.isnan(b[1].cpu()))
        torch.testing.assert_close(a[1], b[1].cpu(), rtol=1e-6, atol=0, equal_nan=True)

    for renorm in (True, False):
        for k in (6, 32):
            same(lutb.route_softmax_topk(logits, k, renorm), lutb.route_softmax_topk(logits.to(DEV), k, renorm))
        for b in (bias, None):
            for k, n_group, topk_group in ((8, 8, 4), (32, 32, 16)):
                same(lutb.route_deepseek(logits, b, k, n_group, topk_group, renorm, 2.5),
                     lutb.route_deepseek(logits.to(DEV), None if b is None else b.to(DEV), k, n_group, topk_group,
                                         renorm, 2.5))
    torch.cuda.synchronize()  # no fault: the kernels never index outside the row


def layer(e=8, h=256, i=128, seed=4):
    w13 = lutb.quantize(weights((e, 2 * i, h), seed))
    w2 = lutb.quantize(weights((e, h, i), seed + 1))
    return w13, w2


def normalised_error(a, b):
    return float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))


@pytest.mark.parametrize("act_format", ["mxfp8", "bf16"])
@pytest.mark.parametrize("t", [1, 4, 16, 300])
def test_moe_experts_equals_cpu(t, act_format):
    """CUDA vs CPU: the same values enter every product; only the FP32 summation order differs, which
    can flip a BF16 or E4M3 rounding of h and the BF16 rounding of the output on a few elements
    (normalised error well under 1e-3; a wrong tile or scale gives order 1)."""
    w13, w2 = layer()
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)])
    ids[::3, 1] = 8  # expert-parallel marker: contributes nothing
    wts = torch.rand(t, 2, generator=g)
    cpu = lutb.moe_experts(x, ids, wts, w13, w2, act_format=act_format)
    w13d, w2d = w13.to(DEV), w2.to(DEV)
    gpu = lutb.moe_experts(x.to(DEV), ids.to(DEV), wts.to(DEV), w13d, w2d, act_format=act_format)
    assert gpu.dtype == torch.bfloat16
    assert not gpu.isnan().any()
    assert normalised_error(gpu.cpu(), cpu) < 1e-3


@pytest.mark.parametrize("act_format", ["mxfp8", "bf16"])
@pytest.mark.parametrize("t", [5, 300])
def test_moe_experts_nan_values_propagate_as_on_the_cpu(t, act_format):
    """Values are not checked: NaN / Inf in x or topk_weights make those tokens' rows non-finite, as on
    the CPU; a NaN weight on an id >= E changes nothing; the other rows equal the clean call's."""
    w13, w2 = layer()
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)])
    wts = torch.rand(t, 2, generator=g)
    bad_x, bad_w = x.clone(), wts.clone()
    bad_x[1, 7], bad_x[2, 100] = float("nan"), float("inf")
    bad_w[3, 1] = float("nan")
    ids[4, 1], bad_w[4, 1] = 8, float("nan")  # expert-parallel marker with a NaN weight
    w13d, w2d = w13.to(DEV), w2.to(DEV)
    gpu = lutb.moe_experts(bad_x.to(DEV), ids.to(DEV), bad_w.to(DEV), w13d, w2d, act_format=act_format).cpu()
    cpu = lutb.moe_experts(bad_x, ids, bad_w, w13, w2, act_format=act_format)
    assert torch.equal(torch.isfinite(gpu), torch.isfinite(cpu))
    assert not torch.isfinite(gpu[1:4]).any(dim=1).any() and torch.isfinite(gpu[[0, 4]]).all()
    clean_w = wts.clone()
    clean_w[4, 1] = 0.0
    clean = lutb.moe_experts(x.to(DEV), ids.to(DEV), clean_w.to(DEV), w13d, w2d, act_format=act_format).cpu()
    rest = [r for r in range(t) if r not in (1, 2, 3)]
    assert torch.equal(gpu[rest], clean[rest])


@pytest.mark.parametrize("act_format", ["mxfp8", "bf16"])
@pytest.mark.parametrize("t", [1, 4, 300])
def test_moe_experts_float32_out_rounds_to_the_bf16_out(t, act_format):
    """out=float32 is the FP32 sum of step 6 (the separate reduction, never the fused one): rounded
    once, it is the BF16 output bit for bit."""
    w13, w2 = layer()
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 256, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)]).to(DEV)
    wts = torch.rand(t, 2, generator=g).to(DEV)
    w13d, w2d = w13.to(DEV), w2.to(DEV)
    f = torch.empty(t, 256, device=DEV)
    lutb.moe_experts(x, ids, wts, w13d, w2d, act_format=act_format, out=f)
    assert torch.equal(f.to(torch.bfloat16), lutb.moe_experts(x, ids, wts, w13d, w2d, act_format=act_format))


def test_moe_experts_cuda_graph_capture_and_replay():
    w13, w2 = layer()
    w13d, w2d = w13.to(DEV), w2.to(DEV)
    w13d.kernel_packed(), w2d.kernel_packed()  # the lane-major copies, before capture
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 256, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.randint(0, 9, (4, 2), generator=g).to(DEV)
    wts = torch.rand(4, 2, generator=g).to(DEV)
    out = torch.empty(4, 256, dtype=torch.bfloat16, device=DEV)
    lutb.moe_experts(x, ids, wts, w13d, w2d, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lutb.moe_experts(x, ids, wts, w13d, w2d, out=out)
    for seed in (6, 7):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(4, 256, generator=g).to(torch.bfloat16))
        ids.copy_(torch.randint(0, 9, (4, 2), generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, lutb.moe_experts(x, ids, wts, w13d, w2d))


def test_moe_experts_torch_compile_fullgraph():
    w13, w2 = layer()
    w13d, w2d = w13.to(DEV), w2.to(DEV)
    w13d.kernel_packed(), w2d.kernel_packed()
    gate = weights((8, 256), 6).to(DEV)

    def block(x):
        ids, wts = lutb.route_softmax_topk(x.float() @ gate.float().t(), 2, True)
        return lutb.moe_experts(x, ids, wts, w13d, w2d)

    x = weights((16, 256), 7, scale=1.0).to(DEV)
    assert torch.equal(torch.compile(block, fullgraph=True)(x), block(x))


def test_moe_experts_device_mismatch():
    w13, w2 = layer()
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="w13: on cpu"):
        lutb.moe_experts(x, torch.zeros(2, 2, dtype=torch.int64, device=DEV), torch.ones(2, 2, device=DEV), w13, w2)
    with pytest.raises(ValueError, match="topk_ids: on cpu"):
        lutb.moe_experts(x, torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2, device=DEV), w13.to(DEV),
                         w2.to(DEV))


def test_lane_major_copy_equals_the_host_permutation():
    """The cached kernel copy is lutb/cuda/lane_major.hpp's tile_to_lane_major of every tile."""
    from lutb import _lutb

    q = lutb.quantize(weights((2, 16, 128), 8)).to(DEV)
    lm = q.kernel_packed()
    assert lm is q.kernel_packed()  # cached
    want = torch.empty_like(q.packed, device="cpu")
    _lutb.lane_major_cpu(q.packed.cpu(), want)
    assert torch.equal(lm.cpu(), want)
    assert not torch.equal(lm, q.packed)


def test_release_packed_keeps_one_copy_and_the_same_results():
    w13, w2 = layer()
    w13d, w2d = w13.to(DEV), w2.to(DEV)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 256, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.randint(0, 8, (6, 2), generator=g).to(DEV)
    wts = torch.rand(6, 2, generator=g).to(DEV)
    want = lutb.moe_experts(x, ids, wts, w13d, w2d)
    w13d.release_packed()
    w2d.release_packed()
    assert w13d._packed is None
    assert torch.equal(lutb.moe_experts(x, ids, wts, w13d, w2d), want)
    assert torch.equal(w13d.packed.cpu(), w13.packed)  # recomputed from the lane-major copy
    assert torch.equal(w2d.dequantize().cpu(), w2.dequantize())
    w13d.drop_kernel_cache()
    assert torch.equal(w13d._packed.cpu(), w13.packed)


def test_opcheck_of_the_cuda_kernels():
    w13, w2 = layer()
    w13d, w2d = w13.to(DEV), w2.to(DEV)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.randint(0, 9, (5, 2), generator=g).to(DEV)
    wts = torch.rand(5, 2, generator=g).to(DEV)
    experts = (x, ids, wts, w13d.kernel_packed(), w13d.codebook, w13d.scale, w2d.kernel_packed(), w2d.codebook,
               w2d.scale, 128, "mxfp8", True)
    ops = torch.ops.lutb
    cases = [
        (ops.moe_experts.default, experts),
        (ops.moe_experts_out.default, experts + (torch.empty(5, 256, dtype=torch.bfloat16, device=DEV),)),
        (ops.route_softmax_topk.default, (torch.randn(5, 8, device=DEV), 2, True)),
        (ops.route_deepseek.default, (torch.randn(5, 8, device=DEV), torch.randn(8, device=DEV), 2, 4, 2, True, 2.5)),
        (ops.mxfp8_qdq.default, (torch.randn(5, 40, device=DEV), "rceil")),
        (ops.dequantize.default, (w2d.packed, w2d.codebook, w2d.scale, [8, 256, 128])),
        (ops.lane_major.default, (w2d.packed,)),
        (ops.quantize.default, (torch.randn(2, 16, 64, device=DEV), "optimal", -1, 0, "w",
                                torch.rand(2, 64, device=DEV) + 0.5)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
