#!/usr/bin/env python3
"""Compares rules from calibration statistics to column weights on selection sets that are not
val_tokens (docs/calibration.md, "Choosing the rule"), and splits the loss change of a LUT-B fit into
its even and odd parts in the weight error.

Selection sets (none is the held-out val_tokens of spec section 8):
  train-end  the last 65,536 tokens of the calibration file (the training split; the statistics come
             from its first 65,536): text the models were trained on.
  samples    per model, 256 sequences of 256 tokens sampled from the BF16 model itself (temperature 1,
             no truncation; the first token of each sequence is a training token at a seeded random
             position) with transformers. On this text the increase of the loss over BF16 estimates
             KL(BF16 || quantised) per predicted token.
  val        the models' val_tokens: the target's measure, reported after the choice, never selected on.

Rules (applied to d_e of lutb's blend with the layer, n0 = 32, before its normalisation and floor):
  uniform    d_c (the default);   dampL  d_c + L * mean_c(d) (GPTQ-style dampening);   powA  d_c ** A;
  layer      the layer's mean statistics for every expert;   w13only / w2only  the other projection
  unweighted;   routing  statistics with --token-weight routing, then d_c;   chunk1, chunk2  d_c of
  statistics from training tokens 65,536 k .. 65,536 (k+1) instead of the first 65,536 (how much the
  figures move with the calibration text; not in the default list).
A rule other than uniform/routing is applied by writing a statistics file whose blended, normalised
weights are the rule's (each expert's moments replaced, its token count set to 1e30 so that lutb's
blend keeps them).

Weight error (--weight-error): per model and projection (gate/up, down), over all routed experts,
sum (w - w_hat)^2 / sum w^2 unweighted and weighted by the uniform rule's d_c (the diagonal output
error the calibrated fit minimises), for the binned-dp fits data-free and under the uniform rule.

Decomposition (--decompose): with D the routed experts' error of a binned-dp fit (data-free, and
under the uniform rule), two BF16 checkpoints W + D (the dequantised fit) and W - D are evaluated
with --quant none (BF16 activations): even = (L(W+D) + L(W-D))/2 - L(W), odd = (L(W+D) - L(W-D))/2.

Usage: scripts/calibration_rules.py [--lutb PATH] [--models DIR] [--calib-tokens FILE] [--work DIR]
                                    [--threads N] [--sets train-end,samples,val] [--rules LIST]
                                    [--fitters binned-dp,optimal,multistart] [--weight-error] [--decompose]
Needs numpy and safetensors; the samples set also torch and transformers. Results are cached in
WORK/results.json (a rerun only runs what is missing) and printed as markdown tables. Fitters
without a weighted objective (ct-lloyd, multistart) give only their data-free row.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N0 = 32.0  # kPriorTokens of lutb/calibration.hpp
CAL_TOKENS = 65536
RULES = ["uniform", "routing", "damp0.01", "damp0.1", "damp1", "pow0.5", "layer", "w13only", "w2only"]


def run_json(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr}")
    return json.loads([l for l in p.stdout.splitlines() if l.strip()][-1])


def train_end(a):
    path = os.path.join(a.work, "train-end.safetensors")
    if not os.path.exists(path):
        t = load_file(a.calib_tokens)["input_ids"]
        save_file({"input_ids": np.ascontiguousarray(t[-CAL_TOKENS:])}, path)
    return path


def samples(a, model):
    path = os.path.join(a.work, f"samples-{model}.safetensors")
    if os.path.exists(path):
        return path
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads or os.cpu_count())
    m = AutoModelForCausalLM.from_pretrained(os.path.join(a.models, model), dtype=torch.float32).eval()
    m.config.output_router_logits = False
    m.generation_config.eos_token_id = None
    train = load_file(a.calib_tokens)["input_ids"]
    first = torch.tensor(train[np.random.default_rng(25).integers(0, len(train), 256)], dtype=torch.long)[:, None]
    torch.manual_seed(25)
    with torch.no_grad():
        ids = m.generate(first, attention_mask=torch.ones_like(first), do_sample=True, temperature=1.0, top_k=0,
                         top_p=1.0, max_new_tokens=255, min_new_tokens=255, pad_token_id=0, output_router_logits=False)
    assert tuple(ids.shape) == (256, 256), ids.shape
    save_file({"input_ids": ids.reshape(-1).numpy().astype(np.int32)}, path)
    return path


def tokens_args(a, model, sel):
    if sel == "val":
        return []
    return ["--tokens", train_end(a) if sel == "train-end" else samples(a, model)]


def base_stats(a, model, token_weight, chunk=0):
    path = os.path.join(a.work, f"{model}-{token_weight}{f'-chunk{chunk}' if chunk else ''}.safetensors")
    if not os.path.exists(path):
        tokens = a.calib_tokens
        if chunk:
            tokens = os.path.join(a.work, f"train-chunk{chunk}.safetensors")
            t = load_file(a.calib_tokens)["input_ids"]
            save_file({"input_ids": np.ascontiguousarray(t[CAL_TOKENS * chunk:CAL_TOKENS * (chunk + 1)])}, tokens)
        run_json([a.lutb, "calibrate", os.path.join(a.models, model), "--tokens", tokens, "--max-tokens",
                  str(CAL_TOKENS), "--token-weight", token_weight, "-o", path, "--json"] + a.thr)
    return path


def layers(d):
    out = {}
    for k in d:
        m = re.match(r"^(.*\.layers\.\d+\..*)\.(\d+)\.(gate_up\.x2|down\.x2|tokens)$", k)
        out.setdefault(m.group(1), set()).add(int(m.group(2)))
    return {p: max(s) + 1 for p, s in out.items()}


def blended(d, prefix, E, proj):
    """lutb's blend of each expert with its layer: ([E, C] d_e, [C] layer mean), in double."""
    x = np.stack([d[f"{prefix}.{e}.{proj}.x2"].astype(np.float64) for e in range(E)])
    n = np.array([float(d[f"{prefix}.{e}.tokens"][0]) for e in range(E)])
    ml = (n[:, None] * x).sum(0) / n.sum()
    return (n[:, None] * x + N0 * ml) / (n[:, None] + N0), ml


