"""lutb: LUT-B MoE expert weights (spec/lutb.md) from Python.

LUT-B stores each 8x64 weight tile as 512 3-bit indices into an 8-entry E4M3 codebook with one
UE8M0 scale (3.140625 bits per weight). This package fits weights to it and runs routed experts with
the emulated Rubin numerics of the C++ library (CPU kernels, and Ampere / Hopper CUDA kernels when
built with nvcc).

  quantize(w, fitter=None, column_weights=None) -> LutbWeight   fit [..., N, K] (spec 2.1), optionally
                                                   weighted by input column (docs/calibration.md)
  CalibrationStats(path)                           statistics of `lutb calibrate`, column weights
  LutbWeight.from_tensors(packed, codebook, scale, shape)   checkpoint tensors (spec 2.2)
  packed_from_lane_major(kernel_packed)            checkpoint-order bytes from the CUDA kernels' copy
  mxfp8_qdq(x, rule="rceil")                       MXFP8 quantise-dequantise (spec 3)
  route_softmax_topk / route_deepseek              routing (spec 5)
  moe_experts(x, topk_ids, topk_weights, w13, w2)  experts, spec 4 steps 2-6

Arrays are torch tensors (CPU or CUDA) or numpy arrays; they cross into C++ by DLPack without a
copy. torch is optional: when it is installed, importing lutb imports it and registers the
operators torch.ops.lutb.* (torch.compile and CUDA graphs see them as single opaque nodes).
"""

from __future__ import annotations

import importlib.util as _ilu

from ._api import (
    LutbWeight,
    default_fitter,
    fitter_names,
    has_cuda,
    moe_experts,
    mxfp8_qdq,
    packed_from_lane_major,
    quantize,
    route_deepseek,
    route_softmax_topk,
)
from ._calibration import CalibrationLayer, CalibrationStats

__version__ = "0.1.0"

__all__ = [
    "CalibrationLayer",
    "CalibrationStats",
    "LutbWeight",
    "default_fitter",
    "fitter_names",
    "has_cuda",
    "moe_experts",
    "mxfp8_qdq",
    "packed_from_lane_major",
    "quantize",
    "route_deepseek",
    "route_softmax_topk",
]

if _ilu.find_spec("torch") is not None:
    from . import _ops  # noqa: F401  (registers torch.ops.lutb.*)
