"""Device implementations behind the public functions and the torch.ops.lutb operators.

Arguments are already checked by lutb._api (dtypes, shapes, devices, contiguity), from the
lutb.* functions and from the torch.ops.lutb kernels (lutb._ops). CPU work runs in
the C++ library (lutb._lutb); CUDA work runs in the library's CUDA kernels on the current stream of
the tensor's device, or, for the two small element-wise operations without a CUDA entry point in
the library (dequantize, mxfp8_qdq), in exact torch arithmetic (float64 products of E4M3 values and
powers of two, rounded once), which gives the C++ library's values bit for bit (tested against it
on the CPU).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _arrays as A
from . import _lutb

# ---------------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------------


def quantize_cpu(w: Any, fitter: str, forced_scale: int, threads: int, name: str, column_weights: Any = None,
                 second_moments: Any = None, damping: float = 0.01):
    """(packed, codebook, scale) as uint8 arrays of w's kind (numpy or torch), shapes of spec 2.2.
    column_weights: None or float32 [E, K]; second_moments: None or float32 [E, K, K] (the fit with
    cross-column error feedback, damping its lambda); both contiguous, of w's kind, on the CPU
    (checked by lutb._api)."""
    shape = tuple(w.shape)
    lead, e, tn, tk = A.tiles_of(shape)
    packed, codebook, scale, _, _ = _lutb.quantize_cpu(
        A.raw(w), A.float_source_name(w, "w"), e, shape[-2], shape[-1], len(shape) > 2, fitter, forced_scale,
        None if column_weights is None else A.raw(column_weights),
        None if second_moments is None else A.raw(second_moments), damping, threads, name,
    )
    out = (
        packed.reshape(lead + (tn, tk, A.PACKED_BYTES)),
        codebook.reshape(lead + (tn, tk, A.CODEBOOK_SIZE)),
        scale.reshape(lead + (tn, tk)),
    )
    if A.is_torch(w):
        torch = A.torch_module()
        out = tuple(torch.from_numpy(a) for a in out)
    return out


_FIT_ERRORS = {1: "NaN", 2: "+Inf", 3: "-Inf"}


def quantize_cuda(w: Any, fitter: str, forced_scale: int, name: str, column_weights: Any = None):
    """The GPU fitter (same bytes as the CPU one); synchronises once to read the error word.
    column_weights: None or a float32 [E, K] CUDA tensor on w's device, contiguous (checked by lutb._api)."""
    torch = A.torch_module()
    shape = tuple(w.shape)
    lead, e, tn, tk = A.tiles_of(shape)
    dev = w.device
    packed = torch.empty(lead + (tn, tk, A.PACKED_BYTES), dtype=torch.uint8, device=dev)
    codebook = torch.empty(lead + (tn, tk, A.CODEBOOK_SIZE), dtype=torch.uint8, device=dev)
    scale = torch.empty(lead + (tn, tk), dtype=torch.uint8, device=dev)
    err = torch.empty(1, dtype=torch.int64, device=dev)
    _lutb.quantize_cuda(
        A.raw(w), A.float_source_name(w, "w"), e, shape[-2], shape[-1], len(shape) > 2, fitter, forced_scale,
        None if column_weights is None else A.raw(column_weights), packed, codebook, scale, err, A.stream_of(w),
    )
    word = int(err.item()) & 0xFFFFFFFFFFFFFFFF
    code, tile, pos = _lutb.decode_fit_error(word)
    if code != 0:
        raise ValueError("quantize: " + _fit_error_message(w, name, code, tile, pos, tn, tk))
    return packed, codebook, scale


