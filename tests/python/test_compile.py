"""torch.compile(fullgraph=True) traces the torch.ops.lutb operators without graph breaks (CPU)."""

from __future__ import annotations

import torch

import lutb


def test_fullgraph_compile_of_a_moe_block():
    g = torch.Generator().manual_seed(0)
    e, h, i = 4, 64, 64
    w13 = lutb.quantize((torch.randn(e, 2 * i, h, generator=g) * 0.05).to(torch.bfloat16))
    w2 = lutb.quantize((torch.randn(e, h, i, generator=g) * 0.05).to(torch.bfloat16))
    gate = torch.randn(e, h, generator=g).to(torch.bfloat16)

    def block(x):
        logits = x.float() @ gate.float().t()
        ids, wts = lutb.route_softmax_topk(logits, 2, True)
        y = lutb.moe_experts(x, ids, wts, w13, w2)
        return y + lutb.mxfp8_qdq(x).to(torch.bfloat16)

    x = torch.randn(8, h, generator=g).to(torch.bfloat16)
    eager = block(x)
    # aot_eager: Dynamo's full-graph trace and AOT autograd's functionalisation over the fake kernels,
    # which is what the operators must support; inductor's code generation adds ~10 s of C++
    # compilation here and nothing about lutb (the CUDA test compiles with inductor).
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), eager)
    # A second shape recompiles or reuses a dynamic graph; either way no graph break.
    x2 = torch.randn(3, h, generator=g).to(torch.bfloat16)
    assert torch.equal(compiled(x2), block(x2))


def test_has_cuda_traces_as_a_constant():
    # moe_experts and quantize branch on has_cuda(); a call into the extension there would break the
    # graph of every compiled model on CUDA (dynamo cannot trace a nanobind function).
    def f(x):
        return x + 1 if lutb.has_cuda() else x - 1

    x = torch.zeros(2)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))


def test_fake_kernels_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = lutb.quantize(torch.randn(2, 16, 64))
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(5, 64, dtype=torch.bfloat16)
        ids = torch.empty(5, 2, dtype=torch.int64)
        wts = torch.empty(5, 2)
        w2 = lutb.LutbWeight(torch.empty(2, 8, 1, 192, dtype=torch.uint8), torch.empty(2, 8, 1, 8, dtype=torch.uint8),
                             torch.empty(2, 8, 1, dtype=torch.uint8), (2, 64, 8))
        out = torch.ops.lutb.moe_experts(x, ids, wts, w.packed, w.codebook, w.scale, w2.packed, w2.codebook,
                                         w2.scale, 8, "mxfp8", False)
        assert out.shape == (5, 64) and out.dtype == torch.bfloat16
        r_ids, r_w = torch.ops.lutb.route_softmax_topk(torch.empty(5, 16), 3, True)
        assert r_ids.shape == (5, 3) and r_ids.dtype == torch.int32 and r_w.dtype == torch.float32
        p, c, s = torch.ops.lutb.quantize(torch.empty(3, 20, 130), "binned-dp", -1, 0, "w")
        assert p.shape == (3, 3, 3, 192) and c.shape == (3, 3, 3, 8) and s.shape == (3, 3, 3)
        p, c, s = torch.ops.lutb.quantize(torch.empty(3, 20, 130), "optimal", -1, 0, "w", torch.empty(130))
        assert p.shape == (3, 3, 3, 192) and c.shape == (3, 3, 3, 8) and s.shape == (3, 3, 3)


def test_fullgraph_compile_with_out_argument():
    """moe_experts(..., out=) is the mutating operator moe_experts_out: functionalised by the trace."""
    g = torch.Generator().manual_seed(1)
    w13 = lutb.quantize((torch.randn(4, 128, 64, generator=g) * 0.05).to(torch.bfloat16))
    w2 = lutb.quantize((torch.randn(4, 64, 64, generator=g) * 0.05).to(torch.bfloat16))

    def f(x, ids, wts, out):
        lutb.moe_experts(x, ids, wts, w13, w2, out=out)
        return out * 2

    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 5, (5, 2), generator=g)  # 4 = the expert-parallel marker
    wts = torch.rand(5, 2, generator=g)
    o1, o2 = (torch.empty(5, 64, dtype=torch.bfloat16) for _ in range(2))
    r1 = f(x, ids, wts, o1)
    r2 = torch.compile(f, fullgraph=True, backend="aot_eager")(x, ids, wts, o2)
    assert torch.equal(r1, r2) and torch.equal(o1, o2)


def test_opcheck_of_every_operator():
    """torch.library.opcheck: schema (mutation declared), fake kernels against the real ones, and AOT
    dispatch with dynamic shapes."""
    import pytest

    g = torch.Generator().manual_seed(2)
    w13 = lutb.quantize((torch.randn(4, 128, 64, generator=g) * 0.05).to(torch.bfloat16))
    w2 = lutb.quantize((torch.randn(4, 64, 64, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 5, (5, 2), generator=g)
    wts = torch.rand(5, 2, generator=g)
    experts = (x, ids, wts, w13.packed, w13.codebook, w13.scale, w2.packed, w2.codebook, w2.scale, 64, "mxfp8",
               False)
    ops = torch.ops.lutb
    cases = [
        (ops.moe_experts.default, experts),
        (ops.moe_experts_out.default, experts + (torch.empty(5, 64, dtype=torch.bfloat16),)),
        (ops.route_softmax_topk.default, (torch.randn(5, 8, generator=g), 2, True)),
        (ops.route_deepseek.default, (torch.randn(5, 8, generator=g), torch.randn(8, generator=g), 2, 4, 2, True, 2.5)),
        (ops.mxfp8_qdq.default, (torch.randn(5, 40, generator=g), "rceil")),
        (ops.dequantize.default, (w2.packed, w2.codebook, w2.scale, [4, 64, 64])),
        (ops.quantize.default, (torch.randn(2, 16, 64, generator=g), "binned-dp", -1, 0, "w")),
        (ops.quantize.default, (torch.randn(2, 16, 64, generator=g), "optimal", -1, 0, "w",
                                torch.rand(2, 64, generator=g) + 0.5)),
    ]
    for op, args in cases:
        try:
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
        except Exception as e:  # noqa: BLE001 (report which operator failed)
            pytest.fail(f"{op}: {e}")
