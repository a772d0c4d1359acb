"""LUT-B routed experts inside Hugging Face transformers 5.x models.

Importing this module registers, through transformers' own registries (no model code is patched):

* the quantization config ``LutbConfig`` under quant_method ``"lut_b"``, the method name that
  ``lutb quantize`` writes into ``config.json`` (spec 2.2);
* the quantizer ``LutbHfQuantizer`` for that method;
* the experts implementation ``"lutb"`` (``ExpertsInterface``), which runs a ``LutbExperts`` module
  with ``lutb.moe_experts``.

Then::

    import lutb.hf
    from transformers import AutoModelForCausalLM
    # BF16 checkpoint: the routed experts are fitted while loading, on the device they load to
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, quantization_config=lutb.hf.LutbConfig(),
                                                 device_map="cuda")
    # the same, each stack fitted with the column weights of `lutb calibrate` statistics, and with
    # cross-column error feedback when they hold full second moments (the bytes of
    # `lutb quantize --calibration STATS.safetensors`)
    model = AutoModelForCausalLM.from_pretrained(
        bf16_dir, quantization_config=lutb.hf.LutbConfig(calibration="STATS.safetensors"))
    # LUT-B checkpoint written by `lutb quantize` or by save_pretrained: loaded without refitting
    model = AutoModelForCausalLM.from_pretrained(lutb_dir, device_map="cuda")
    model.save_pretrained(out_dir)  # per-expert spec 2.2 tensors; `lutb eval out_dir --tokens FILE`

Only routed experts are quantised (spec 5): the router, shared experts, dense MLP layers, attention
and embeddings stay as loaded. Supported families: ``SUPPORTED_MODEL_TYPES``.

Layout held by a ``LutbExperts`` module (buffers, so they move with the module under ``.to()`` and
``device_map``): ``gate_up_proj_{packed,codebook,scale}`` is the LUT-B weight of the fused
``[E, 2I, H]`` gate-then-up matrix and ``down_proj_{packed,codebook,scale}`` that of ``[E, H, I]``:
``packed`` uint8 ``[E, Np/8, Kp/64, 192]``, ``codebook`` uint8 (E4M3 bits) ``[E, Np/8, Kp/64, 8]``,
``scale`` uint8 (UE8M0) ``[E, Np/8, Kp/64]``, Np and Kp the row and column counts padded to 8 and 64.
A per-expert checkpoint's gate and up tensors concatenate into the fused one tile row by tile row,
which needs ``moe_intermediate_size`` to be a multiple of 8.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.integrations.moe import ExpertsInterface, use_experts_implementation
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

import lutb

__all__ = [
    "LutbConfig",
    "LutbExperts",
    "LutbHfQuantizer",
    "SUPPORTED_MODEL_TYPES",
    "QUANT_METHOD",
    "lutb_experts_forward",
]

QUANT_METHOD = "lut_b"
TILE_ROWS, TILE_COLS = 8, 64
ACT_FORMATS = ("mxfp8", "bf16")

# model_type -> (the experts class name transformers builds, the per-expert checkpoint names of
# gate, up and down, the module path of the MoE block in the checkpoint). These four families hold
# their routed experts as gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I], and
# their conversion mapping stacks the per-expert checkpoint tensors into them.
_FAMILIES: dict[str, tuple[str, tuple[str, str, str], str]] = {
    "qwen3_moe": ("Qwen3MoeExperts", ("gate_proj", "up_proj", "down_proj"), "mlp"),
    "mixtral": ("MixtralExperts", ("w1", "w3", "w2"), "block_sparse_moe"),
    "deepseek_v3": ("DeepseekV3Experts", ("gate_proj", "up_proj", "down_proj"), "mlp"),
    "olmoe": ("OlmoeExperts", ("gate_proj", "up_proj", "down_proj"), "mlp"),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)

# The routed-expert tensor patterns `lutb quantize` writes into quantization_config.modules
# (src/io/checkpoint_config.cpp, routed_expert_pattern).
_MODULES_PATTERN = {
    "mixtral": r"^model\.layers\.(\d+)\.(?:block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight|(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj))$",
    "default": r"^model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$",
}

_PARTS = ("packed", "codebook", "scale")
_PROJS = ("gate_up_proj", "down_proj")


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def _check_logical_shapes(shapes: Any) -> dict[str, list[int]]:
    """A stored block's logical_shapes (tensor name -> [rows, cols] or [E, rows, cols]) as a dict;
    ValueError naming the key for what lutb eval refuses (src/io/checkpoint_config.cpp)."""
    if shapes is None:
        return {}
    if not isinstance(shapes, dict):
        raise ValueError(f"quantization_config.logical_shapes: must be an object of tensor name to [rows, cols], "
                         f"got {shapes!r}")
    for name, v in shapes.items():
        ok = isinstance(v, (list, tuple)) and len(v) > 0 and all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in v)
        if not ok:
            raise ValueError(f"quantization_config.logical_shapes.{name}: must be an array of positive integers, "
                             f"got {v!r}")
    return {name: list(v) for name, v in shapes.items()}


class LutbConfig(QuantizationConfigMixin):
    """LUT-B quantization of the routed experts (quant_method ``"lut_b"``).

    Args:
        fitter: the tile fitter used when the experts are quantised while loading (``"binned-dp"``,
            the default of ``lutb quantize``; ``"optimal"``, ``"ct-lloyd"``, ``"multistart"``). A
            pre-quantized checkpoint records the fitter that wrote it and is never refitted; its
            stored name may be one lutb does not know (``from_dict``).
        act_format: the activations of the expert GEMMs: ``"mxfp8"`` (spec 3 and 4, the Rubin
            numerics) or ``"bf16"``.
        calibration: a statistics file of ``lutb calibrate`` (str or os.PathLike; docs/calibration.md)
            or None. When set, quantising while loading fits each MoE layer's ``gate_up_proj`` (w13)
            with the column weights of its ``gate_up`` statistics and ``down_proj`` (w2) with those of
            ``down``, found by the checkpoint's tensor names as ``lutb quantize --calibration`` finds
            them: the same bytes. The file is read, and checked against every experts module of the
            model, before any weight is loaded. It is a loading option, not part of the stored block
            (``to_dict`` leaves it out, as ``lutb quantize`` does); transformers ignores a
            ``quantization_config`` argument for a LUT-B checkpoint (it uses the stored one).
        error_feedback: the rule of ``lutb quantize --error-feedback on|off`` (a bool; True, the
            default, is ``on``). With statistics whose every layer holds the full second moments
            (``lutb calibrate --full-moments``; ``CalibrationStats.has_second_moments``), True fits
            each stack with cross-column error feedback (``lutb.quantize(second_moments=...)``, the
            stack's moments read from the file when it is fitted: E * K^2 floats) and False with the
            column weights alone; with other statistics, or without calibration, it changes
            nothing. The feedback runs on the CPU only: a stack loaded to a CUDA device
            (``device_map="cuda"``) is copied to the CPU, fitted there and its LUT-B buffers moved
            back, which gives the CLI's bytes at the CPU fit's speed (``error_feedback=False`` keeps
            the GPU fitter). A loading option like ``calibration``: not stored.
        damping: lambda of the error feedback's H = C + damping * mean(diag C) * I (``lutb quantize
            --damping``, ``lutb.quantize(damping=...)``; a float, finite and >= 0, default 0.01); used
            only where the error feedback runs. A loading option: not stored.
        **kwargs: the other keys of a stored ``quantization_config`` block (format, tile,
            index_bits, codebook_size, codebook_dtype, scale_dtype, activation, activation_block,
            modules, logical_shapes); each is checked against what LUT-B stores.

    Raises:
        ValueError: an unknown act_format, a fitter not in ``lutb.fitter_names()``, calibration with a
            fitter without a weighted objective (``"ct-lloyd"``, ``"multistart"``), a stored key that
            says the weights are not 3-bit LUT-B tiles of 8x64 with E4M3 codebooks and UE8M0 scales,
            a logical_shapes that is not an object of arrays of positive integers, damping negative
            or not finite.
        TypeError: calibration neither None, a str nor an os.PathLike; error_feedback not a bool;
            damping not a real number.
    """

    def __init__(self, fitter: str = "binned-dp", act_format: str | None = None,
                 calibration: "str | os.PathLike[str] | None" = None, error_feedback: bool = True,
                 damping: float = 0.01, **kwargs: Any):
        self.quant_method = QUANT_METHOD
        kwargs.pop("quant_method", None)
        activation = kwargs.pop("activation", None)
        if act_format is None:
            act_format = activation if activation is not None else "mxfp8"
        if act_format not in ACT_FORMATS:
            raise ValueError(f"LutbConfig: act_format {act_format!r} is not one of {ACT_FORMATS}")
        if not isinstance(fitter, str) or not fitter:
            raise ValueError(f"LutbConfig: fitter must be a non-empty string, got {fitter!r}")
        if fitter not in lutb.fitter_names():
            raise ValueError(f"LutbConfig: fitter {fitter!r} is not one of {lutb.fitter_names()}")
        if not isinstance(error_feedback, (bool, np.bool_)):
            raise TypeError(f"LutbConfig: error_feedback must be a bool, got {type(error_feedback).__name__}")
        error_feedback = bool(error_feedback)
        if isinstance(damping, bool) or not isinstance(damping, numbers.Real):
            raise TypeError(f"LutbConfig: damping must be a real number, got {type(damping).__name__}")
        if not (math.isfinite(damping) and damping >= 0):
            raise ValueError(f"LutbConfig: damping {damping} is not finite and >= 0")
        if calibration is not None:
            if not isinstance(calibration, (str, os.PathLike)):
                raise TypeError(f"LutbConfig: calibration must be a path (str or os.PathLike), got "
                                f"{type(calibration).__name__}")
            calibration = os.fspath(calibration)
            if fitter not in ("binned-dp", "optimal"):
                raise ValueError(f"LutbConfig: fitter {fitter!r} has no weighted objective; calibration needs "
                                 "'binned-dp' or 'optimal'")
        expected = {
            "format": "lut-b",
            "tile": [TILE_ROWS, TILE_COLS],
            "index_bits": 3,
            "codebook_size": 8,
            "codebook_dtype": "float8_e4m3fn",
            "scale_dtype": "ue8m0",
            "activation_block": 32,
        }
        for key, want in expected.items():
            got = kwargs.pop(key, None)
            if got is not None and (list(got) if isinstance(got, (list, tuple)) else got) != want:
                raise ValueError(f"quantization_config.{key}: {got!r} is not supported; LUT-B stores {want!r}")
        self.fitter = fitter
        self.act_format = act_format
        self.calibration = calibration
        self.error_feedback = error_feedback
        self.damping = float(damping)
        self.modules = kwargs.pop("modules", None)
        self.logical_shapes = _check_logical_shapes(kwargs.pop("logical_shapes", None))
        # Keys another writer added are kept and written back unchanged.
        self.extra = kwargs

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        """A ``quantization_config`` block (transformers reads a checkpoint's through here). Its
        ``fitter`` records what wrote the weights (spec 2.2): a name this lutb does not know is kept
        as that record, as ``lutb eval`` keeps it, and refused only by a load that would fit with it
        (``LutbHfQuantizer``, before any weight is read)."""
        d = dict(config_dict)
        record = d.get("fitter")
        unknown = isinstance(record, str) and bool(record) and record not in lutb.fitter_names()
        if unknown:
            del d["fitter"]
        out = super().from_dict(d, return_unused_kwargs=return_unused_kwargs, **kwargs)
        if unknown:
            (out[0] if return_unused_kwargs else out).fitter = record
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` block in the layout ``lutb quantize`` writes (spec 2.2)."""
        d = {
            "quant_method": QUANT_METHOD,
            "format": "lut-b",
            "tile": [TILE_ROWS, TILE_COLS],
            "index_bits": 3,
            "codebook_size": 8,
            "codebook_dtype": "float8_e4m3fn",
            "scale_dtype": "ue8m0",
            "fitter": self.fitter,
            "activation": self.act_format,
            "activation_block": 32,
        }
        if self.modules is not None:
            d["modules"] = self.modules
        d["logical_shapes"] = dict(self.logical_shapes)
        d.update(self.extra)
        return d

    def __iter__(self):
        yield from self.to_dict().items()


# ---------------------------------------------------------------------------------------------
# Experts module and forward
# ---------------------------------------------------------------------------------------------
def _family_of(config) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ValueError(
            f"LUT-B experts: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return model_type


def _experts_dims(config) -> tuple[int, int, int]:
    """(E, H, I) of the routed experts of a supported family's text config."""
    num_experts = None
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        v = getattr(config, key, None)
        if v is not None:
            num_experts = int(v)
            break
    if config.model_type == "mixtral" or getattr(config, "moe_intermediate_size", None) is None:
        inter = int(config.intermediate_size)
    else:
        inter = int(config.moe_intermediate_size)
    if num_experts is None:
        raise ValueError(f"LUT-B experts: config of {config.model_type!r} names no experts count")
    return num_experts, int(config.hidden_size), inter


def lutb_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"lutb"`` experts implementation: ``lutb.moe_experts`` on a ``LutbExperts`` module.

    Shapes as transformers' experts forward: ``hidden_states [T, H]``, ``top_k_index [T, k]``,
    ``top_k_weights [T, k]``; returns ``[T, H]`` in ``hidden_states.dtype``.

    Raises:
        TypeError: the module holds BF16 experts (load the model with ``LutbConfig`` instead).
    """
    if not isinstance(self, LutbExperts):
        raise TypeError(
            f"experts implementation 'lutb' runs LUT-B experts only; {type(self).__name__} holds unquantised "
            "weights: load the model with quantization_config=lutb.hf.LutbConfig(...)"
        )
    w13, w2 = self.lutb_weights()
    x = hidden_states.to(torch.bfloat16).contiguous()
    out = lutb.moe_experts(x, top_k_index.contiguous(), top_k_weights.float().contiguous(), w13, w2,
                           act_format=self.act_format)
    return out.to(hidden_states.dtype)


class LutbExpertsInterface(ExpertsInterface):
    """The experts implementations a ``LutbExperts`` module accepts: ``"lutb"`` (``"eager"`` and an
    unset implementation mean the same). Any other name is an error rather than a BF16 kernel run on
    packed weights."""

    _global_mapping = {"lutb": lutb_experts_forward}

    def get_interface(self, experts_implementation, default):
        if experts_implementation in (None, "eager", "lutb"):
            return lutb_experts_forward
        raise ValueError(
            f"experts implementation {experts_implementation!r}: a LUT-B model runs its experts with 'lutb' only"
        )


LUTB_EXPERTS_FUNCTIONS = LutbExpertsInterface()


# LutbExperts dispatches through transformers' experts decorator like every experts class, on its
# own interface ("lutb" only).
@use_experts_implementation(experts_interface=LUTB_EXPERTS_FUNCTIONS)
class LutbExperts(nn.Module):
    """The routed experts of one MoE block, held as LUT-B weights and run by ``lutb.moe_experts``.

    Forward: ``(hidden_states [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]``
    in ``hidden_states.dtype`` on its device. The experts read BF16 tokens and return a BF16 sum
    (spec 4), so an FP32 model's hidden states are rounded to BF16 on the way in; ids >= E (the
    expert-parallel sentinel) contribute nothing. Activations are MXFP8 or BF16 per
    ``act_format``.

    In a model quantised while loading, ``gate_up_proj`` and ``down_proj`` are BF16 meta parameters
    until the loader hands each fused stack to ``LutbQuantize``, which fits it, sets the LUT-B
    buffers and drops the parameter; in a pre-quantized model the buffers are loaded directly.
    """

    def __init__(self, config, act_format: str = "mxfp8", online: bool = False):
        super().__init__()
        self.config = config
        self.num_experts, self.hidden_size, self.intermediate_size = _experts_dims(config)
        self.act_format = act_format
        self.has_bias = False
        self.has_gate = True
        self._lutb_cache: tuple | None = None
        # proj -> whether its *_packed buffer holds the CUDA kernels' lane-major order (lutb_weights)
        self._lane_major = {p: False for p in _PROJS}
        self.register_state_dict_post_hook(self._state_dict_in_checkpoint_order)
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        self.logical_shapes = {"gate_up_proj": (E, 2 * I, H), "down_proj": (E, H, I)}
        if online:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)
        else:
            for proj in _PROJS:
                for part, t in _empty_lutb(self.logical_shapes[proj]).items():
                    self.register_buffer(f"{proj}_{part}", t)

    def lutb_weights(self):
        """(w13, w2) as ``lutb.LutbWeight`` views of the module's current buffers.

        Built once per placement of the buffers (``from_tensors`` checks the data, which on CUDA
        synchronises), so that a captured CUDA graph or a compiled forward only reads them; under
        torch.compile the cached pair is used as it is (loading builds it).

        On CUDA the kernels read ``packed`` in a lane-major order (``LutbWeight.kernel_packed``).
        The module then holds that copy alone as its ``*_packed`` buffer, so the index bytes are
        held once (3.14 bits per weight on the GPU); ``state_dict()`` (and so ``save_pretrained``)
        returns them in checkpoint order, and a move to another device converts them back first.
        """
        if self._lutb_cache is not None and torch.compiler.is_compiling():
            return self._lutb_cache[1]
        if self._lutb_cache is None or self._lutb_cache[0] != self._placement():
            ws = []
            for p in _PROJS:
                packed = getattr(self, f"{p}_packed")
                if self._lane_major[p]:
                    packed = lutb.packed_from_lane_major(packed)
                w = lutb.LutbWeight.from_tensors(
                    packed, getattr(self, f"{p}_codebook"), getattr(self, f"{p}_scale"), self.logical_shapes[p]
                )
                self._lane_major[p] = w.packed.is_cuda
                if w.packed.is_cuda:
                    w.release_packed()
                    setattr(self, f"{p}_packed", w.kernel_packed())
                else:
                    setattr(self, f"{p}_packed", w.packed)
                ws.append(w)
            self._lutb_cache = (self._placement(), tuple(ws))
        return self._lutb_cache[1]

    def _placement(self):
        return tuple((t.device, t.data_ptr()) for t in (getattr(self, f"{p}_{q}") for p in _PROJS for q in _PARTS))

    @staticmethod
    def _state_dict_in_checkpoint_order(module, state_dict, prefix, local_metadata):
        for p in _PROJS:
            key = f"{prefix}{p}_packed"
            if module._lane_major.get(p) and key in state_dict:
                state_dict[key] = lutb.packed_from_lane_major(state_dict[key])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return lutb_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, act_format={self.act_format!r}")


def _empty_lutb(shape) -> dict[str, torch.Tensor]:
    *lead, n, k = shape
    nt, kt = _ceil_to(n, TILE_ROWS) // TILE_ROWS, _ceil_to(k, TILE_COLS) // TILE_COLS
    return {
        "packed": torch.empty(*lead, nt, kt, 192, dtype=torch.uint8),
        "codebook": torch.empty(*lead, nt, kt, 8, dtype=torch.uint8),
        "scale": torch.empty(*lead, nt, kt, dtype=torch.uint8),
    }




# ---------------------------------------------------------------------------------------------
# Loading: online quantisation and pre-quantized checkpoints
# ---------------------------------------------------------------------------------------------
class LutbQuantize(ConversionOps):
    """Fits one fused expert stack (``gate_up_proj`` or ``down_proj``, already merged and
    concatenated by the model's conversion mapping, on its target device), with its column weights
    when the config names calibration statistics, and stores its LUT-B buffers on the module. The
    BF16 stack is released when this returns: nothing keeps it."""

    def __init__(self, hf_quantizer: "LutbHfQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, model=None, full_layer_name=None, missing_keys=None, **kwargs):
        (_, value), = input_dict.items()
        value = value[0] if isinstance(value, list) else value
        module_name, _, proj = full_layer_name.rpartition(".")
        module = model.get_submodule(module_name)
        if not isinstance(module, LutbExperts) or proj not in _PROJS:
            raise RuntimeError(f"{full_layer_name}: not a routed-expert stack of a LutbExperts module")
        try:
            if tuple(value.shape) != module.logical_shapes[proj]:
                raise ValueError(f"shape {tuple(value.shape)} differs from {module.logical_shapes[proj]} of the config")
            w = self.hf_quantizer.fit_stack(full_layer_name, value.contiguous())
        except Exception as e:
            # The loader logs a conversion error and goes on; _check_loaded names it again and stops.
            self.hf_quantizer.fit_errors[full_layer_name] = f"{type(e).__name__}: {e}"
            raise
        del value, input_dict
        module._parameters.pop(proj, None)
        for part in _PARTS:
            module.register_buffer(f"{proj}_{part}", getattr(w, part))
        module._lane_major[proj] = False
        module._lutb_cache = None
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        return {}


def _replace_experts(model, act_format: str, online: bool) -> list[str]:
    family = _family_of(model.config.get_text_config())
    cls_name = _FAMILIES[family][0]
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module).__name__ != cls_name:
            continue
        cfg = module.config if hasattr(module, "config") else model.config.get_text_config()
        if getattr(module, "has_bias", False):
            raise ValueError(f"{name}: LUT-B online MoE quantization does not support bias.")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{name}: LUT-B experts compute silu(gate) * up (spec 4); hidden_act is {act!r}")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.device("meta"):
            new = LutbExperts(cfg, act_format=act_format, online=online)
        setattr(parent, child, new)
        replaced.append(name)
    if not replaced:
        raise ValueError(f"LUT-B: no {cls_name} module found in the {family} model")
    return replaced


class _CalibratedStack(NamedTuple):
    """What the fit of one fused stack takes from the statistics: the checkpoint's name of the stack
    (PREFIX.gate_up_proj / PREFIX.down_proj, by which the second moments are found), its experts and
    columns, and its column weights float32 [E, K]."""

    tensor: str
    experts: int
    cols: int
    column_weights: np.ndarray


def _calibrated_stacks(model, stats: "lutb.CalibrationStats") -> dict[str, _CalibratedStack]:
    """"MODULE.gate_up_proj" / "MODULE.down_proj" of every LutbExperts module -> the stack's name,
    sizes and column weights float32 [E, K] from the statistics, found by the checkpoint's name of
    the stack (PREFIX.gate_up_proj, PREFIX.down_proj with the family's PREFIX, e.g. Mixtral's
    block_sparse_moe) by the C++ rule of `lutb quantize --calibration`.

    Raises ValueError naming the file and the tensor for a stack the statistics do not describe (no
    layer's prefix matches: a missing layer) or whose experts or columns differ (statistics of
    another model), and naming the layer for statistics of a layer the model has no experts for.
    """
    file = stats.path
    family = _family_of(model.config.get_text_config())
    out: dict[str, _CalibratedStack] = {}
    for name, m in model.named_modules():
        if not isinstance(m, LutbExperts):
            continue
        prefix = _checkpoint_prefix(family, name)
        for proj, cols in (("gate_up_proj", m.hidden_size), ("down_proj", m.intermediate_size)):
            tensor = f"{prefix}.{proj}"
            w = stats.weights_for_tensor(tensor, m.num_experts, cols)
            if w is None:
                raise ValueError(f"{file}: no calibration statistics for tensor {tensor} (no layer's experts prefix "
                                 f"matches; the file has layers {list(stats.layers)}; were they collected on this "
                                 "model?)")
            out[f"{name}.{proj}"] = _CalibratedStack(tensor, m.num_experts, cols, w)
    # A layer of statistics under whose prefix the model has no experts module was collected on
    # another model (one with more layers): refused as the CLI refuses it (check_statistics_layers).
    used = {c.tensor.rpartition(".")[0] for c in out.values()}
    for layer in stats.layers:
        prefix = stats.layer(layer).prefix
        if prefix not in used:
            raise ValueError(f"{file}: layer {layer} ({prefix}) has statistics, but the model has no routed experts "
                             "under that prefix (were they collected on this model?)")
    return out


def _checkpoint_prefix(family: str, module_name: str) -> str:
    """The checkpoint's name prefix of an experts module's tensors (Mixtral: ``block_sparse_moe``)."""
    return module_name.replace(".mlp.experts", f".{_FAMILIES[family][2]}.experts")


def _checkpoint_names(family: str, module_name: str, proj: str) -> list[str]:
    """Per-expert checkpoint tensor stems (before the expert index is filled) of a fused stack."""
    gate, up, down = _FAMILIES[family][1]
    prefix = _checkpoint_prefix(family, module_name)
    if proj == "gate_up_proj":
        return [f"{prefix}.{{e}}.{gate}.weight", f"{prefix}.{{e}}.{up}.weight"]
    return [f"{prefix}.{{e}}.{down}.weight"]


def _check_loaded(model, fit_errors: dict[str, str] | None = None) -> None:
    """Every LutbExperts buffer is loaded, of the expected dtype and shape, with valid scales and
    codebooks. Raises ValueError naming the tensor and the reason."""
    family = _family_of(model.config.get_text_config())
    for name, m in model.named_modules():
        if not isinstance(m, LutbExperts):
            continue
        for proj in _PROJS:
            stems = " and ".join(s.format(e="*") for s in _checkpoint_names(family, name, proj))
            if proj in m._parameters:
                why = (fit_errors or {}).get(f"{name}.{proj}")
                raise ValueError(f"{name}.{proj}: " + (f"fitting failed: {why}" if why else
                                 f"the BF16 experts were never loaded (from {stems})"))
            want = _empty_lutb(m.logical_shapes[proj])
            for part in _PARTS:
                t = getattr(m, f"{proj}_{part}", None)
                where = f"{name}.{proj}_{part} (from {stems.replace('.weight', '.weight_' + part)})"
                if t is None or t.is_meta:
                    raise ValueError(f"{where}: missing from the checkpoint")
                if t.dtype == torch.float8_e4m3fn and part == "codebook":
                    t = t.view(torch.uint8)
                    setattr(m, f"{proj}_{part}", t)
                if t.dtype != torch.uint8:
                    raise ValueError(f"{where}: dtype {t.dtype} is not {'F8_E4M3' if part == 'codebook' else 'U8'}")
                if tuple(t.shape) != tuple(want[part].shape):
                    raise ValueError(
                        f"{where}: shape {tuple(t.shape)} differs from {tuple(want[part].shape)} expected for "
                        f"the logical [E, N, K] {m.logical_shapes[proj]}"
                    )
            scale = getattr(m, f"{proj}_scale")
            bad = ((scale < 3) | (scale > 246)).nonzero()
            if bad.numel():
                e, tn, tk = bad[0].tolist()
                raise ValueError(
                    f"{name}.{proj}_scale (from {stems.replace('.weight', '.weight_scale')}): expert {e}, tile "
                    f"({tn}, {tk}) has scale byte {int(scale[e, tn, tk])}, outside the 3..246 LUT-B writes "
                    "(255 is UE8M0 NaN; spec 2)"
                )
            cb = getattr(m, f"{proj}_codebook")
            bad = ((cb & 0x7F) == 0x7F).nonzero()
            if bad.numel():
                e, tn, tk, j = bad[0].tolist()
                raise ValueError(
                    f"{name}.{proj}_codebook (from {stems.replace('.weight', '.weight_codebook')}): expert {e}, "
                    f"tile ({tn}, {tk}) entry {j} is an E4M3 NaN (spec 1)"
                )
        m._lutb_cache = None
        m.lutb_weights()


def _logical_shapes(model) -> dict[str, list[int]]:
    """Per-expert checkpoint name -> [rows, cols] for the tensors whose shape is padded (spec 2.2)."""
    family = _family_of(model.config.get_text_config())
    shapes: dict[str, list[int]] = {}
    for name, m in model.named_modules():
        if not isinstance(m, LutbExperts):
            continue
        E, H, I = m.num_experts, m.hidden_size, m.intermediate_size
        for proj, (n, k) in (("gate_up_proj", (I, H)), ("down_proj", (H, I))):
            if n % TILE_ROWS or k % TILE_COLS:
                for stem in _checkpoint_names(family, name, proj):
                    for e in range(E):
                        shapes[stem.format(e=e)] = [n, k]
    return shapes


def lutb_state_dict(model) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every LutbExperts stack split into the per-expert spec 2.2
    tensors ``...experts.{e}.{gate_proj,up_proj,down_proj}.weight_{packed,codebook,scale}`` in the
    transformers module naming (``save_pretrained`` then applies the family's renaming, e.g.
    Mixtral's ``mlp`` -> ``block_sparse_moe`` and w1/w3/w2 names come from the family table).
    Codebooks are float8_e4m3fn (safetensors F8_E4M3); each tensor is its own copy.

    Raises:
        ValueError: a gate/up stack whose intermediate size is not a multiple of 8 (its per-expert
            gate and up tensors would not split on a tile boundary).
    """
    family = _family_of(model.config.get_text_config())
    gate, up, down = _FAMILIES[family][1]
    sd = model.state_dict()
    for name, m in model.named_modules():
        if not isinstance(m, LutbExperts):
            continue
        I = m.intermediate_size
        if I % TILE_ROWS:
            raise ValueError(f"{name}: moe_intermediate_size {I} is not a multiple of 8; gate and up cannot be "
                             "stored per expert in separate LUT-B tensors")
        for proj in _PROJS:
            for part in _PARTS:
                t = sd.pop(f"{name}.{proj}_{part}")
                if part == "codebook":
                    t = t.view(torch.float8_e4m3fn)
                for e in range(m.num_experts):
                    if proj == "gate_up_proj":
                        split = I // TILE_ROWS
                        sd[f"{name}.{e}.{gate}.weight_{part}"] = t[e, :split].clone()
                        sd[f"{name}.{e}.{up}.weight_{part}"] = t[e, split:].clone()
                    else:
                        sd[f"{name}.{e}.{down}.weight_{part}"] = t[e].clone()
    return sd


def _float_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """name -> dtype of every floating-point parameter and buffer of `model`."""
    tensors = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    return {n: t.dtype for n, t in tensors if t is not None and t.is_floating_point()}


def _restore_float_dtypes(model: nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    """Casts each parameter and buffer named in `dtypes` to its dtype there (a parameter in place, so
    that tied weights stay one tensor)."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for n, t in store.items():
                want = dtypes.get(f"{prefix}.{n}" if prefix else n)
                if t is None or want is None or t.dtype == want or not t.is_floating_point():
                    continue
                if isinstance(t, nn.Parameter):
                    t.data = t.data.to(want)
                else:
                    store[n] = t.to(want)


class LutbHfQuantizer(HfQuantizer):
    """transformers quantizer of quant_method ``"lut_b"``.

    * BF16 checkpoint + ``quantization_config=LutbConfig(...)``: the experts modules are replaced on
      the meta device by ``LutbExperts``; each fused BF16 stack is fitted by ``lutb.quantize`` on
      the device it was loaded to (the GPU fitter for CUDA tensors, same bytes as the CPU) as soon as
      the loader has built it, and then released. With ``LutbConfig(calibration=STATS)`` the
      statistics are read and their column weights prepared for every stack before loading starts
      (so statistics of another model stop the load before any weight is read), and each stack is
      fitted with its own; with full second moments in the statistics and
      ``LutbConfig(error_feedback=True)`` (the default), also with cross-column error feedback, on
      the CPU (``fit_stack``).
    * LUT-B checkpoint (``config.json`` quant_method ``"lut_b"``): the per-expert tensors are
      stacked by the model's own conversion mapping into the module's buffers, then checked.
    """

    # transformers' flag means "loads pre-quantized checkpoints only". LUT-B fits BF16 weights while
    # loading, data-free or with a statistics file (LutbConfig.calibration), which is an input of that
    # fit and not a pre-quantized checkpoint.
    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.fit_errors: dict[str, str] = {}
        # LutbConfig.calibration while loading: the statistics, "MODULE.gate_up_proj" -> what its fit
        # takes from them, and whether the fits use their second moments (LutbConfig.error_feedback).
        self.calibration_stats: "lutb.CalibrationStats | None" = None
        self.calibrated_stacks: dict[str, _CalibratedStack] = {}
        self.error_feedback = False
        # pre-quantized loads: name -> dtype of every float parameter and buffer of the model as built
        self.float_dtypes: dict[str, torch.dtype] = {}

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("LUT-B experts cannot be offloaded to disk (device_map has 'disk')")

    def update_dtype(self, dtype):
        return dtype

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        module_name, _, tensor = param_name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        return isinstance(module, LutbExperts) and tensor in _PROJS

    def param_element_size(self, model, param_name: str, param) -> float:
        if self.param_needs_quantization(model, param_name):
            return 201 / 512  # bytes per weight of a LUT-B tile (spec 2)
        return super().param_element_size(model, param_name, param)

    def _process_model_before_weight_loading(self, model, **kwargs):
        calibration = getattr(self.quantization_config, "calibration", None)
        if calibration is not None and self.pre_quantized:
            raise ValueError(f"LutbConfig: calibration {calibration} applies to fitting BF16 experts while loading; "
                             "this checkpoint is already LUT-B")
        fitter = self.quantization_config.fitter
        if not self.pre_quantized and fitter not in lutb.fitter_names():
            raise ValueError(f"LutbConfig: fitter {fitter!r} is not one of {lutb.fitter_names()}")
        _replace_experts(model, self.quantization_config.act_format, online=not self.pre_quantized)
        # transformers loads a pre-quantized checkpoint's renamed tensors in their stored dtype (Mixtral's
        # block_sparse_moe.gate.weight -> mlp.gate.weight), so a BF16 router would stay BF16 in an
        # FP32 model; every float tensor is given back the dtype the model was built with after loading.
        self.float_dtypes = _float_dtypes(model) if self.pre_quantized else {}
        if calibration is not None:
            # Unreadable files and files that are not statistics raise OSError / ValueError naming them.
            self.calibration_stats = lutb.CalibrationStats(calibration)
            self.calibrated_stacks = _calibrated_stacks(model, self.calibration_stats)
            # The CLI's rule (src/cli/quantize.cpp): feedback when asked and every layer has full moments.
            self.error_feedback = self.quantization_config.error_feedback and self.calibration_stats.has_second_moments
        for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            cfg._experts_implementation = "lutb"

    def fit_stack(self, stack: str, value: torch.Tensor) -> "lutb.LutbWeight":
        """The LUT-B fit of the fused stack "MODULE.gate_up_proj" / "MODULE.down_proj" (value: its
        contiguous BF16 [E, N, K] on the device it loaded to), as `lutb quantize` fits the
        checkpoint's tensors: data-free, with the column weights of the statistics, or also with
        their second moments (error feedback: fitted on the CPU, the result moved to value's device).
        """
        fitter = self.quantization_config.fitter
        if self.calibration_stats is None:
            return lutb.quantize(value, fitter=fitter, name=stack)
        c = self.calibrated_stacks.get(stack)
        if c is None:
            raise RuntimeError(f"{stack}: no column weights were prepared for this stack")
        if not self.error_feedback:
            cw = torch.from_numpy(c.column_weights).to(value.device)
            return lutb.quantize(value, fitter=fitter, column_weights=cw, name=stack)
        moments = self.calibration_stats.second_moments_for_tensor(c.tensor, c.experts, c.cols)
        w = lutb.quantize(value.cpu(), fitter=fitter, column_weights=torch.from_numpy(c.column_weights),
                          second_moments=torch.from_numpy(moments), damping=self.quantization_config.damping,
                          name=stack)
        return w if value.device.type == "cpu" else w.to(value.device)

    def _process_model_after_weight_loading(self, model, **kwargs):
        self.calibration_stats, self.calibrated_stacks = None, {}
        _restore_float_dtypes(model, self.float_dtypes)
        _check_loaded(model, self.fit_errors)
        q = self.quantization_config
        family = _family_of(model.config.get_text_config())
        q.modules = _MODULES_PATTERN.get(family, _MODULES_PATTERN["default"])
        q.logical_shapes = _logical_shapes(model)
        return model

    def get_quantize_ops(self):
        return LutbQuantize(self)

    def get_state_dict_and_metadata(self, model):
        return lutb_state_dict(model), {}

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _register() -> None:
    # Importing twice (reload, or another copy of the package) must not fail on the registries'
    # "already registered" checks.
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not LutbConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        register_quantization_config(QUANT_METHOD)(LutbConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not LutbHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(LutbHfQuantizer)
    ExpertsInterface.register("lutb", lutb_experts_forward)


_register()
