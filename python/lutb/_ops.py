"""The torch.ops.lutb operators (registered when torch is importable; see lutb/__init__.py).

Operators are defined with torch.library.Library(...).define/impl (lower per-call cost than
torch.library.custom_op) with a CPU and a CUDA kernel and a fake (meta) kernel each, so
torch.compile(fullgraph=True) traces callers without graph breaks. The CPU and CUDA kernels run the
argument checks of the lutb.* functions (lutb._api), so a direct torch.ops.lutb call with a
non-contiguous tensor or a wrong dtype, size or integer raises the same TypeError / ValueError
naming the argument; the fake kernels check nothing. moe_experts has an autograd kernel whose
backward raises RuntimeError (inference only). CUDA kernels run on the current
stream of the input's device; moe_experts and moe_experts_out never synchronise with the host and
allocate only through torch (CUDA-graph capture works).

Schemas (all LUT-B tensors uint8, spec 2.2 layout; E = experts, I = intermediate size):
  quantize(w, fitter, forced_scale, threads, name, column_weights=None, second_moments=None, damping=0.01)
      -> (packed, codebook, scale)
      column_weights: None or float32 [K] / [E, K] on w's device; second_moments: None or float32
      [K, K] / [E, K, K] on the CPU with w (the CUDA kernel refuses them); lutb.quantize documents both
  dequantize(packed, codebook, scale, shape) -> float32 [shape]
  lane_major(packed) -> packed bytes in the CUDA kernels' lane-major order (CUDA only)
  mxfp8_qdq(x, rule) -> float32 like x
  route_softmax_topk(logits, k, renormalize) -> (int32 ids [T, k], float32 weights [T, k])
  route_deepseek(logits, correction_bias?, k, n_group, topk_group, renormalize, routed_scaling_factor) -> same
  moe_experts(x, topk_ids, topk_weights, w13 packed/codebook/scale, w2 packed/codebook/scale,
              intermediate, act_format, lane_major) -> bf16 [T, H]
  moe_experts_out(..., out) -> ()   (writes out: bfloat16, or float32 = the sums before rounding)
lane_major: the packed bytes are in the CUDA MXFP8 kernels' lane-major order (True only on CUDA with
act_format "mxfp8"); otherwise checkpoint order (False).
"""

from __future__ import annotations

import torch

from . import _api as P
from . import _arrays as A
from . import _impl as I

_lib = torch.library.Library("lutb", "DEF")


def _define(schema: str, cpu=None, cuda=None, fake=None) -> None:
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    if cpu is not None:
        _lib.impl(name, cpu, "CPU")
    if cuda is not None:
        _lib.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"lutb::{name}", fake, lib=_lib)


# quantize ------------------------------------------------------------------------------------
def _quantize_fake(w, fitter, forced_scale, threads, name, column_weights=None, second_moments=None, damping=0.01):
    lead, _, tn, tk = A.tiles_of(tuple(w.shape))
    return (w.new_empty(lead + (tn, tk, A.PACKED_BYTES), dtype=torch.uint8),
            w.new_empty(lead + (tn, tk, A.CODEBOOK_SIZE), dtype=torch.uint8),
            w.new_empty(lead + (tn, tk), dtype=torch.uint8))


def _quantize_cpu(w, fitter, forced_scale, threads, name, column_weights=None, second_moments=None, damping=0.01):
    _, _, cw, sm, damping = P._check_quantize(w, fitter, forced_scale, threads, name, column_weights, second_moments,
                                              damping)
    return I.quantize_cpu(w, fitter, forced_scale, threads, name, cw, sm, damping)


def _quantize_cuda(w, fitter, forced_scale, threads, name, column_weights=None, second_moments=None, damping=0.01):
    # second_moments are refused here: the fit with error feedback runs on the CPU only.
    _, _, cw, _, _ = P._check_quantize(w, fitter, forced_scale, threads, name, column_weights, second_moments,
                                       damping)
    if fitter in P._LLOYD_FITTERS:
        raise ValueError(f"fitter: {fitter!r} has no GPU kernel; lutb.quantize fits CUDA tensors on the CPU for it")
    return I.quantize_cuda(w, fitter, forced_scale, name, cw)


_define("quantize(Tensor w, str fitter, int forced_scale, int threads, str name, Tensor? column_weights=None, "
        "Tensor? second_moments=None, float damping=0.01) -> (Tensor, Tensor, Tensor)",
        cpu=_quantize_cpu, cuda=_quantize_cuda,
        fake=_quantize_fake)

# dequantize ----------------------------------------------------------------------------------
_U8 = (("uint8",),) * 3


def _dequantize(kernel):
    def run(p, c, s, shape):
        shape = P._check_lutb_tensors((p, c, s), ("packed", "codebook", "scale"), shape, _U8)
        return kernel(p, c, s, shape)
    return run


_define("dequantize(Tensor packed, Tensor codebook, Tensor scale, int[] shape) -> Tensor",
        cpu=_dequantize(I.dequantize_cpu), cuda=_dequantize(I.dequantize_torch),
        fake=lambda p, c, s, shape: p.new_empty(tuple(shape), dtype=torch.float32))

# lane-major copy of the packed bytes (CUDA) ----------------------------------------------------
_define("lane_major(Tensor packed) -> Tensor", cuda=I.lane_major_cuda, fake=lambda p: torch.empty_like(p))