def _fit_error_message(w: Any, name: str, code: int, tile: int, pos: int, tn: int, tk: int) -> str:
    """lutb::quantize's wording for the first failing tile ("tensor w, expert 1, tile (0, 2): NaN at row 3 col 130")."""
    shape = tuple(w.shape)
    e, rem = divmod(tile, tn * tk)
    i, j = divmod(rem, tk)
    where = f"tensor {name}" + (f", expert {e}" if len(shape) > 2 else "") + f", tile ({i}, {j})"
    if code == 5:  # a column weight that is not finite and > 0 (pos: the column inside the tile)
        return (f"tensor {name}" + (f", expert {e}" if len(shape) > 2 else "") +
                f": column weight {j * A.TILE_COLS + pos} is not finite and > 0; column weights must be finite and > 0")
    if code in _FIT_ERRORS:
        r, c = divmod(pos, A.TILE_COLS)
        return f"{where}: {_FIT_ERRORS[code]} at row {i * A.TILE_ROWS + r} col {j * A.TILE_COLS + c}"
    w3 = w.reshape(-1, shape[-2], shape[-1])
    amax = w3[e, i * A.TILE_ROWS:(i + 1) * A.TILE_ROWS, j * A.TILE_COLS:(j + 1) * A.TILE_COLS].abs().max()
    # str(np.float32) is the shortest decimal that reads back as the value, as the C++ message prints
    # it ("3.3e+38"); format() of an np.float32, as an f-string field, would print the double.
    return f"{where}: magnitude {np.float32(amax.float().item())!s} needs a scale byte above 246 (spec section 2)"


# ---------------------------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------------------------


def dequantize_cpu(packed: Any, codebook: Any, scale: Any, shape: tuple[int, ...], what: str = "weight"):
    """FP32 array of the logical shape (numpy or torch like the inputs); exact (spec 2)."""
    lead, e, _, _ = A.tiles_of(shape)
    if A.is_torch(packed):
        torch = A.torch_module()
        out = torch.empty(shape, dtype=torch.float32)
    else:
        out = np.empty(shape, dtype=np.float32)
    _lutb.dequantize_cpu(A.raw(packed), A.raw(codebook), A.raw(scale), e, shape[-2], shape[-1], len(shape) > 2,
                         out, what)
    return out


def dequantize_torch(packed: Any, codebook: Any, scale: Any, shape: tuple[int, ...]):
    """The same values from torch operations on any device: indices unpacked by spec 2's bit order,
    codebook entries decoded from E4M3, times 2^(scale-127) in float64 (exact), rounded once to FP32
    (exact for scale bytes 3..246)."""
    torch = A.torch_module()
    lead, e, tn, tk = A.tiles_of(shape)
    n, k = shape[-2], shape[-1]
    p = packed.reshape(-1, 64, 3).to(torch.int32)
    word = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)  # [tiles, 64]: 8 indices per 24-bit word
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
    idx = ((word.unsqueeze(-1) >> shifts) & 7).reshape(-1, 512).long()  # flat position f = r*64 + c
    cb = codebook.reshape(-1, 8).view(torch.float8_e4m3fn).to(torch.float32).to(torch.float64)
    vals = torch.gather(cb, 1, idx) * torch.exp2(scale.reshape(-1, 1).to(torch.float64) - 127.0)
    w = vals.reshape(e, tn, tk, A.TILE_ROWS, A.TILE_COLS).permute(0, 1, 3, 2, 4)
    w = w.reshape(e, tn * A.TILE_ROWS, tk * A.TILE_COLS)[:, :n, :k]
    return w.to(torch.float32).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Data validation of LUT-B tensors (spec 2: scale bytes 3..246, no NaN codebook entry)
# ---------------------------------------------------------------------------------------------


def tile_name(t: int, shape: tuple[int, ...]) -> str:
    _, _, tn, tk = A.tiles_of(shape)
    e, rem = divmod(t, tn * tk)
    i, j = divmod(rem, tk)
    return f"tile (expert {e}, tn {i}, tk {j})" if len(shape) > 2 else f"tile (tn {i}, tk {j})"


