"""The command-line checks both examples share (heldout_loss.py, lm_eval_quantized.py): the --device
argument, whether that device can run here, and whether MODEL_DIR holds a LUT-B checkpoint."""

from __future__ import annotations

import argparse
import json
import os

import torch


def device_arg(s: str) -> str:
    """--device: cpu, cuda or cuda:N (a usage error otherwise, exit status 2)."""
    try:
        kind = torch.device(s).type
    except RuntimeError:  # "Invalid device string", an empty string
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{s!r} is not cpu, cuda or cuda:N")
    return s


def device_problem(device: str) -> str | None:
    """Why ``device`` (as device_arg returns it) cannot run here, or None: a CUDA device needs a
    usable GPU, which transformers would otherwise report as a traceback from torch's CUDA init."""
    d = torch.device(device)
    if d.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"device: {device}: no usable CUDA device here (torch.cuda.is_available() is False)"
    if d.index is not None and d.index >= torch.cuda.device_count():
        return f"device: {device}: there are only {torch.cuda.device_count()} CUDA devices"
    return None


def is_lutb_checkpoint(model_dir: str) -> bool:
    """Whether ``model_dir``'s config.json has a LUT-B ``quantization_config`` (quant_method "lut_b").

    Raises:
        ValueError: config.json cannot be read or is not a JSON object (the message names the file).
    """
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"MODEL_DIR: {path} cannot be read: {e.strerror}") from None
    except ValueError as e:  # not UTF-8, not JSON
        raise ValueError(f"MODEL_DIR: {path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"MODEL_DIR: {path} is not a JSON object")
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "lut_b"
