"""Held-out loss (spec 8 protocol) of a Hugging Face MoE checkpoint, BF16 or with LUT-B experts.

    python examples/heldout_loss.py MODEL_DIR [--tokens FILE] [--lutb [--calibration STATS]]
                                    [--act-format mxfp8|bf16] [--fitter NAME] [--device cpu|cuda]
                                    [--dtype float32|bfloat16] [--max-windows N] [--batch-size N]

MODEL_DIR is a local checkpoint folder (config.json and the weights). --tokens is a safetensors file
of token ids (``input_ids``), by default MODEL_DIR/val_tokens.safetensors: the shared models and
``lutb quantize`` outputs hold one, a ``save_pretrained`` output does not (pass the source model's).
With --lutb a BF16 checkpoint is quantised while loading (lutb.hf.LutbConfig), weighted by the
statistics of ``lutb calibrate`` given with --calibration; a LUT-B checkpoint (quant_method "lut_b"
in config.json) always loads as stored. Prints one JSON line:
{"model", "lutb", "act_format", "dtype", "val_loss", "perplexity", "windows", "predicted_tokens"}.
The default float32 compute is the protocol of reference_eval.json's val_loss_fp32_compute.
Exit status: 0 success; 1 an input that is missing or invalid (one line on stderr); 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

import lutb.hf
from lutb.eval import load_tokens, perplexity

# The examples' shared checks live beside them (examples/example_checks.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_checks import device_arg, device_problem, is_lutb_checkpoint  # noqa: E402


def positive_int(s: str) -> int:
    if not s.isdigit() or int(s) < 1:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer >= 1")
    return int(s)


def fail(message: str) -> int:
    print(f"heldout_loss.py: {message}", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--tokens", metavar="FILE", help="token ids (default MODEL_DIR/val_tokens.safetensors)")
    p.add_argument("--lutb", action="store_true", help="quantise the routed experts to LUT-B while loading")
    p.add_argument("--calibration", metavar="STATS", help="statistics of `lutb calibrate` for the --lutb fit")
    p.add_argument("--act-format", default="mxfp8", choices=["mxfp8", "bf16"])
    p.add_argument("--fitter", default="binned-dp", choices=lutb.fitter_names())
    p.add_argument("--device", default="cpu", type=device_arg, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-windows", metavar="N", type=positive_int, default=None, help="the first N windows only")
    p.add_argument("--batch-size", metavar="N", type=positive_int, default=4, help="windows per forward pass")
    a = p.parse_args(argv)
    if a.calibration and not a.lutb:
        p.error("--calibration weights the --lutb fit; add --lutb")

    config = os.path.join(a.model_dir, "config.json")
    if not os.path.isfile(config):
        return fail(f"MODEL_DIR: {a.model_dir} " + ("has no config.json" if os.path.isdir(a.model_dir)
                                                   else "is not a folder"))
    try:
        stored = is_lutb_checkpoint(a.model_dir)
    except ValueError as e:
        return fail(str(e))
    if a.calibration and stored:
        p.error(f"--calibration: {a.model_dir} is a LUT-B checkpoint, loaded as stored (nothing is fitted)")
    tokens = a.tokens or os.path.join(a.model_dir, "val_tokens.safetensors")
    if not os.path.exists(tokens):  # a folder is refused by load_tokens, as not a regular file
        hint = "" if a.tokens else "; pass the token ids with --tokens FILE"
        return fail(f"tokens: {tokens} does not exist{hint}")
    if a.calibration and not os.path.isfile(a.calibration):
        return fail(f"calibration: {a.calibration} does not exist")
    if problem := device_problem(a.device):
        return fail(problem)
    try:
        ids = load_tokens(tokens)
    except ValueError as e:  # no input_ids tensor, or ids that are not integers >= 0
        return fail(str(e))

    kwargs = {}
    if a.lutb:
        try:
            kwargs["quantization_config"] = lutb.hf.LutbConfig(fitter=a.fitter, act_format=a.act_format,
                                                               calibration=a.calibration)
        except ValueError as e:  # --calibration with a fitter that has no weighted objective
            p.error(str(e))
    if a.device != "cpu":  # device_map needs accelerate; the CPU is the default placement
        kwargs["device_map"] = a.device
    try:
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=getattr(torch, a.dtype), **kwargs)
        model.eval()
        r = perplexity(model, ids, max_windows=a.max_windows, batch_size=a.batch_size)
    except (OSError, ValueError) as e:  # an unreadable or invalid checkpoint, statistics or token file
        return fail(str(e))
    quantised = any(isinstance(m, lutb.hf.LutbExperts) for m in model.modules())
    print(json.dumps({"model": a.model_dir, "lutb": quantised, "act_format": a.act_format if quantised else None,
                      "dtype": a.dtype, "val_loss": r.loss, "perplexity": r.perplexity, "windows": r.windows,
                      "predicted_tokens": r.predicted_tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
