"""Array helpers shared by the lutb package: numpy or torch, CPU or CUDA, without importing torch.

Every check raises ``ValueError`` or ``TypeError`` whose message starts with the argument's name.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

TILE_ROWS = 8  # N extent of a LUT-B tile (spec 2)
TILE_COLS = 64  # K extent of a LUT-B tile
PACKED_BYTES = 192  # 512 3-bit indices
CODEBOOK_SIZE = 8  # E4M3 entries per tile
MIN_SCALE, MAX_SCALE = 3, 246  # scale bytes fitters write (spec 2); 255 is invalid


def torch_module():
    """The torch module if it has been imported (lutb never imports it for numpy inputs)."""
    return sys.modules.get("torch")


def is_torch(a: Any) -> bool:
    t = torch_module()
    return t is not None and isinstance(a, t.Tensor)


def is_array(a: Any) -> bool:
    return isinstance(a, np.ndarray) or is_torch(a)


def require_array(a: Any, name: str) -> None:
    if not is_array(a):
        raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(a).__name__}")


def is_cuda(a: Any) -> bool:
    return is_torch(a) and a.device.type == "cuda"


def device_of(a: Any) -> str:
    """'cpu' for numpy arrays, else str(tensor.device) ('cpu', 'cuda:0', ...)."""
    return str(a.device) if is_torch(a) else "cpu"


def require_device(a: Any, name: str) -> None:
    if is_torch(a) and a.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {a.device} is not supported (CPU or CUDA)")


def require_contiguous(a: Any, name: str) -> None:
    ok = a.is_contiguous() if is_torch(a) else a.flags["C_CONTIGUOUS"]
    if not ok:
        raise ValueError(f"{name}: must be contiguous (row-major); call .contiguous() first")


def require_same_device(name: str, ref: Any, ref_name: str, a: Any) -> None:
    if is_torch(a) != is_torch(ref):
        raise TypeError(f"{name}: a {type(a).__name__}, but {ref_name} is a {type(ref).__name__}; "
                        "pass arrays of one kind (torch.from_numpy converts without a copy)")
    if device_of(a) != device_of(ref):
        raise ValueError(f"{name}: on {device_of(a)}, but {ref_name} is on {device_of(ref)}; "
                         "all arguments must be on the same device")


def dtype_str(a: Any) -> str:
    """'float32', 'bfloat16', 'uint8', ... for torch and numpy (ml_dtypes names) alike."""
    if is_torch(a):
        return str(a.dtype).replace("torch.", "")
    return a.dtype.name


def float_source_name(a: Any, name: str) -> str:
    """The safetensors name of a float source dtype (F32, BF16, F16), or TypeError naming `name`."""
    d = dtype_str(a)
    names = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    if d not in names:
        raise TypeError(f"{name}: dtype {d} is not supported (bfloat16, float16 or float32)")
    return names[d]


def raw(a: Any) -> Any:
    """A DLPack-exportable view of the same memory: 16-bit floats as int16, FP8 as uint8; torch
    tensors detached (torch refuses to export a tensor that requires grad; lutb has no autograd)."""
    if is_torch(a):
        a = a.detach()
    d = dtype_str(a)
    if d in ("bfloat16", "float16"):
        t = torch_module()
        return a.view(t.int16) if is_torch(a) else a.view(np.int16)
    if d.startswith("float8"):
        t = torch_module()
        return a.view(t.uint8) if is_torch(a) else a.view(np.uint8)
    return a


def tiles_of(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int, int]:
    """(leading dims, expert count E = their product, tiles along N, tiles along K) of a logical shape."""
    lead = tuple(shape[:-2])
    n, k = shape[-2], shape[-1]
    return lead, math.prod(lead), -(-n // TILE_ROWS), -(-k // TILE_COLS)


def check_shape(shape: Any, name: str) -> tuple[int, ...]:
    """shape as a tuple of ints: a sequence (tuple, list, torch.Size) of ints or numpy integers, bool
    refused; TypeError naming `name` for anything else (a str such as "8,64", a float size), ValueError
    for fewer than 2 sizes or a size < 1."""
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(shape).__name__} {shape!r}")
    try:
        items = tuple(shape)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of ints, got {type(shape).__name__}") from None
    for v in items:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected a sequence of ints, got {shape!r} (holds a {type(v).__name__})")
    s = tuple(int(v) for v in items)
    if len(s) < 2 or any(v < 1 for v in s):
        raise ValueError(f"{name}: {s} is not a logical weight shape (..., N, K) with every size >= 1")
    return s


def stream_of(a: Any) -> int:
    """The current CUDA stream of a CUDA tensor's device, as an int (cudaStream_t)."""
    return torch_module().cuda.current_stream(a.device).cuda_stream