def validate_data(codebook: Any, scale: Any, shape: tuple[int, ...], codebook_name: str, scale_name: str) -> None:
    """Raises ValueError naming the tensor and the first bad tile (synchronises on CUDA)."""
    s = A.raw(scale).reshape(-1)
    cb = A.raw(codebook).reshape(-1, A.CODEBOOK_SIZE)
    if A.is_torch(s):
        torch = A.torch_module()
        bad_s = torch.nonzero((s < A.MIN_SCALE) | (s > A.MAX_SCALE)).flatten()
        bad_s = int(bad_s[0].item()) if bad_s.numel() else -1
        nan_cb = (cb & 0x7F) == 0x7F
        bad_c = torch.nonzero(nan_cb.any(dim=1)).flatten()
        bad_c = int(bad_c[0].item()) if bad_c.numel() else -1
        entry = int(torch.nonzero(nan_cb[bad_c]).flatten()[0].item()) if bad_c >= 0 else -1
        byte = int(cb[bad_c, entry].item()) if bad_c >= 0 else 0
        sbyte = int(s[bad_s].item()) if bad_s >= 0 else 0
    else:
        bs = np.flatnonzero((s < A.MIN_SCALE) | (s > A.MAX_SCALE))
        bad_s = int(bs[0]) if bs.size else -1
        nan_cb = (cb & 0x7F) == 0x7F
        bc = np.flatnonzero(nan_cb.any(axis=1))
        bad_c = int(bc[0]) if bc.size else -1
        entry = int(np.flatnonzero(nan_cb[bad_c])[0]) if bad_c >= 0 else -1
        byte = int(cb[bad_c, entry]) if bad_c >= 0 else 0
        sbyte = int(s[bad_s]) if bad_s >= 0 else 0
    if bad_s >= 0:
        why = "UE8M0 NaN, invalid" if sbyte == 255 else f"outside {A.MIN_SCALE}..{A.MAX_SCALE}"
        raise ValueError(f"{scale_name}: {tile_name(bad_s, shape)} has scale byte {sbyte} ({why}; spec 2)")
    if bad_c >= 0:
        raise ValueError(f"{codebook_name}: {tile_name(bad_c, shape)} has a NaN codebook entry "
                         f"(index {entry}, byte 0x{byte:02X})")


# ---------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------


