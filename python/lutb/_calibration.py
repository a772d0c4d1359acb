"""Calibration statistics of `lutb calibrate` (docs/calibration.md), read by the C++ reader.

CalibrationStats wraps lutb::CalibrationStats (lutb/calibration.hpp) through the extension: the
file's checks, the column weights, the second moments and the rule for rarely routed experts are the
C++ library's, so lutb.quantize(w, column_weights=..., second_moments=...) with them gives the bytes
of `lutb quantize --calibration` (second_moments=None: those of `--error-feedback off`).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any, NamedTuple, Optional

import numpy as np

from . import _lutb

PROJECTIONS = ("gate_up", "down")  # the input of w13 (gate and up) and of w2 (down)


class CalibrationLayer(NamedTuple):
    """The statistics of one MoE layer as stored (means over the tokens routed to each expert).

    layer: the layer index L; prefix: the checkpoint's name prefix of the layer's experts
    ("model.layers.L.mlp.experts", Mixtral "model.layers.L.block_sparse_moe.experts");
    experts, hidden, intermediate: E, hidden_size, moe_intermediate_size;
    tokens: float32 [E], the tokens routed to each expert;
    gate_up_x2: float32 [E, hidden], E[x_c^2] of the experts' input;
    down_x2: float32 [E, intermediate], E[h_c^2] of down's input h = bf16(silu(g) * u);
    full_moments: whether the file holds the layer's full second moments (`lutb calibrate
    --full-moments`; CalibrationStats.second_moments reads them).
    """

    layer: int
    prefix: str
    experts: int
    hidden: int
    intermediate: int
    tokens: np.ndarray
    gate_up_x2: np.ndarray
    down_x2: np.ndarray
    full_moments: bool = False


def _int(v: Any, name: str) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    return int(v)


class CalibrationStats:
    """The calibration statistics file of `lutb calibrate -o STATS.safetensors` (docs/calibration.md).

    CalibrationStats(path) reads the file's diagonal statistics (a few KiB per layer) with the C++
    reader; the full second moments of `lutb calibrate --full-moments` (hidden_size^2 +
    moe_intermediate_size^2 floats per expert) are only checked by name, dtype and shape, and read a
    layer at a time when second_moments() asks for them.
    Raises OSError (FileNotFoundError, IsADirectoryError, PermissionError) naming the path when it
    cannot be read, TypeError when path is not a str or os.PathLike, and ValueError naming the file
    and the tensor for a file that is not calibration statistics: a tensor name that is not
    PREFIX.E.{gate_up.x2, down.x2, tokens}, a dtype other than F32, a negative or non-finite value,
    experts of one layer with different column counts, a missing statistic.

    Attributes:
        path: the file read (str).
        metadata: the file's safetensors metadata (dict of str): "format" ("lutb-calibration"),
            "model", "tokens_file", "tokens", "down_input", ...
        model: metadata["model"], the model folder the statistics were collected on (None if absent).
        tokens: the number of calibration tokens (int; None if absent).
        layers: the indices of the MoE layers with statistics, ascending (tuple of int).
        has_second_moments: whether every layer has the full second moments (bool): then
            `lutb quantize --calibration` and lutb.hf.LutbConfig(calibration=...) fit with
            cross-column error feedback by default.
    """

    def __init__(self, path: "str | os.PathLike[str]"):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        st = os.stat(path)  # FileNotFoundError / PermissionError naming the path
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a calibration statistics file", path)
        if not os.access(path, os.R_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        self._stats = _lutb.CalibrationStats.load(path)
        self.path = path
        self.metadata = dict(self._stats.metadata)
        self.layers = tuple(self._stats.layer_indices())

    @property
    def has_second_moments(self) -> bool:
        return bool(self._stats.has_second_moments())

    @property
    def model(self) -> Optional[str]:
        return self.metadata.get("model")

    @property
    def tokens(self) -> Optional[int]:
        t = self.metadata.get("tokens")
        return int(t) if t is not None and t.isdigit() else None

    def __repr__(self) -> str:
        return f"CalibrationStats(path={self.path!r}, model={self.model!r}, tokens={self.tokens}, layers={self.layers})"

    def layer(self, layer: int) -> CalibrationLayer:
        """The stored statistics of MoE layer `layer` (copies). ValueError when it has none."""
        layer = _int(layer, "layer")
        prefix, e, h, i, tokens, gate_up, down, full = self._stats.layer(layer)
        return CalibrationLayer(layer, prefix, int(e), int(h), int(i), tokens.reshape(-1), gate_up, down, bool(full))

    def column_weights(self, layer: int, projection: str) -> np.ndarray:
        """The column weights of the weighted fit of layer `layer`'s experts, by the C++ rule
        (CalibrationStats::column_weights; docs/calibration.md "rarely routed experts"): each
        expert's statistics blended with the layer's by token count, divided by their mean over the
        columns, raised to at least 1e-3; all ones for a layer no calibration token reached.

        projection: "gate_up" (the input of w13 = [gate; up], K = hidden_size) or "down" (the input
        of w2, K = moe_intermediate_size).
        Returns float32 [E, K] (finite, >= 1e-3, mean 1 per expert or all 1), a new numpy array; pass
        row e as lutb.quantize(w_e, column_weights=...) for expert e's [N, K] weight, or the whole
        array for the stack [E, N, K].
        Raises ValueError: no statistics for `layer`, or projection not "gate_up" / "down".
        """
        layer = _int(layer, "layer")
        if projection not in PROJECTIONS:
            raise ValueError(f"projection: {projection!r} is not 'gate_up' or 'down'")
        return self._stats.column_weights(layer, projection)

    def weights_for_tensor(self, name: str, experts: int, cols: int) -> Optional[np.ndarray]:
        """The column weights for a routed-expert tensor of a checkpoint, found by its name as
        `lutb quantize --calibration` finds them (CalibrationStats::weights_for_tensor): per-expert
        PREFIX.e.{gate_proj, up_proj, w1, w3}.weight and PREFIX.e.{down_proj, w2}.weight, or the
        stacks PREFIX.gate_up_proj / PREFIX.down_proj.

        experts, cols: the tensor's expert count (1 for a per-expert tensor) and column count K.
        Returns float32 [experts, cols], or None when `name` lies under no layer's prefix.
        Raises ValueError naming this file, the tensor and both shapes when the statistics do not
        fit the tensor (statistics of another model).
        """
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        return self._stats.weights_for_tensor(name, _int(experts, "experts"), _int(cols, "cols"), self.path)

    def second_moments(self, layer: int, projection: str, experts: Optional[range] = None) -> np.ndarray:
        """The second moments C_e = E[x x^T] of layer `layer`'s experts' input for the fit with
        cross-column error feedback (lutb.quantize(second_moments=...)), by the C++ rule
        (CalibrationStats::second_moments): each expert's moments blended with the layer's by token
        count as column_weights() blends the diagonal (an expert no token reaches takes the layer's;
        a layer no token reaches gives zeros, which fit without feedback). Not normalised.

        projection: "gate_up" (K = hidden_size) or "down" (K = moe_intermediate_size).
        experts: a range of expert indices with step 1 (None: all E); the file is read for the layer
            and only these experts are returned (memory: K^2 float64 for the layer's sum and
            len(experts) * K^2 float32).
        Returns float32 [len(experts), K, K] (both triangles, finite, diagonal >= 0), a new numpy array.
        Raises ValueError: no statistics for `layer`, a projection not "gate_up" / "down", experts
        outside 0..E-1 or not a range of step 1, a layer without full moments ("... has no full
        second moments (PREFIX.e.gate_up.xxT; lutb calibrate --full-moments stores them)"), or a
        file whose moments changed since it was read (a tensor missing, of another dtype or shape,
        or holding a value that is not finite or a negative diagonal).
        """
        layer = _int(layer, "layer")
        if projection not in PROJECTIONS:
            raise ValueError(f"projection: {projection!r} is not 'gate_up' or 'down'")
        if layer not in self.layers:
            raise ValueError(f"{self.path}: no statistics for layer {layer}")
        n_experts = self.layer(layer).experts
        if experts is None:
            experts = range(n_experts)
        if not isinstance(experts, range) or experts.step != 1:
            raise ValueError(f"experts: {experts!r} is not None or a range of step 1")
        if len(experts) == 0 or experts.start < 0 or experts.stop > n_experts:
            raise ValueError(f"experts: {experts!r} is empty or not within the layer's experts 0..{n_experts - 1}")
        return self._stats.second_moments(layer, projection, experts.start, len(experts))

    def second_moments_for_tensor(self, name: str, experts: int, cols: int) -> Optional[np.ndarray]:
        """The second moments for a routed-expert tensor of a checkpoint, found by its name as
        weights_for_tensor() finds its column weights (CalibrationStats::second_moments_for_tensor):
        what `lutb quantize --calibration` passes to the fit with error feedback.

        Returns float32 [experts, cols, cols], or None when `name` lies under no layer's prefix.
        Raises ValueError as weights_for_tensor() does, and as second_moments() does for a layer
        without full moments.
        """
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        return self._stats.second_moments_for_tensor(name, _int(experts, "experts"), _int(cols, "cols"), self.path)
