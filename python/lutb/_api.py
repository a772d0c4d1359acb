"""The public API of lutb (re-exported by lutb/__init__.py). Spec references are to spec/lutb.md."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _arrays as A
from . import _impl as I
from . import _lutb

_LLOYD_FITTERS = ("ct-lloyd", "multistart")  # no GPU kernel: CUDA inputs fit on the CPU
# The fitters with a weighted objective (lutb/fit.hpp FitOptions::column_weights); the Lloyd fitters have none.
_WEIGHTED_FITTERS = ("binned-dp", "optimal")


MAX_THREADS = 4096  # the CLI's --threads range (src/cli/validators.hpp ThreadCount)


def _int_arg(v: Any, name: str) -> int:
    """v as an int (Python or numpy integer; bool refused), or TypeError naming `name`."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    return int(v)


def _float_arg(v: Any, name: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
    return float(v)


def _bool_arg(v: Any, name: str) -> bool:
    """v as a bool (Python or numpy bool), or TypeError naming `name`: bool("False") is True."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
    return bool(v)


def _str_arg(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected a str, got {type(v).__name__}")
    return v


def _check_quantize(w: Any, fitter: Any, forced_scale: Any, threads: Any, name: Any,
                    column_weights: Any = None, second_moments: Any = None,
                    damping: Any = 0.01) -> tuple[int, int, Any, Any, float]:
    """The checks of lutb.quantize (also run by torch.ops.lutb.quantize); returns (forced_scale,
    threads, column_weights as a contiguous float32 [E, K] array of w's kind and device or None,
    second_moments as a contiguous float32 [E, K, K] CPU array of w's kind or None, damping)."""
    A.require_array(w, "w")
    A.require_device(w, "w")
    A.float_source_name(w, "w")
    A.check_shape(tuple(w.shape), "w.shape")
    A.require_contiguous(w, "w")
    _lutb.check_fitter_name(_str_arg(fitter, "fitter"))
    forced_scale = _int_arg(forced_scale, "forced_scale")
    if forced_scale != -1 and not (A.MIN_SCALE <= forced_scale <= A.MAX_SCALE):
        raise ValueError(f"forced_scale: {forced_scale} is not -1 or a scale byte 3..246")
    threads = _int_arg(threads, "threads")
    if not 0 <= threads <= MAX_THREADS:
        raise ValueError(f"threads: {threads} is not in 0..{MAX_THREADS} (0 = all cores)")
    _str_arg(name, "name")
    cw = _check_column_weights(column_weights, w, fitter)
    damping = _float_arg(damping, "damping")
    if not (np.isfinite(damping) and damping >= 0):
        raise ValueError(f"damping: {damping} is not finite and >= 0")
    return forced_scale, threads, cw, _check_second_moments(second_moments, w, fitter), damping


def _check_fit_statistics(a: Any, name: str, w: Any, fitter: str, need: str) -> None:
    """The checks column_weights and second_moments share: an array of w's kind and device, float32,
    and a fitter with a weighted objective (`need` words the refusal: "column weights need")."""
    A.require_array(a, name)
    A.require_device(a, name)
    A.require_same_device(name, w, "w", a)
    if A.dtype_str(a) != "float32":
        raise TypeError(f"{name}: dtype {A.dtype_str(a)} is not float32")
    if fitter not in _WEIGHTED_FITTERS:
        raise ValueError(f"{name}: fitter {fitter!r} has no weighted objective; {need} "
                         f"{' or '.join(repr(f) for f in _WEIGHTED_FITTERS)}")


def _check_column_weights(cw: Any, w: Any, fitter: str) -> Any:
    """column_weights of lutb.quantize: None, or float32 [K] or [E, K] (E = the experts of w's stack,
    the product of its leading sizes; [K] is used for every expert) of w's kind and device, every value
    finite and > 0 (lutb/fit.hpp FitOptions::column_weights). Returns a contiguous [E, K] array (a copy
    when broadcast or strided) or None. Reading the values synchronises on CUDA."""
    if cw is None:
        return None
    _check_fit_statistics(cw, "column_weights", w, fitter, "column weights need")
    shape = tuple(int(v) for v in w.shape)
    _, e, _, _ = A.tiles_of(shape)
    k = shape[-1]
    got = tuple(int(v) for v in cw.shape)
    if got not in ((k,), (e, k)):
        raise ValueError(f"column_weights: shape {got} is not [K] = ({k},) or [E, K] = ({e}, {k}) for w of shape "
                         f"{shape}")
    if A.is_torch(cw):
        torch = A.torch_module()
        bad = torch.nonzero(~((cw > 0) & torch.isfinite(cw)).reshape(-1)).flatten()
        first = int(bad[0].item()) if bad.numel() else -1
        value = float(cw.reshape(-1)[first].item()) if first >= 0 else 0.0
        full = cw.expand(e, k).contiguous()
    else:
        bad = np.flatnonzero(~((cw > 0) & np.isfinite(cw)))
        first = int(bad[0]) if bad.size else -1
        value = float(cw.reshape(-1)[first]) if first >= 0 else 0.0
        full = np.broadcast_to(cw, (e, k))
        if not (full.flags["C_CONTIGUOUS"] and full.flags["WRITEABLE"]):  # the binding takes writeable arrays
            full = np.array(full, order="C")
    if first >= 0:
        where = f"column {first}" if len(got) == 1 else f"expert {first // k}, column {first % k}"
        raise ValueError(f"column_weights: {where} is {np.float32(value)}; column weights must be finite and > 0")
    return full


def _check_second_moments(sm: Any, w: Any, fitter: str) -> Any:
    """second_moments of lutb.quantize: None, or float32 [K, K] or [E, K, K] (E as for column_weights;
    [K, K] is used for every expert) of w's kind, on the CPU with w (the fit with error feedback has
    no GPU fitter), every value finite and the diagonal >= 0 (lutb/fit.hpp
    FitOptions::error_feedback). Returns a contiguous [E, K, K] array (a copy when broadcast or
    strided) or None."""
    if sm is None:
        return None
    if A.is_cuda(w):
        raise ValueError("second_moments: the fit with cross-column error feedback runs on the CPU only (it has no "
                         "GPU fitter); quantize w.cpu() and move the result with .to(device), or pass "
                         "second_moments=None for the GPU fit with the column weights alone")
    _check_fit_statistics(sm, "second_moments", w, fitter, "error feedback needs")
    shape = tuple(int(v) for v in w.shape)
    _, e, _, _ = A.tiles_of(shape)
    k = shape[-1]
    got = tuple(int(v) for v in sm.shape)
    if got not in ((k, k), (e, k, k)):
        raise ValueError(f"second_moments: shape {got} is not [K, K] = ({k}, {k}) or [E, K, K] = ({e}, {k}, {k}) "
                         f"for w of shape {shape}")
    if A.is_torch(sm):
        sm_np = sm.detach().numpy()
        full = sm.detach().expand(e, k, k).contiguous()
    else:
        sm_np = sm
        full = np.broadcast_to(sm, (e, k, k))
        if not (full.flags["C_CONTIGUOUS"] and full.flags["WRITEABLE"]):  # the binding takes writeable arrays
            full = np.array(full, order="C")
    bad = np.flatnonzero(~np.isfinite(sm_np) | (np.eye(k, dtype=bool) & (sm_np < 0)))
    if bad.size:
        first = int(bad[0])
        value = np.float32(sm_np.reshape(-1)[first])
        i, j = first // k % k, first % k
        where = f"[{i}][{j}]" if len(got) == 2 else f"expert {first // (k * k)}, [{i}][{j}]"
        raise ValueError(f"second_moments: {where} is {value}; second moments must be finite, the diagonal >= 0")
    return full


def _check_lutb_tensors(arrays: tuple[Any, Any, Any], names: tuple[str, str, str], shape: Any,
                        ok_dtypes: tuple[tuple[str, ...], ...]) -> tuple[int, ...]:
    """Kinds, devices, dtypes, sizes and contiguity of (packed, codebook, scale) for a logical shape."""
    for a, n in zip(arrays, names):
        A.require_array(a, n)
        A.require_device(a, n)
    for a, n in zip(arrays[1:], names[1:]):
        A.require_same_device(n, arrays[0], names[0], a)
    s = A.check_shape(shape, "shape")
    lead, _, tn, tk = A.tiles_of(s)
    want = (lead + (tn, tk, A.PACKED_BYTES), lead + (tn, tk, A.CODEBOOK_SIZE), lead + (tn, tk))
    for a, n, w, d in zip(arrays, names, want, ok_dtypes):
        if A.dtype_str(a) not in d:
            raise TypeError(f"{n}: dtype {A.dtype_str(a)} is not {' or '.join(d)}")
        if tuple(a.shape) != w:
            raise ValueError(f"{n}: shape {tuple(a.shape)} does not match the logical shape {s}: expected {w} "
                             f"(spec 2.2: N, K padded to multiples of 8 and 64)")
        A.require_contiguous(a, n)
    return s


def _check_mxfp8(x: Any, rule: Any) -> None:
    A.require_array(x, "x")
    A.require_device(x, "x")
    A.float_source_name(x, "x")
    if len(x.shape) < 1:
        raise ValueError("x: needs at least one dimension (blocks run along the last)")
    A.require_contiguous(x, "x")
    if rule not in ("rceil", "floor"):
        raise ValueError(f"rule: {rule!r} is not 'rceil' or 'floor'")


def _ops():
    return A.torch_module().ops.lutb


def fitter_names() -> list[str]:
    """Names of the fitters (spec 2.1), the default first."""
    return list(_lutb.fitter_names())


def default_fitter() -> str:
    """Name of the default fitter ("binned-dp")."""
    return _lutb.default_fitter()


# Read once at import: a Python constant, so torch.compile traces the CUDA branches of quantize and
# moe_experts without calling into the extension (dynamo cannot trace a nanobind function).
_HAS_CUDA = bool(_lutb.has_cuda())


def has_cuda() -> bool:
    """Whether this build of the extension has the CUDA kernels (lutb_cuda)."""
    return _HAS_CUDA


# ---------------------------------------------------------------------------------------------
# LutbWeight
# ---------------------------------------------------------------------------------------------


class LutbWeight:
    """A LUT-B weight or expert stack (spec 2), as three uint8 arrays of the checkpoint layout (spec 2.2).

    Attributes (torch tensors, or numpy arrays for a weight quantised from numpy; all on one device,
    contiguous):
      packed:   uint8 [..., Np/8, Kp/64, 192], 512 3-bit indices per 8x64 tile in spec 2's bit order
      codebook: uint8 [..., Np/8, Kp/64, 8], E4M3 bytes (view as torch.float8_e4m3fn for the values)
      scale:    uint8 [..., Np/8, Kp/64], UE8M0 bytes, 3..246
      shape:    the logical shape (..., N, K); Np, Kp are N, K rounded up to 8 and 64 (zero padding)
      device:   'cpu', 'cuda:0', ...
    Values: w = e4m3(codebook[index]) * 2^(scale - 127).

    Build one with lutb.quantize or LutbWeight.from_tensors. The constructor LutbWeight(packed,
    codebook, scale, shape) is unchecked (for arrays lutb made): it checks no dtype, size, device,
    scale byte or codebook entry, and bad data gives wrong results rather than an error (a NaN
    codebook byte, 0x7F or 0xFF, decodes as a finite value in moe_experts). Wrap arrays from
    anywhere else with LutbWeight.from_tensors. On CUDA, lutb.moe_experts keeps a copy
    of `packed` in the kernels' lane-major bit order (lutb/cuda/lane_major.hpp; 192 bytes per tile,
    as much as `packed`), made on first use and cached on the object; kernel_packed() makes it ahead
    of time (call it before capturing a CUDA graph), drop_kernel_cache() frees it, and
    release_packed() frees the checkpoint-order bytes instead (then held once, lane-major).
    """

    def __init__(self, packed: Any, codebook: Any, scale: Any, shape: tuple[int, ...]):
        # Unchecked: use from_tensors for data from outside lutb.
        self._packed = packed
        self.codebook = codebook
        self.scale = scale
        self.shape = tuple(shape)
        self._kernel_packed: Any = None

    @property
    def packed(self) -> Any:
        """Checkpoint-order packed bytes; after release_packed(), recomputed from the kernel copy."""
        if self._packed is None:
            return I.packed_from_lane_major(self._kernel_packed)
        return self._packed

    @property
    def device(self) -> str:
        return A.device_of(self.scale)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"LutbWeight(shape={self.shape}, device='{self.device}')"

    # -- construction from checkpoint tensors ---------------------------------------------------
    @classmethod
    def from_tensors(cls, packed: Any, codebook: Any, scale: Any, shape: Any, name: Optional[str] = None
                     ) -> "LutbWeight":
        """Wraps spec 2.2 checkpoint tensors (no copy) after checking them.

        packed: uint8 [..., Np/8, Kp/64, 192]; codebook: uint8 or float8_e4m3fn [..., Np/8, Kp/64, 8]
        (kept as a uint8 view); scale: uint8 (or float8_e8m0fnu) [..., Np/8, Kp/64]; shape: the
        logical (..., N, K), a sequence of ints (tuple, list, torch.Size). All torch tensors or all
        numpy arrays, on one device, contiguous.
        `name` (the projection P) makes errors name the checkpoint tensors (P.weight_scale, ...).
        Raises TypeError naming `shape` when it is not a sequence of ints (a str such as "8,64", a
        float size), ValueError naming it when it has fewer than 2 sizes or a size < 1, and
        TypeError / ValueError naming the tensor: wrong type or dtype, sizes that do not match
        `shape`, devices that differ, a non-contiguous tensor, and (reading the data; on CUDA this
        synchronises) a scale byte outside 3..246 (255 is UE8M0 NaN) or a NaN codebook entry (0x7F,
        0xFF), with the first bad tile.
        """
        names = ((f"{name}.weight_packed", f"{name}.weight_codebook", f"{name}.weight_scale") if name
                 else ("packed", "codebook", "scale"))
        s = _check_lutb_tensors((packed, codebook, scale), names, shape,
                                (("uint8",), ("uint8", "float8_e4m3fn"), ("uint8", "float8_e8m0fnu")))
        codebook, scale = A.raw(codebook), A.raw(scale)
        I.validate_data(codebook, scale, s, names[1], names[2])
        return cls(packed, codebook, scale, s)

    # -- conversions ----------------------------------------------------------------------------
    def dequantize(self, dtype: Any = None) -> Any:
        """The weight of the logical shape (..., N, K), exact for scale bytes 3..246 (spec 2).

        dtype: default torch.bfloat16 for torch tensors (exact), numpy.float32 for numpy arrays;
        any float dtype of the same library (another raises TypeError: an integer dtype would
        truncate the weights). Same device as the weight.
        """
        if A.is_torch(self.scale):
            torch = A.torch_module()
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(f"dtype: {dtype!r} is not a torch float dtype (this weight holds torch tensors)")
            w = _ops().dequantize(self.packed, self.codebook, self.scale, list(self.shape))
            return w.to(torch.bfloat16 if dtype is None else dtype)
        if dtype is not None:
            try:
                d = np.dtype(dtype)
            except TypeError:
                d = None
            # numpy floats, and ml_dtypes' (bfloat16, float8_*), which numpy sees as kind "V"
            if d is None or not (d.kind == "f" or (d.kind == "V" and d.name.startswith(("bfloat", "float")))):
                raise TypeError(f"dtype: {dtype!r} is not a numpy float dtype (this weight holds numpy arrays)")
        w = I.dequantize_cpu(self.packed, self.codebook, self.scale, self.shape)
        return w if dtype is None else w.astype(dtype)

    def to(self, device: Any) -> "LutbWeight":
        """A copy on `device` (torch devices only; numpy weights go to torch with torch.from_numpy first)."""
        if not A.is_torch(self.scale):
            raise TypeError("device: LutbWeight.to needs torch tensors; this weight holds numpy arrays")
        return LutbWeight(self.packed.to(device), self.codebook.to(device), self.scale.to(device), self.shape)

    def tensors(self, prefix: str) -> dict[str, Any]:
        """The spec 2.2 checkpoint tensors of projection `prefix` (P):
        {P.weight_packed: uint8, P.weight_codebook: float8_e4m3fn (torch; numpy: ml_dtypes.float8_e4m3fn
        when ml_dtypes is installed, else uint8), P.weight_scale: uint8}. Views, no copy."""
        if A.is_torch(self.codebook):
            cb = self.codebook.view(A.torch_module().float8_e4m3fn)
        else:
            try:
                import ml_dtypes

                cb = self.codebook.view(ml_dtypes.float8_e4m3fn)
            except ImportError:
                cb = self.codebook
        return {f"{prefix}.weight_packed": self.packed, f"{prefix}.weight_codebook": cb,
                f"{prefix}.weight_scale": self.scale}

    # -- the CUDA kernels' copy -----------------------------------------------------------------
    def kernel_packed(self) -> Any:
        """The packed bytes the experts kernels of this device read: `packed` itself on the CPU, on
        CUDA a lane-major copy (made once, then cached on this object)."""
        if self._kernel_packed is not None:
            return self._kernel_packed
        if not A.is_cuda(self._packed):
            return self._packed
        self._kernel_packed = _ops().lane_major(self._packed)
        return self._kernel_packed

    def drop_kernel_cache(self) -> None:
        """Frees the cached lane-major copy (the next CUDA moe_experts call makes it again). After
        release_packed() the checkpoint-order bytes are restored first."""
        if self._packed is None:
            self._packed = self.packed
        self._kernel_packed = None

    def release_packed(self) -> None:
        """CUDA: keeps only the kernels' lane-major copy, so the index bytes are held once (the
        weight stays at 3.140625 bits per weight on the GPU). `packed` is then recomputed on each
        access (an exact inverse permutation in torch operations; for tensors(), dequantize(), to()).
        No effect on the CPU, where the kernels read `packed` itself."""
        if A.is_cuda(self._packed if self._packed is not None else self._kernel_packed):
            self.kernel_packed()
            self._packed = None


# ---------------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------------


def quantize(w: Any, fitter: Optional[str] = None, *, column_weights: Any = None, second_moments: Any = None,
             damping: float = 0.01, forced_scale: int = -1, threads: int = 0, name: str = "w") -> LutbWeight:
    """Fits a weight [N, K] or a stack [..., N, K] to LUT-B (spec 2.1) and returns a LutbWeight.

    w: torch.Tensor (bfloat16, float16, float32; CPU or CUDA) or numpy.ndarray (float32, float16,
       ml_dtypes.bfloat16), contiguous, every size >= 1. The result lives on w's device and is of
       w's kind (numpy in, numpy out).
    fitter: a name of fitter_names(); None = default_fitter() ("binned-dp"). CPU tensors fit with
       the CPU fitter, CUDA tensors with the GPU fitter ("binned-dp", "optimal"): the same bytes as
       `lutb quantize` gives for the same tensor, on either device. "ct-lloyd" and "multistart" have no
       GPU kernel: CUDA tensors fit on the CPU for them (copied there and back).
    column_weights: None (the data-free fit: each tile's squared error) or the importance d_c > 0 of
       each input column, so that each tile minimises sum_rc d_c (w_rc - w_hat_rc)^2 (docs/calibration.md;
       d_c = E[x_c^2] over the inputs x of the projection; CalibrationStats.column_weights gives them).
       float32, [K] (the same weights for every expert) or [E, K] with E the product of w's leading
       sizes (1 for a 2-D w), of w's kind and on w's device; any strides. Only "binned-dp" and
       "optimal" have a weighted objective. Constant weights give exactly the data-free bytes. The
       bytes are those of the C++ weighted fit (`lutb quantize --calibration --error-feedback off`).
    second_moments: None (each tile fitted on its own) or the second moments C = E[x x^T] of the
       projection's input, for the fit with cross-column error feedback (GPTQ within LUT-B's tiles;
       docs/calibration.md "Cross-column error feedback"; lutb/fit.hpp FitOptions::error_feedback):
       each expert is fitted over K in blocks of 64 columns, and each column's error is fed back
       into the later columns through H = C + damping * mean(diag C) * I.
       float32, [K, K] (the same moments for every expert) or [E, K, K] with E as for column_weights,
       of w's kind, on the CPU (there is no GPU fitter for it: a CUDA w raises ValueError; quantize
       w.cpu() and move the result with .to(device)); any strides. Only the lower triangle is read
       (C is symmetric); every value must be finite and the diagonal >= 0. With column_weights the
       codebooks minimise the weighted objective as above. An expert whose C has a zero diagonal
       (no signal) is fitted without feedback. CalibrationStats.second_moments_for_tensor gives
       them from `lutb calibrate --full-moments` statistics: with the column weights of
       weights_for_tensor, the bytes of `lutb quantize --calibration` (whose default is this fit).
    damping: lambda of H above, a float, finite and >= 0 (GPTQ's dampening; the CLI's 0.01). With 0
       a singular C is refused ("... not positive definite ...; raise the damping"). Unused without
       second_moments.
    forced_scale: -1 (the fitter's own scale) or a scale byte 3..246 for every tile.
    threads: CPU threads, an int 0..4096 (0 = all cores; the CLI's --threads range).
    name: the tensor's name in error messages.
    Integer arguments take Python or numpy integers (not bool); another type raises TypeError naming it.
    Raises TypeError (type, dtype; column_weights or second_moments not float32 or of another kind
    than w; damping not a number) or ValueError (shape, non-contiguous w, unknown fitter, a NaN or
    +-Inf weight or a tile whose magnitude needs a scale byte above 246, named as "quantize: tensor
    NAME, expert e, tile (tn, tk): NaN at row R col C"; column_weights of another shape or device,
    with a Lloyd fitter, or holding a value that is not finite and > 0: "column_weights: expert e,
    column c is 0.0; column weights must be finite and > 0"; second_moments with a CUDA w, of another
    shape or device, with a Lloyd fitter, or holding a value that is not finite or a negative
    diagonal: "second_moments: expert e, [i][j] is nan; second moments must be finite, the diagonal
    >= 0"; damping negative or not finite; moments whose H is not positive definite: "quantize:
    tensor NAME, expert e: the second moments plus damping ... are not positive definite ...").
    On CUDA this synchronises once to read the error flag, and once more to check column_weights.
    """
    fitter = default_fitter() if fitter is None else fitter
    forced_scale, threads, cw, sm, damping = _check_quantize(w, fitter, forced_scale, threads, name, column_weights,
                                                             second_moments, damping)
    shape = tuple(int(v) for v in w.shape)
    if A.is_cuda(w):
        if not has_cuda():
            raise ValueError("w: a CUDA tensor, but this lutb build has no CUDA kernels (built without nvcc)")
        if fitter in _LLOYD_FITTERS:  # never with column weights (refused above)
            return quantize(w.cpu(), fitter, forced_scale=forced_scale, threads=threads, name=name).to(w.device)
    if A.is_torch(w):
        p, c, s = _ops().quantize(w, fitter, forced_scale, threads, name, cw, sm, damping)
    else:
        p, c, s = I.quantize_cpu(w, fitter, forced_scale, threads, name, cw, sm, damping)
    return LutbWeight(p, c, s, shape)


def packed_from_lane_major(kernel_packed: Any) -> Any:
    """Checkpoint-order packed bytes (spec 2) from the CUDA kernels' lane-major copy
    (LutbWeight.kernel_packed(); lutb/cuda/lane_major.hpp): the exact inverse permutation, tile by tile.

    kernel_packed: uint8 torch.Tensor [..., 192] (any leading shape, e.g. [..., Np/8, Kp/64, 192]),
       on any device. Returns a new uint8 tensor of the same shape and device, computed with torch
       operations (no host synchronisation).
    Raises TypeError (not a uint8 torch.Tensor) or ValueError (last size not 192).
    """
    if not A.is_torch(kernel_packed):
        raise TypeError(f"kernel_packed: expected a uint8 torch.Tensor, got {type(kernel_packed).__name__}")
    if A.dtype_str(kernel_packed) != "uint8":
        raise TypeError(f"kernel_packed: dtype {A.dtype_str(kernel_packed)} is not uint8")
    if kernel_packed.dim() < 1 or kernel_packed.shape[-1] != A.PACKED_BYTES:
        raise ValueError(f"kernel_packed: shape {tuple(kernel_packed.shape)} does not end in {A.PACKED_BYTES} "
                         "(the packed bytes of one tile)")
    return I.packed_from_lane_major(kernel_packed)


# ---------------------------------------------------------------------------------------------
# MXFP8 and routing
# ---------------------------------------------------------------------------------------------


def mxfp8_qdq(x: Any, rule: str = "rceil") -> Any:
    """MXFP8 quantise-dequantise along the last axis (spec 3): blocks of 32, one UE8M0 scale each,
    E4M3 elements (nearest even, saturating); a ragged last block is zero-padded; a block with NaN
    or +-Inf decodes to NaN.

    x: torch.Tensor (CPU or CUDA) or numpy.ndarray, bfloat16 / float16 / float32, ndim >= 1, contiguous.
    rule: "rceil" (default: NVIDIA hardware) or "floor" (OCP reference).
    Returns float32 of x's shape on x's device (the values are exact in FP32).
    """
    _check_mxfp8(x, rule)
    if A.is_torch(x):
        return _ops().mxfp8_qdq(x, rule)
    return I.mxfp8_qdq_cpu(x, rule)


def _router_logits(logits: Any) -> Any:
    A.require_array(logits, "logits")
    A.require_device(logits, "logits")
    A.float_source_name(logits, "logits")
    if len(logits.shape) != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits: shape {tuple(logits.shape)} is not [T, E] with E >= 1")
    A.require_contiguous(logits, "logits")
    if A.dtype_str(logits) != "float32":
        logits = logits.float() if A.is_torch(logits) else logits.astype(np.float32)
    return logits


def _check_k(k: Any, experts: int, cuda: bool) -> int:
    k = _int_arg(k, "k")
    if not 1 <= k <= experts:
        raise ValueError(f"k: {k} is not in 1..{experts} (the number of experts)")
    if cuda and (k > 32 or experts > 1024):
        raise ValueError(f"k: the CUDA router handles k <= 32 and E <= 1024 (k={k}, E={experts})")
    return k


def _check_deepseek(logits: Any, correction_bias: Any, k: Any, n_group: Any, topk_group: Any,
                    routed_scaling_factor: Any):
    """The checks of route_deepseek (also run by torch.ops.lutb.route_deepseek): float32 logits and
    bias (widened exactly), k, n_group, topk_group as ints, and a finite routed_scaling_factor."""
    logits = _router_logits(logits)
    scaling = _float_arg(routed_scaling_factor, "routed_scaling_factor")
    if not np.isfinite(scaling):
        raise ValueError(f"routed_scaling_factor: {scaling} is not finite")
    e = int(logits.shape[1])
    k = _check_k(k, e, A.is_cuda(logits))
    n_group = _int_arg(n_group, "n_group")
    topk_group = _int_arg(topk_group, "topk_group")
    if n_group < 1 or e % n_group != 0 or e // n_group < 2:
        raise ValueError(f"n_group: {n_group} does not split E={e} experts into groups of >= 2")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: {topk_group} is not in 1..n_group={n_group}")
    if k > topk_group * (e // n_group):
        raise ValueError(f"k: {k} exceeds the experts of topk_group={topk_group} groups ({topk_group * (e // n_group)})")
    if correction_bias is not None:
        A.require_array(correction_bias, "correction_bias")
        A.require_same_device("correction_bias", logits, "logits", correction_bias)
        A.float_source_name(correction_bias, "correction_bias")
        if tuple(correction_bias.shape) != (e,):
            raise ValueError(f"correction_bias: shape {tuple(correction_bias.shape)} is not ({e},)")
        if A.dtype_str(correction_bias) != "float32":
            correction_bias = (correction_bias.float() if A.is_torch(correction_bias)
                               else correction_bias.astype(np.float32))
        A.require_contiguous(correction_bias, "correction_bias")
    return logits, correction_bias, k, n_group, topk_group


def route_softmax_topk(logits: Any, k: int, renormalize: bool = True) -> tuple[Any, Any]:
    """softmax top-k routing (spec 5; Mixtral, Qwen2/3-MoE, OLMoE).

    logits: [T, E] float (bfloat16/float16 are widened to float32 exactly), torch (CPU or CUDA) or numpy.
    Returns (topk_ids int32 [T, k], topk_weights float32 [T, k]) on logits' device, each row in
    descending probability (ties: lower expert); weights renormalised to sum 1 when `renormalize`.
    Raises TypeError / ValueError naming the argument: type, dtype, shape, non-contiguous logits, k
    outside 1..E (on CUDA also k > 32 or E > 1024), renormalize not a bool.
    Values are not checked (reading them would synchronise on CUDA): a row of logits holding a NaN or
    +Inf, or only -Inf, has NaN probabilities, so its ids are 0..k-1 (the tie order) and its weights
    NaN; CPU and CUDA give the same ids.
    """
    logits = _router_logits(logits)
    k = _check_k(k, int(logits.shape[1]), A.is_cuda(logits))
    renormalize = _bool_arg(renormalize, "renormalize")
    if A.is_torch(logits):
        return _ops().route_softmax_topk(logits, k, renormalize)
    return I.route_cpu(logits, None, False, k, renormalize, 1, 1, 1.0)


def route_deepseek(logits: Any, correction_bias: Any, k: int, n_group: int, topk_group: int,
                   renormalize: bool = True, routed_scaling_factor: float = 1.0) -> tuple[Any, Any]:
    """DeepSeek-V3 grouped sigmoid top-k routing (spec 5; Kimi K2 too).

    logits: [T, E] float; correction_bias: [E] float or None (zeros), same device. E % n_group == 0,
    at least 2 experts per group, 1 <= topk_group <= n_group, k <= topk_group * E / n_group.
    Returns (topk_ids int32 [T, k], topk_weights float32 [T, k]): weights are sigmoid(logits) of the
    chosen experts, divided by their sum when `renormalize`, times routed_scaling_factor.
    Raises TypeError / ValueError naming the argument: types, dtypes, shapes, devices that differ,
    non-contiguous tensors, k, n_group or topk_group out of range, a routed_scaling_factor that is not
    a finite number, renormalize not a bool.
    Values are not checked (reading them would synchronise on CUDA): a NaN logit or correction_bias
    entry ranks its expert below every number, in its group's score and in the choice (chosen only
    when the kept groups hold fewer than k others; ties: lower expert), and a chosen expert with a
    NaN logit has weight NaN, which makes the whole row NaN when `renormalize`; CPU and CUDA give the
    same ids. Logits of +-Inf have sigmoid 1 and 0.
    """
    logits, correction_bias, k, n_group, topk_group = _check_deepseek(logits, correction_bias, k, n_group,
                                                                      topk_group, routed_scaling_factor)
    renormalize = _bool_arg(renormalize, "renormalize")
    if A.is_torch(logits):
        return _ops().route_deepseek(logits, correction_bias, k, n_group, topk_group, renormalize,
                                     float(routed_scaling_factor))
    return I.route_cpu(logits, correction_bias, True, k, renormalize, n_group, topk_group,
                       float(routed_scaling_factor))


# ---------------------------------------------------------------------------------------------
# Experts
# ---------------------------------------------------------------------------------------------


def moe_experts(x: Any, topk_ids: Any, topk_weights: Any, w13: LutbWeight, w2: LutbWeight,
                act_format: str = "mxfp8", out: Any = None) -> Any:
    """The routed experts of a LUT-B MoE layer, spec 4 steps 2-6:
    a = mxfp8_qdq(x); g, u = a . w13[e]^T; h = mxfp8_qdq(bf16(silu(g) * u)); y = h . w2[e]^T;
    out = bf16(sum_j topk_weights[:, j] * y_j) (FP32 sums). act_format="bf16" drops both MXFP8 steps
    (a baseline; on CUDA it runs the library's BF16 kernels on weights dequantised for each call, exact
    but not packed, and needs H and I multiples of 64).

    x: torch bfloat16 [T, H], contiguous, CPU or CUDA.
    topk_ids: int32 or int64 [T, k] (torch.topk's int64 is fine). Ids are local expert ids; an id >= E
       (transformers' expert-parallel marker for experts of other ranks) contributes nothing. A
       negative id raises ValueError on the CPU; on CUDA it is not checked (no host synchronisation)
       and gives NaN rows.
    topk_weights: float32 [T, k] (bfloat16 / float16 are widened exactly).
    w13: LutbWeight [E, 2I, H] (gate rows 0..I-1, then up); w2: LutbWeight [E, H, I]; same device as x.
       CUDA needs I % 8 == 0.
    out: optional [T, H] on x's device to write into (then returned); else a new bfloat16 tensor.
       bfloat16, or float32: the FP32 sums of step 6 before their BF16 rounding, so that partial sums
       over disjoint experts (expert parallelism, lutb.distributed) are rounded once after they are
       added.
    Runs on the current stream of x's device with no host synchronisation (CUDA-graph capturable once
    w13.kernel_packed() and w2.kernel_packed() have run), through torch.ops.lutb.moe_experts(_out).
    CUDA and CPU results agree up to the order of FP32 additions.
    Raises TypeError / ValueError naming the argument: types, dtypes, shapes, devices that differ,
    non-contiguous tensors, an unknown act_format. torch.ops.lutb.moe_experts(_out) called directly
    check their tensors the same way (naming w13_packed, ..., w2_scale).
    Values are not checked (as in torch's own operators and FlashInfer's MoE kernels): reading them
    would synchronise with the host. A token whose row of x or of topk_weights holds NaN or +-Inf gets
    NaN or +-Inf in its output row, as does one whose GEMM sums overflow FP32; a slot whose id is >= E
    contributes nothing, whatever its weight.
    No autograd: the result requires grad when x or topk_weights does, but backward() through it
    raises RuntimeError("moe_experts: no backward ..."); run inference under torch.no_grad() or
    torch.inference_mode().
    """
    if not A.is_torch(x):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    torch = A.torch_module()
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: dtype {A.dtype_str(x)} is not bfloat16")
    if x.dim() != 2:
        raise ValueError(f"x: shape {tuple(x.shape)} is not [T, H]")
    A.require_device(x, "x")
    A.require_contiguous(x, "x")
    t, h = (int(v) for v in x.shape)
    for v, n in ((w13, "w13"), (w2, "w2")):
        if not isinstance(v, LutbWeight):
            raise TypeError(f"{n}: expected a LutbWeight, got {type(v).__name__}")
        if not A.is_torch(v.scale):
            raise TypeError(f"{n}: holds numpy arrays; wrap them with torch.from_numpy (LutbWeight.from_tensors)")
        if len(v.shape) != 3:
            raise ValueError(f"{n}: shape {v.shape} is not 3-D [E, N, K]")
        A.require_same_device(n, x, "x", v.scale)
    e, two_i, h13 = w13.shape
    if h13 != h:
        raise ValueError(f"w13: shape {w13.shape} has K={h13}, x has H={h} columns")
    if two_i % 2:
        raise ValueError(f"w13: shape {w13.shape} has an odd row count (expected [E, 2I, H])")
    inter = two_i // 2
    if w2.shape != (e, h, inter):
        raise ValueError(f"w2: shape {w2.shape} is not (E, H, I) = {(e, h, inter)} from w13 {w13.shape}")
    # Non-tensors here would meet torch's schema check first; the rest of topk_ids, topk_weights and
    # out is checked by the operator (_check_experts_op).
    if not A.is_torch(topk_ids):
        raise TypeError(f"topk_ids: expected an int32 or int64 torch.Tensor, got "
                        f"{A.dtype_str(topk_ids) if A.is_array(topk_ids) else type(topk_ids).__name__}")
    if not A.is_torch(topk_weights):
        raise TypeError(f"topk_weights: expected a torch.Tensor, got {type(topk_weights).__name__}")
    if act_format not in ("mxfp8", "bf16"):
        raise ValueError(f"act_format: {act_format!r} is not 'mxfp8' or 'bf16'")
    cuda = A.is_cuda(x)
    if cuda:
        if not has_cuda():
            raise ValueError("x: a CUDA tensor, but this lutb build has no CUDA kernels (built without nvcc)")
        if act_format == "bf16" and (h % 64 or inter % 64):
            raise ValueError(f"act_format: 'bf16' on CUDA needs H and I multiples of 64 (H = {h}, I = {inter})")
        if inter % 8:
            raise ValueError(f"w13: the CUDA kernels need I % 8 == 0 (I = {inter})")
    lane_major = cuda and act_format == "mxfp8"
    p13 = w13.kernel_packed() if lane_major else w13.packed
    p2 = w2.kernel_packed() if lane_major else w2.packed
    args = (x, topk_ids, topk_weights, p13, w13.codebook, w13.scale, p2, w2.codebook, w2.scale, inter, act_format,
            lane_major)
    if out is None:
        return _ops().moe_experts(*args)
    if not A.is_torch(out):
        raise ValueError(f"out: expected a bfloat16 or float32 torch.Tensor of shape ({t}, {h})")
    _ops().moe_experts_out(*args, out)
    return out


def _check_experts_op(x: Any, topk_ids: Any, topk_weights: Any, p13: Any, c13: Any, s13: Any, p2: Any, c2: Any,
                      s2: Any, intermediate: Any, act_format: Any, lane_major: Any, out: Any = None) -> Any:
    """The checks of torch.ops.lutb.moe_experts(_out) called directly (lutb.moe_experts checks the
    same before it calls them); returns topk_weights as float32 (widened exactly)."""
    torch = A.torch_module()
    if not A.is_torch(x):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: dtype {A.dtype_str(x)} is not bfloat16")
    if x.dim() != 2:
        raise ValueError(f"x: shape {tuple(x.shape)} is not [T, H]")
    A.require_device(x, "x")
    A.require_contiguous(x, "x")
    t, h = (int(v) for v in x.shape)
    inter = _int_arg(intermediate, "intermediate")
    if inter < 1:
        raise ValueError(f"intermediate: {inter} < 1")
    if not A.is_torch(p13) or p13.dim() != 4:
        raise ValueError(f"w13_packed: expected a uint8 torch.Tensor [E, 2I/8, H/64, 192], got "
                         f"{tuple(p13.shape) if A.is_array(p13) else type(p13).__name__}")
    e = int(p13.shape[0])
    u8 = (("uint8",),) * 3
    for ts, pre, shape in (((p13, c13, s13), "w13", (e, 2 * inter, h)), ((p2, c2, s2), "w2", (e, h, inter))):
        names = (f"{pre}_packed", f"{pre}_codebook", f"{pre}_scale")
        for a, n in zip(ts, names):
            A.require_array(a, n)
            A.require_same_device(n, x, "x", a)
        _check_lutb_tensors(ts, names, shape, u8)
    if not A.is_torch(topk_ids) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids: expected an int32 or int64 torch.Tensor, got "
                        f"{A.dtype_str(topk_ids) if A.is_array(topk_ids) else type(topk_ids).__name__}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids: shape {tuple(topk_ids.shape)} is not [T={t}, k]")
    k = int(topk_ids.shape[1])
    if not A.is_torch(topk_weights):
        raise TypeError(f"topk_weights: expected a torch.Tensor, got {type(topk_weights).__name__}")
    A.float_source_name(topk_weights, "topk_weights")
    if tuple(topk_weights.shape) != (t, k):
        raise ValueError(f"topk_weights: shape {tuple(topk_weights.shape)} is not (T, k) = {(t, k)}")
    for a, n in ((topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
        A.require_same_device(n, x, "x", a)
        A.require_contiguous(a, n)
    if act_format not in ("mxfp8", "bf16"):
        raise ValueError(f"act_format: {act_format!r} is not 'mxfp8' or 'bf16'")
    if A.is_cuda(x):
        if not has_cuda():
            raise ValueError("x: a CUDA tensor, but this lutb build has no CUDA kernels (built without nvcc)")
        if inter % 8:
            raise ValueError(f"w13: the CUDA kernels need I % 8 == 0 (I = {inter})")
    if out is not None:
        if not A.is_torch(out) or out.dtype not in (torch.bfloat16, torch.float32) or tuple(out.shape) != (t, h):
            raise ValueError(f"out: expected a bfloat16 or float32 torch.Tensor of shape ({t}, {h})")
        A.require_same_device("out", x, "x", out)
        A.require_contiguous(out, "out")
    return topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