def mxfp8_qdq_cpu(x: Any, rule: str):
    """FP32 array of x's shape: quantise-dequantise along the last axis (spec 3)."""
    d = A.dtype_str(x)
    if d == "float16":
        x = x.float() if A.is_torch(x) else x.astype(np.float32)
        d = "float32"
    shape = tuple(x.shape)
    cols = shape[-1] if shape else 1
    rows = (int(np.prod(shape)) // cols) if cols else 0
    if A.is_torch(x):
        torch = A.torch_module()
        out = torch.empty(shape, dtype=torch.float32)
    else:
        out = np.empty(shape, dtype=np.float32)
    if rows * cols == 0:
        return out
    _lutb.mxfp8_qdq_cpu(A.raw(x), "BF16" if d == "bfloat16" else "F32", rows, cols, out, rule)
    return out


def mxfp8_qdq_torch(x: Any, rule: str):
    """The same values from torch operations on any device (the CUDA path): the block scale from the
    exact binary exponent of the block's amax (torch.frexp), elements rounded to E4M3 (nearest even,
    saturating), products with the power-of-two scale in float64 (exact)."""
    torch = A.torch_module()
    shape = tuple(x.shape)
    cols = shape[-1]
    if x.numel() == 0:
        return torch.empty(shape, dtype=torch.float32, device=x.device)
    x2 = x.to(torch.float32).reshape(-1, cols)
    pad = (-cols) % 32
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    xb = x2.to(torch.float64).reshape(x2.shape[0], -1, 32)
    amax = xb.abs().amax(dim=-1)
    mant, ex = torch.frexp(amax)  # amax = mant * 2^ex, mant in [0.5, 1): floor(log2(amax)) = ex - 1
    b = ex.to(torch.int64) - 1 - 8 + 127
    if rule == "rceil":
        b = b + (mant > 0.875).to(torch.int64)  # 448 * 2^(b-127) = 1.75 * 2^(ex-1) must reach amax
    b = b.clamp(0, 254)
    b = torch.where(amax == 0, torch.full_like(b, 127), b)
    b = torch.where(torch.isfinite(amax), b, torch.full_like(b, 255))
    bf = b.to(torch.float64).unsqueeze(-1)
    q = (xb * torch.exp2(127.0 - bf)).clamp(-448.0, 448.0)
    q = q.to(torch.float32).to(torch.float8_e4m3fn).to(torch.float32).to(torch.float64)
    y = (q * torch.exp2(bf - 127.0)).to(torch.float32)
    y = torch.where(bf == 255, torch.full_like(y, float("nan")), y)
    return y.reshape(x2.shape)[:, :cols].reshape(shape).contiguous()


# ---------------------------------------------------------------------------------------------
# Routing (spec 5)
# ---------------------------------------------------------------------------------------------


def _route_outputs(logits: Any, k: int):
    t = logits.shape[0]
    if A.is_torch(logits):
        torch = A.torch_module()
        return (torch.empty((t, k), dtype=torch.int32, device=logits.device),
                torch.empty((t, k), dtype=torch.float32, device=logits.device))
    return np.empty((t, k), dtype=np.int32), np.empty((t, k), dtype=np.float32)


def route_cpu(logits, bias, sigmoid, k, renormalize, n_group, topk_group, scaling):
    ids, weights = _route_outputs(logits, k)
    _lutb.route_cpu(A.raw(logits), logits.shape[0], logits.shape[1], None if bias is None else A.raw(bias), sigmoid, k, renormalize, n_group, topk_group,
                    scaling, ids, weights)
    return ids, weights


def route_softmax_topk_cuda(logits, k, renormalize):
    ids, weights = _route_outputs(logits, k)
    _lutb.route_softmax_topk_cuda(A.raw(logits), logits.shape[0], logits.shape[1], k, renormalize, ids, weights,
                                  A.stream_of(logits))
    return ids, weights


def route_deepseek_cuda(logits, bias, k, n_group, topk_group, renormalize, scaling):
    ids, weights = _route_outputs(logits, k)
    _lutb.route_deepseek_cuda(A.raw(logits), None if bias is None else A.raw(bias), logits.shape[0], logits.shape[1], n_group, topk_group, k, renormalize,
                              scaling, ids, weights, A.stream_of(logits))
    return ids, weights


# ---------------------------------------------------------------------------------------------
# Experts (spec 4 steps 2-6)
# ---------------------------------------------------------------------------------------------


def moe_experts_cpu(x, topk_ids, topk_weights, w13p, w13c, w13s, w2p, w2c, w2s, intermediate, act_format, out):
    t, h = x.shape
    _lutb.moe_experts_cpu(
        A.raw(x), t, h, A.raw(topk_ids), 64 if A.dtype_str(topk_ids) == "int64" else 32, A.raw(topk_weights),
        topk_ids.shape[1], w13p.shape[0], intermediate, *(A.raw(v) for v in (w13p, w13c, w13s, w2p, w2c, w2s)),
        act_format, A.raw(out), A.dtype_str(out) == "float32",
    )


def moe_experts_cuda(x, topk_ids, topk_weights, w13p, w13c, w13s, w2p, w2c, w2s, intermediate, out):
    """The fused kernels; ids >= E (the expert-parallel marker) become expert 0 with weight 0, on the
    device (no host synchronisation); the workspace comes from torch's caching allocator."""
    torch = A.torch_module()
    t, h = x.shape
    k = topk_ids.shape[1]
    e = w13p.shape[0]
    if t == 0:
        return
    local = topk_ids < e
    ids = torch.where(local, topk_ids, torch.zeros_like(topk_ids)).to(torch.int32).contiguous()
    weights = torch.where(local, topk_weights, torch.zeros_like(topk_weights)).contiguous()
    ws = torch.empty(_lutb.moe_workspace_bytes(t, k, e, h, intermediate), dtype=torch.uint8, device=x.device)
    _lutb.moe_experts_cuda(A.raw(x), t, h, ids, A.raw(weights), k, e, intermediate,
                           *(A.raw(v) for v in (w13p, w13c, w13s, w2p, w2c, w2s)), A.raw(out),
                           A.dtype_str(out) == "float32", ws, A.stream_of(x))


def moe_experts_bf16_cuda(x, topk_ids, topk_weights, w13p, w13c, w13s, w2p, w2c, w2s, intermediate, out):
    """act_format="bf16" on CUDA: the library's BF16 kernels on weights dequantised for this call
    (exact in BF16, spec 2; checkpoint-order packed bytes; a baseline, so the BF16 copy is not kept)."""
    torch = A.torch_module()
    t, h = x.shape
    k = topk_ids.shape[1]
    e = w13p.shape[0]
    if h % 64 or intermediate % 64:
        raise ValueError(f"act_format: 'bf16' on CUDA needs H and I multiples of 64 (H = {h}, I = {intermediate})")
    if t == 0:
        return
    w13 = dequantize_torch(w13p, w13c, w13s, (e, 2 * intermediate, h)).to(torch.bfloat16)
    w2 = dequantize_torch(w2p, w2c, w2s, (e, h, intermediate)).to(torch.bfloat16)
    local = topk_ids < e
    ids = torch.where(local, topk_ids, torch.zeros_like(topk_ids)).to(torch.int32).contiguous()
    weights = torch.where(local, topk_weights, torch.zeros_like(topk_weights)).contiguous()
    ws = torch.empty(_lutb.moe_workspace_bytes(t, k, e, h, intermediate), dtype=torch.uint8, device=x.device)
    _lutb.moe_experts_bf16_cuda(A.raw(x), t, h, ids, A.raw(weights), k, e, intermediate, A.raw(w13), A.raw(w2),
                                A.raw(out), A.dtype_str(out) == "float32", ws, A.stream_of(x))


def _lane_slots(device):
    """For lane L = 4g + t and slot j (0..15), the flat tile position g*64 + lane_col(t, j) of
    lutb/cuda/lane_major.hpp, as a [32 * 16] index in (lane, j) order."""
    torch = A.torch_module()
    lane = torch.arange(32, device=device).unsqueeze(1)
    j = torch.arange(16, device=device).unsqueeze(0)
    g, t = lane // 4, lane % 4
    col = torch.where(j < 8, 8 * t + j, 32 + 8 * t + (j - 8))
    return (g * 64 + col).reshape(-1)


def packed_from_lane_major(lm):
    """Checkpoint-order packed bytes from lane-major ones, with torch operations on any device: the
    inverse of the CUDA kernels' permutation (lutb/cuda/lane_major.hpp: per lane L, X = bytes 4L..4L+3
    holds slots 0..7 in its nibbles' low bits and bits 0, 1 of slots 12..15 in nibble bit 3; Y = bytes
    128+2L..129+2L holds slots 8..11 and bit 2 of slots 12..15)."""
    torch = A.torch_module()
    b = lm.reshape(-1, A.PACKED_BYTES).to(torch.int64)
    x = b[:, 0:128:4] | (b[:, 1:128:4] << 8) | (b[:, 2:128:4] << 16) | (b[:, 3:128:4] << 24)  # [tiles, 32]
    y = b[:, 128::2] | (b[:, 129::2] << 8)
    x, y = x.unsqueeze(-1), y.unsqueeze(-1)
    k8 = torch.arange(8, device=lm.device)
    k4 = torch.arange(4, device=lm.device)
    lo = (x >> (4 * k8)) & 7                                             # slots 0..7
    mid = (y >> (4 * k4)) & 7                                            # slots 8..11
    hi = (((x >> (4 * k4 + 3)) & 1) | (((x >> (4 * (k4 + 4) + 3)) & 1) << 1)
          | (((y >> (4 * k4 + 3)) & 1) << 2))                             # slots 12..15
    v = torch.cat([lo, mid, hi], dim=-1).reshape(b.shape[0], 512)         # (lane, j) order
    idx = torch.empty_like(v)
    idx[:, _lane_slots(lm.device)] = v                                    # flat order f = r*64 + c
    word = (idx.reshape(-1, 64, 8) << (3 * k8)).sum(dim=-1)              # 8 indices per 24-bit word
    out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return out.to(torch.uint8).reshape(lm.shape)


def lane_major_cuda(packed):
    """A copy of checkpoint-order packed bytes in the CUDA kernels' lane-major order (lutb/cuda/lane_major.hpp)."""
    out = packed.clone()
    _lutb.packed_to_lane_major(out, out.numel() // A.PACKED_BYTES, A.stream_of(out))
    return out