def rule_weights(rule, b, ml, proj):
    if rule.startswith("damp"):
        return b + float(rule[4:]) * b.mean(1, keepdims=True)
    if rule.startswith("pow"):
        return b ** float(rule[3:])
    if rule == "layer":
        return np.broadcast_to(ml, b.shape).copy()
    if rule == "w13only":
        return b if proj == "gate_up" else np.ones_like(b)
    if rule == "w2only":
        return b if proj == "down" else np.ones_like(b)
    sys.exit(f"unknown rule {rule}")


def stats(a, model, rule):
    if rule in ("uniform", "routing"):
        return base_stats(a, model, rule)
    if rule.startswith("chunk"):
        return base_stats(a, model, "uniform", int(rule[5:]))
    path = os.path.join(a.work, f"{model}-{rule}.safetensors")
    if os.path.exists(path):
        return path
    src = base_stats(a, model, "uniform")
    f = safe_open(src, "np")
    d, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    out = {}
    for prefix, E in layers(d).items():
        for proj in ("gate_up", "down"):
            b, ml = blended(d, prefix, E, proj)
            w = rule_weights(rule, b, ml, proj)
            for e in range(E):
                out[f"{prefix}.{e}.{proj}.x2"] = np.ascontiguousarray(w[e], dtype=np.float32)
        for e in range(E):
            out[f"{prefix}.{e}.tokens"] = np.array([1e30], dtype=np.float32)
    meta["rule"] = rule
    save_file(out, path, metadata=meta)
    return path


