#!/usr/bin/env python3
"""Regenerates docs/results.md: held-out loss of every shared model with its routed experts in BF16,
LUT-B (every fitter, MXFP8 and BF16 activations, online and from a stored LUT-B checkpoint) and the
INT3-g128 / MXFP4 baselines, all through the same `lutb eval` harness (spec section 8).

Usage: scripts/results.sh [--lutb PATH] [--models DIR] [--out FILE] [--threads N] [--max-windows N]
Needs the lutb CLI (default build/release/lutb) and ../shared/models (or --models).
"""
import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SHOW = {}  # path -> how the commands log shows it


def run(cmd, log):
    """Runs a lutb command, returns (json of the last stdout line, wall seconds)."""
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    secs = time.time() - t0
    shown = []
    for c in cmd:
        for path, name in SHOW.items():
            c = c.replace(path, name)
        shown.append(shlex.quote(c) if not c.startswith("$") else c)
    log.append(" ".join(shown))
    if p.returncode != 0:
        sys.exit(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr}")
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    return json.loads(lines[-1]), secs


def fitter_names(lutb, model):
    env = os.environ.get("FITTERS")
    if env:
        return env.split()
    p = subprocess.run([lutb, "eval", model, "--quant", "lutb", "--fitter", "?"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    m = re.search(r"allowed:\s*(.*)", p.stderr)
    if not m:
        sys.exit("cannot list the fitters: " + p.stderr)
    return m.group(1).split()


def machine():
    model = ""
    try:
        out = subprocess.run(["lscpu"], stdout=subprocess.PIPE, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model or platform.processor()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def fmt_loss(x):
    return f"{x:.4f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lutb", default=os.path.join(ROOT, "build", "release", "lutb"))
    ap.add_argument("--models", default=os.path.join(ROOT, "..", "shared", "models"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-windows", type=int, default=0, help="0 = the whole protocol (for quick trials only)")
    a = ap.parse_args()
    lutb = os.path.abspath(a.lutb)
    models_dir = os.path.abspath(a.models)
    SHOW[lutb] = "lutb"
    SHOW[models_dir] = "$MODELS"
    models = sorted(d for d in os.listdir(models_dir) if os.path.isfile(os.path.join(models_dir, d, "config.json")))
    if not models:
        sys.exit(f"no models under {models_dir}")
    extra = []
    if a.threads:
        extra += ["--threads", str(a.threads)]
    if a.max_windows:
        extra += ["--max-windows", str(a.max_windows)]

    started = datetime.datetime.now(datetime.timezone.utc)
    rev = git_rev()  # the tree the binary is assumed to be built from, read before anything runs
    log = []
    sections = []
    summary = []
    tmp = tempfile.mkdtemp(prefix="lutb-results-")
    try:
        for name in models:
            mdir = os.path.join(models_dir, name)
            ref = {}
            rp = os.path.join(mdir, "reference_eval.json")
            if os.path.exists(rp):
                ref = json.load(open(rp))
            fitters = fitter_names(lutb, mdir)
            rows = []  # (label, weights, activations, json, wall)

            def ev(label, args):
                j, secs = run([lutb, "eval", mdir, "--json"] + args + extra, log)
                rows.append((label, j, secs))
                print(f"{name:20s} {label:40s} val_loss {j['val_loss']:.5f}  ({secs:.0f} s)", file=sys.stderr)
                return j

            bf16 = ev("BF16", ["--quant", "none"])
            for f in fitters:
                ev(f"LUT-B {f}, MXFP8 activations", ["--quant", "lutb", "--fitter", f, "--act-format", "mxfp8"])
                ev(f"LUT-B {f}, BF16 activations", ["--quant", "lutb", "--fitter", f, "--act-format", "bf16"])
            # The stored-checkpoint path: quantize to a LUT-B checkpoint, evaluate it.
            qdir = os.path.join(tmp, name + "-lutb")
            SHOW[qdir] = "$OUT/" + name + "-lutb"
            qcmd = [lutb, "quantize", mdir, "-o", qdir, "--no-progress", "--json"]
            if a.threads:
                qcmd += ["--threads", str(a.threads)]
            qj, qsecs = run(qcmd, log)
            j, secs = run([lutb, "eval", qdir, "--json"] + extra, log)
            rows.append((f"LUT-B checkpoint ({qj.get('fitter', fitters[0])}), MXFP8 activations", j, secs))
            print(f"{name:20s} {'LUT-B stored checkpoint':40s} val_loss {j['val_loss']:.5f}  ({secs:.0f} s)", file=sys.stderr)
            ev("INT3-g128, BF16 activations", ["--quant", "int3-g128"])
            ev("MXFP4, BF16 activations", ["--quant", "mxfp4"])

            lines = [f"## {name}", ""]
            lines.append(f"`{bf16['family']}`; routed experts: {bf16['expert_bytes_bf16']:,} bytes in BF16.")
            if ref and not a.max_windows:
                lines.append(f"transformers reference (`reference_eval.json`): val loss "
                             f"{ref['val_loss_fp32_compute']:.6f} (FP32 compute), {ref['val_loss_bf16_compute']:.6f} "
                             f"(BF16 compute); `lutb eval --quant none`: {bf16['val_loss']:.6f} "
                             f"(difference {bf16['val_loss'] - ref['val_loss_fp32_compute']:+.2e}).")
            lines += ["", "| routed experts | val loss (nats) | Δ vs BF16 | expert SQNR (dB) | bits/weight | "
                          "routed-expert bytes | eval tokens/s |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for label, j, secs in rows:
                sq = "" if j["sqnr_db"] is None else f"{j['sqnr_db']:.2f}"
                d = j["val_loss"] - bf16["val_loss"]
                lines.append(f"| {label} | {j['val_loss']:.4f} | {d:+.4f} | {sq} | {j['bits_per_weight']:.4f} | "
                             f"{j['expert_bytes']:,} | {j['tokens_per_second']:.0f} |")
            lines += ["", f"Stored LUT-B checkpoint: `lutb quantize` wrote {qj.get('tensors_quantized', '?')} tensors, "
                          f"{qj.get('bytes_before', 0):,} → {qj.get('bytes_after', 0):,} bytes, in {qsecs:.1f} s.", ""]
            sections.append("\n".join(lines))
            best = min((r for r in rows if r[0].startswith("LUT-B") and "MXFP8" in r[0]), key=lambda r: r[1]["val_loss"])
            summary.append((name, bf16, best, [r for r in rows if r[0].startswith(("INT3", "MXFP4"))]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    finished = datetime.datetime.now(datetime.timezone.utc)
    out = ["# Results: LUT-B on the shared MoE models", "",
           "Generated by `scripts/results.sh` (do not edit by hand; rerun it). Held-out loss under the protocol of",
           "spec section 8: `val_tokens.safetensors`, non-overlapping windows of 256 tokens from index 0, the last",
           "partial window dropped, mean next-token NLL in nats over the 255 predicted positions of every window"
           + (f" (**first {a.max_windows} windows only**)." if a.max_windows else " (151 windows, 38,505 tokens)."),
           "All rows run the same CPU forward pass (`lutb eval`, FP32 compute); only the routed experts change:",
           "BF16 = the checkpoint's weights (BF16 reference of spec 4); LUT-B = the online method (routed experts",
           "fitted to LUT-B while loading, emulated Rubin numerics) or a stored LUT-B checkpoint written by",
           "`lutb quantize`; INT3-g128 and MXFP4 = weights quantise-dequantised with `lutb/baselines.hpp` and run",
           "with BF16 activations. Router, attention, embeddings and shared experts stay BF16 throughout.",
           "SQNR is over all routed-expert weights (10·log10(Σw²/Σ(w−ŵ)²)); bytes are the routed experts' storage",
           "(LUT-B: 201 bytes per 8×64 tile; baselines: their bits per weight).", "",
           f"- Machine: {machine()}", f"- Date: {started:%Y-%m-%d %H:%M} UTC (took {(finished - started).total_seconds() / 60:.1f} min)",
           f"- lutb: commit `{rev}`", "",
           "## Summary", "",
           "| model | BF16 | best LUT-B (MXFP8 act.) | INT3-g128 | MXFP4 | routed experts BF16 → LUT-B bytes |",
           "|---|---:|---:|---:|---:|---:|"]
    for name, bf16, best, base in summary:
        b = {r[0].split(",")[0]: r[1]["val_loss"] for r in base}
        out.append(f"| {name} | {bf16['val_loss']:.4f} | {best[1]['val_loss']:.4f} ({best[0].split(',')[0][6:]}) | "
                   f"{b.get('INT3-g128', float('nan')):.4f} | {b.get('MXFP4', float('nan')):.4f} | "
                   f"{bf16['expert_bytes_bf16']:,} → {best[1]['expert_bytes']:,} |")
    out += ["", "Eval speed (tokens/s) is the CPU emulation on the machine above, for orientation only; it is not a",
            "benchmark (see docs/perf/ for those).", ""]
    out += sections
    out += ["## Commands", "", "Every command this run executed (`lutb` = build/release/lutb, `$MODELS` = ../shared/models,",
            "`$OUT` = a temporary directory):", "", "```"]
    out += log
    out += ["```", ""]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp_out = a.out + ".tmp"
    with open(tmp_out, "w") as f:
        f.write("\n".join(out))
    os.replace(tmp_out, a.out)
    print(f"wrote {a.out}", file=sys.stderr)


def git_rev():
    try:
        r = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], stdout=subprocess.PIPE,
                               text=True).stdout.strip()
        return r + ("+dirty" if dirty else "")
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
