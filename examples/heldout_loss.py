"""Held-out loss (spec 8 protocol) of a Hugging Face MoE checkpoint, BF16 or with LUT-B experts.

    python examples/heldout_loss.py MODEL_DIR [--lutb] [--act-format mxfp8|bf16] [--fitter NAME]
                                    [--device cpu|cuda] [--dtype float32|bfloat16] [--max-windows N]

MODEL_DIR holds config.json, the weights and val_tokens.safetensors (the shared models do). With
--lutb a BF16 checkpoint is quantised while loading (lutb.hf.LutbConfig); a LUT-B checkpoint
(quant_method "lut_b" in config.json) always loads as stored. Prints one JSON line:
{"model", "lutb", "act_format", "dtype", "val_loss", "perplexity", "windows", "predicted_tokens"}.
The default float32 compute is the protocol of reference_eval.json's val_loss_fp32_compute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--lutb", action="store_true", help="quantise the routed experts to LUT-B while loading")
    p.add_argument("--act-format", default="mxfp8", choices=["mxfp8", "bf16"])
    p.add_argument("--fitter", default="binned-dp")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=4)
    a = p.parse_args(argv)

    import lutb.hf
    from lutb.eval import perplexity
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if a.lutb:
        kwargs["quantization_config"] = lutb.hf.LutbConfig(fitter=a.fitter, act_format=a.act_format)
    if a.device != "cpu":  # device_map needs accelerate; the CPU is the default placement
        kwargs["device_map"] = a.device
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=getattr(torch, a.dtype), **kwargs)
    model.eval()
    quantised = any(isinstance(m, lutb.hf.LutbExperts) for m in model.modules())
    r = perplexity(model, os.path.join(a.model_dir, "val_tokens.safetensors"), max_windows=a.max_windows,
                   batch_size=a.batch_size)
    print(json.dumps({"model": a.model_dir, "lutb": quantised, "act_format": a.act_format if quantised else None,
                      "dtype": a.dtype, "val_loss": r.loss, "perplexity": r.perplexity, "windows": r.windows,
                      "predicted_tokens": r.predicted_tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