class Cache:
    def __init__(self, path):
        self.path = path
        self.d = json.load(open(path)) if os.path.exists(path) else {}

    def get(self, key, fn):
        if key not in self.d:
            t0 = time.time()
            self.d[key] = fn()
            print(f"{key:60s} {self.d[key]:.6f} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.d, f, indent=1, sort_keys=True)
            os.replace(self.path + ".tmp", self.path)
        return self.d[key]


def loss(a, cache, model, sel, quant, fitter="", rule="data-free"):
    def fn():
        cmd = [a.lutb, "eval", os.path.join(a.models, model), "--json", "--quant", quant] + \
              tokens_args(a, model, sel) + a.thr
        if quant == "lutb":
            cmd += ["--act-format", "mxfp8", "--fitter", fitter]
            if rule != "data-free":
                cmd += ["--calibration", stats(a, model, rule)]
        return run_json(cmd)["val_loss"]
    return cache.get(f"{model}|{sel}|{quant}|{fitter}|{rule}", fn)


def dequantize(f, p):
    """[N, K] FP32 weights of a LUT-B tensor P (spec section 2), padded shape."""
    import torch
    packed = f.get_tensor(p + ".weight_packed").numpy().astype(np.uint32)
    cb = f.get_tensor(p + ".weight_codebook").to(torch.float32).numpy()
    sc = f.get_tensor(p + ".weight_scale").numpy().astype(np.int32)
    TN, TK, _ = packed.shape
    g = packed.reshape(TN, TK, 64, 3)
    word = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
    idx = np.stack([(word >> (3 * j)) & 7 for j in range(8)], -1).reshape(TN, TK, 512)
    v = np.take_along_axis(cb, idx, 2) * np.exp2(sc - 127.0)[..., None]
    return v.reshape(TN, TK, 8, 64).transpose(0, 2, 1, 3).reshape(TN * 8, TK * 64)


def lutb_checkpoint(a, model, rule):
    """A LUT-B checkpoint of the binned-dp fit (data-free or under `rule`)."""
    q = os.path.join(a.work, f"lutb-{model}-{rule}")
    if not os.path.exists(q):
        cmd = [a.lutb, "quantize", os.path.join(a.models, model), "-o", q, "--fitter", "binned-dp"] + a.thr
        if rule != "data-free":
            cmd += ["--calibration", stats(a, model, rule)]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            sys.exit(f"command failed: {' '.join(cmd)}\n{p.stderr}")
    return q


def weight_error(a, model, rule):
    """{projection: (unweighted, weighted) relative error} of the binned-dp fit, over all routed experts."""
    import torch
    ref = safe_open(os.path.join(a.models, model, "model.safetensors"), "pt")
    fq = safe_open(os.path.join(lutb_checkpoint(a, model, rule), "model.safetensors"), "pt")
    st = load_file(stats(a, model, "uniform"))
    sums = {"gate_up": np.zeros(4), "down": np.zeros(4)}
    for prefix, E in layers(st).items():
        for proj in sums:
            b, _ = blended(st, prefix, E, proj)
            d = b / b.mean(1, keepdims=True)
            for e in range(E):
                for k in ref.keys():
                    part = k[len(prefix) + 1:].split(".")
                    if not k.startswith(prefix + ".") or part[0] != str(e) or k[-7:] != ".weight":
                        continue
                    if (part[1] in ("w2", "down_proj")) != (proj == "down"):
                        continue
                    w = ref.get_tensor(k).to(torch.float32).numpy().astype(np.float64)
                    err = (dequantize(fq, k[:-7])[:w.shape[0], :w.shape[1]] - w) ** 2
                    sums[proj] += [err.sum(), (w * w).sum(), (err * d[e]).sum(), (w * w * d[e]).sum()]
    return {p: (v[0] / v[1], v[2] / v[3]) for p, v in sums.items()}


def mirrored(a, model, rule):
    """BF16 checkpoints W + D and W - D of the binned-dp fit (data-free or under `rule`)."""
    import torch
    from safetensors.torch import save_file as save_pt
    src = os.path.join(a.models, model)
    base = os.path.join(a.work, f"mirror-{model}-{rule}")
    if os.path.exists(base + "-minus/model.safetensors"):
        return base + "-plus", base + "-minus"
    q = lutb_checkpoint(a, model, rule)
    ref, fq = safe_open(os.path.join(src, "model.safetensors"), "pt"), safe_open(os.path.join(q, "model.safetensors"), "pt")
    qk = set(fq.keys())
    plus, minus = {}, {}
    for k in ref.keys():
        w = ref.get_tensor(k)
        p = k[:-len(".weight")]
        if k.endswith(".weight") and p + ".weight_packed" in qk:
            qv = torch.from_numpy(np.ascontiguousarray(dequantize(fq, p)[:w.shape[0], :w.shape[1]]))
            plus[k] = qv.to(torch.bfloat16)  # exact: LUT-B values are BF16 numbers (spec section 2)
            minus[k] = (2 * w.to(torch.float32) - qv).to(torch.bfloat16)
        else:
            plus[k] = minus[k] = w
    for name, d in (("plus", plus), ("minus", minus)):
        o = f"{base}-{name}"
        os.makedirs(o, exist_ok=True)
        for fn in os.listdir(src):
            if fn != "model.safetensors" and not os.path.exists(os.path.join(o, fn)):
                os.symlink(os.path.join(src, fn), os.path.join(o, fn))
        save_pt({k: v.contiguous() for k, v in d.items()}, os.path.join(o, "model.safetensors"))
    return base + "-plus", base + "-minus"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lutb", default=os.path.join(ROOT, "build", "release", "lutb"))
    ap.add_argument("--models", default=os.path.join(ROOT, "..", "shared", "models"))
    ap.add_argument("--calib-tokens", default=os.path.join(ROOT, "..", "shared", "calib", "train_tokens.safetensors"))
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "calibration-rules"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--sets", default="train-end,samples,val")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--fitters", default="binned-dp")
    ap.add_argument("--weight-error", action="store_true")
    ap.add_argument("--decompose", action="store_true")
    a = ap.parse_args()
    a.lutb, a.models, a.calib_tokens, a.work = map(os.path.abspath, (a.lutb, a.models, a.calib_tokens, a.work))
    a.thr = ["--threads", str(a.threads)] if a.threads else []
    os.makedirs(a.work, exist_ok=True)
    cache = Cache(os.path.join(a.work, "results.json"))
    models = sorted(d for d in os.listdir(a.models) if os.path.isfile(os.path.join(a.models, d, "config.json")))
    sets, rules, fitters = a.sets.split(","), [r for r in a.rules.split(",") if r], a.fitters.split(",")
    for sel in sets:
        for fitter in fitters:
            print(f"\n{sel}, {fitter}: increase of the loss over BF16 (change against data-free)\n")
            print("| rule | " + " | ".join(models) + " |\n|---|" + "---:|" * len(models))
            weighted = fitter in ("binned-dp", "optimal")  # the fitters with a weighted objective
            for rule in ["data-free"] + (rules if weighted else []):
                cells = []
                for m in models:
                    b = loss(a, cache, m, sel, "none")
                    free = loss(a, cache, m, sel, "lutb", fitter) - b
                    v = loss(a, cache, m, sel, "lutb", fitter, rule) - b
                    cells.append(f"{v:+.4f}" + ("" if rule == "data-free" else f" ({(v - free) / free * 100:+.0f} %)"))
                print(f"| {rule} | " + " | ".join(cells) + " |", flush=True)
    if a.weight_error:
        print("\nRelative weight error of binned-dp, unweighted / weighted by d_c (uniform rule)\n")
        print("| model | projection | data-free | uniform rule | change of the weighted error |\n|---|---|---:|---:|---:|")
        for m in models:
            free, cal = weight_error(a, m, "data-free"), weight_error(a, m, "uniform")
            for proj in ("gate_up", "down"):
                print(f"| {m} | {proj} | {free[proj][0]:.5f} / {free[proj][1]:.5f} | {cal[proj][0]:.5f} / "
                      f"{cal[proj][1]:.5f} | {(cal[proj][1] - free[proj][1]) / free[proj][1] * 100:+.1f} % |", flush=True)
    if a.decompose:
        print("\nEven and odd parts of the loss change (BF16 activations; binned-dp; W +- D)\n")
        print("| model | fit | set | L(W+D) - L(W) | L(W-D) - L(W) | even | odd |\n|---|---|---|---:|---:|---:|---:|")
        for m in models:
            for rule in ("data-free", "uniform"):
                for sel in [s for s in sets if s != "train-end"]:
                    b = loss(a, cache, m, sel, "none")
                    pl, mi = mirrored(a, m, rule)
                    lp = cache.get(f"{m}|{sel}|mirror-plus|binned-dp|{rule}", lambda: run_json(
                        [a.lutb, "eval", pl, "--json", "--quant", "none"] + tokens_args(a, m, sel) + a.thr)["val_loss"])
                    lm = cache.get(f"{m}|{sel}|mirror-minus|binned-dp|{rule}", lambda: run_json(
                        [a.lutb, "eval", mi, "--json", "--quant", "none"] + tokens_args(a, m, sel) + a.thr)["val_loss"])
                    print(f"| {m} | {rule} | {sel} | {lp - b:+.4f} | {lm - b:+.4f} | {(lp + lm) / 2 - b:+.4f} | "
                          f"{(lp - lm) / 2:+.4f} |", flush=True)


if __name__ == "__main__":
    main()