# MXFP8 quantise-dequantise ---------------------------------------------------------------------
def _checked_mxfp8(kernel):
    def run(x, rule):
        P._check_mxfp8(x, rule)
        return kernel(x, rule)
    return run


_define("mxfp8_qdq(Tensor x, str rule) -> Tensor",
        cpu=_checked_mxfp8(I.mxfp8_qdq_cpu), cuda=_checked_mxfp8(I.mxfp8_qdq_torch),
        fake=lambda x, rule: torch.empty_like(x, dtype=torch.float32))


# routing ---------------------------------------------------------------------------------------
def _route_fake(logits, k):
    t = logits.shape[0]
    return logits.new_empty((t, k), dtype=torch.int32), logits.new_empty((t, k), dtype=torch.float32)


def _softmax_args(lg, k):
    lg = P._router_logits(lg)
    return lg, P._check_k(k, int(lg.shape[1]), A.is_cuda(lg))


def _softmax_cpu(lg, k, r):
    lg, k = _softmax_args(lg, k)
    return I.route_cpu(lg, None, False, k, r, 1, 1, 1.0)


def _softmax_cuda(lg, k, r):
    lg, k = _softmax_args(lg, k)
    return I.route_softmax_topk_cuda(lg, k, r)


def _deepseek_cpu(lg, b, k, g, tg, r, s):
    lg, b, k, g, tg = P._check_deepseek(lg, b, k, g, tg, s)
    return I.route_cpu(lg, b, True, k, r, g, tg, s)


def _deepseek_cuda(lg, b, k, g, tg, r, s):
    lg, b, k, g, tg = P._check_deepseek(lg, b, k, g, tg, s)
    return I.route_deepseek_cuda(lg, b, k, g, tg, r, s)


_define("route_softmax_topk(Tensor logits, int k, bool renormalize) -> (Tensor, Tensor)",
        cpu=_softmax_cpu, cuda=_softmax_cuda,
        fake=lambda lg, k, r: _route_fake(lg, k))
_define("route_deepseek(Tensor logits, Tensor? correction_bias, int k, int n_group, int topk_group, "
        "bool renormalize, float routed_scaling_factor) -> (Tensor, Tensor)",
        cpu=_deepseek_cpu, cuda=_deepseek_cuda,
        fake=lambda lg, b, k, g, tg, r, s: _route_fake(lg, k))

# experts ---------------------------------------------------------------------------------------
_EXPERTS_ARGS = ("Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, Tensor w13_codebook, "
                 "Tensor w13_scale, Tensor w2_packed, Tensor w2_codebook, Tensor w2_scale, int intermediate, "
                 "str act_format, bool lane_major")


def _experts_cpu_out(x, ids, wts, p13, c13, s13, p2, c2, s2, inter, act, lane_major, out):
    wts = P._check_experts_op(x, ids, wts, p13, c13, s13, p2, c2, s2, inter, act, lane_major, out)
    if lane_major:
        raise ValueError("lane_major: the CPU kernels read checkpoint-order packed bytes (lane_major=False)")
    I.moe_experts_cpu(x, ids, wts, p13, c13, s13, p2, c2, s2, inter, act, out)


def _experts_cuda_out(x, ids, wts, p13, c13, s13, p2, c2, s2, inter, act, lane_major, out):
    wts = P._check_experts_op(x, ids, wts, p13, c13, s13, p2, c2, s2, inter, act, lane_major, out)
    if act == "bf16":
        if lane_major:
            raise ValueError("lane_major: act_format='bf16' dequantises checkpoint-order packed bytes (lane_major=False)")
        I.moe_experts_bf16_cuda(x, ids, wts, p13, c13, s13, p2, c2, s2, inter, out)
        return
    if act != "mxfp8":
        raise ValueError(f"act_format: '{act}' is not 'mxfp8' or 'bf16'")
    if not lane_major:
        raise ValueError("lane_major: the CUDA MXFP8 kernels read lane-major packed bytes (torch.ops.lutb.lane_major)")
    I.moe_experts_cuda(x, ids, wts, p13, c13, s13, p2, c2, s2, inter, out)


def _functional(kernel):
    def run(x, *args):
        out = torch.empty_like(x)
        kernel(x, *args, out)
        return out
    return run


_define(f"moe_experts({_EXPERTS_ARGS}) -> Tensor",
        cpu=_functional(_experts_cpu_out), cuda=_functional(_experts_cuda_out),
        fake=lambda x, *args: torch.empty_like(x))
_define(f"moe_experts_out({_EXPERTS_ARGS}, Tensor(a!) out) -> ()",
        cpu=_experts_cpu_out, cuda=_experts_cuda_out,
        fake=lambda *args: None)


def _experts_setup_context(ctx, inputs, output):
    pass


def _experts_backward(ctx, grad):
    raise RuntimeError("moe_experts: no backward (lutb's experts are inference only: LUT-B weights are not "
                       "trainable and the MXFP8 steps have no gradient); run the forward under torch.no_grad() "
                       "or torch.inference_mode(), or detach its inputs")


# Without an autograd kernel torch would warn and return a gradient of zeros ("silently incorrect").
torch.library.register_autograd("lutb::moe_experts", _experts_backward, setup_context=_experts_setup_context,
                                lib=_lib)
