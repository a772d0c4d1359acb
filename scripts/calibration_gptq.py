#!/usr/bin/env python3
"""GPTQ-style cross-column error feedback within LUT-B's tiles, judged on the selection sets of
scripts/calibration_rules.py (docs/calibration.md, "Cross-column error feedback (GPTQ within the
tiles): measured, not in the library").

For each routed expert projection W [N, K] with the full second moment C = E[x x^T] of its input over
the tokens routed to it (gate/up: x = bf16(token); down: h = bf16(silu(g) * u)), GPTQ (Frantar et al.
2022) runs over K in blocks of 64 columns, one LUT-B tile column span:
  1. the block's 8x64 tiles get their codebook and scale from lutb's binned-dp fit of the current,
     error-updated weights (lutb.quantize, column weights of the uniform rule, as `lutb quantize
     --calibration` weighs);
  2. each column of the block takes the nearest entry of its tile's codebook (ties to the lower
     index), and its error, divided by the inverse Hessian's Cholesky diagonal, is subtracted from the
     block's remaining columns and, after the block, from every later column.
H = C_e + damp * mean(diag C_e) * I, with C_e blended with the layer's C by token count as lutb
blends the diagonal (n0 = 32). Without step 2's feedback the result is exactly lutb's calibrated
binned-dp fit (--check asserts it byte for byte). --order diag quantises each block's columns in
descending diag(H) (GPTQ's act-order, kept inside the tile so the format holds).

The covariances come from the BF16 checkpoint run in FP32 by transformers over the first 65,536
training tokens (windows of 256), the tokens `lutb calibrate` reads; their diagonals are compared with
lutb's statistics file (--check). The indices, codebooks and scales are written into a copy of the
data-free LUT-B checkpoint and evaluated by `lutb eval` with its stored LUT-B weights (MXFP8
activations), so the figures are those of `--quant lutb`.

Usage: scripts/calibration_gptq.py [--lutb PATH] [--models DIR] [--calib-tokens FILE] [--work DIR]
                                   [--threads N] [--sets samples,train-end] [--variants LIST] [--check]
                                   [--output-error]
--output-error prints sum tr(D H D^T) / sum tr(W H W^T) per projection for each fit (D its error).
A variant is dampD[-diag] (e.g. damp0.01, damp0.1-diag). Results share calibration_rules.py's cache
(WORK/results.json) and are printed as the increase of the loss over BF16 against data-free binned-dp
and the uniform calibrated rule.
"""
import argparse
import os
import re
import shutil
import sys

import numpy as np
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import calibration_rules as R  # noqa: E402

TILE_N, TILE_K = 8, 64


def covariances(a, model):
    """{layer: (C_gu [E, H, H], C_down [E, I, I], tokens [E])} of the routed experts, float64 sums / n."""
    path = os.path.join(a.work, f"cov-{model}.npz")
    if os.path.exists(path):
        z = np.load(path)
        return {int(k[3:]): (z[f"gu{k[3:]}"], z[f"dn{k[3:]}"], z[f"n{k[3:]}"]) for k in z.files if k.startswith("lay")}
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads or os.cpu_count())
    m = AutoModelForCausalLM.from_pretrained(os.path.join(a.models, model), dtype=torch.float32).eval()
    acc = {}

    def hook(layer):
        def fn(mod, args):
            x, idx = args[0], args[1]
            E = mod.gate_up_proj.shape[0]
            if layer not in acc:
                H, I2 = mod.gate_up_proj.shape[2], mod.gate_up_proj.shape[1]
                acc[layer] = [torch.zeros(E, H, H, dtype=torch.float64), torch.zeros(E, I2 // 2, I2 // 2, dtype=torch.float64),
                              torch.zeros(E, dtype=torch.float64)]
            gu, dn, n = acc[layer]
            xb = x.to(torch.bfloat16).to(torch.float32)
            for e in range(E):
                tok = (idx == e).nonzero()[:, 0]
                if len(tok) == 0:
                    continue
                xe = xb[tok]
                g, u = torch.nn.functional.linear(xe, mod.gate_up_proj[e]).chunk(2, dim=-1)
                h = (torch.nn.functional.silu(g) * u).to(torch.bfloat16).to(torch.float64)
                xe = xe.to(torch.float64)
                gu[e] += xe.T @ xe
                dn[e] += h.T @ h
                n[e] += len(tok)
        return fn

    for name, mod in m.named_modules():
        if type(mod).__name__.endswith("Experts"):
            mod.register_forward_pre_hook(hook(int(re.search(r"\.layers\.(\d+)\.", name).group(1))))
    ids = load_file(a.calib_tokens)["input_ids"][:R.CAL_TOKENS].astype(np.int64).reshape(-1, 256)
    with torch.no_grad():
        for b in range(0, len(ids), 16):
            m(torch.from_numpy(ids[b:b + 16]), output_router_logits=False)
    out = {}
    for layer, (gu, dn, n) in acc.items():
        nn = n.clamp(min=1)[:, None, None]
        out[f"lay{layer}"] = np.zeros(1)
        out[f"gu{layer}"], out[f"dn{layer}"], out[f"n{layer}"] = (gu / nn).numpy(), (dn / nn).numpy(), n.numpy()
    np.savez(path, **out)
    return covariances(a, model)


def blend(C, n):
    """lutb's blend of each expert's moments with the layer's by token count (n0 = 32), [E, K, K]."""
    layer = (n[:, None, None] * C).sum(0) / n.sum()
    return (n[:, None, None] * C + R.N0 * layer) / (n[:, None, None] + R.N0)


def e4m3(b):
    import ml_dtypes
    return np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def gptq(W, H, cw, damp, order, feedback=True):
    """LUT-B indices [TN, TK, 512], codebooks [TN, TK, 8] (E4M3 bytes), scales [TN, TK] of W [N, K]."""
    import lutb
    N, K = W.shape
    TN, TK = N // TILE_N, K // TILE_K
    W = W.astype(np.float64).copy()
    H = H + damp * np.mean(np.diag(H)) * np.eye(K)
    perm = np.arange(K)
    if order == "diag":  # descending diag(H) inside each tile column span
        perm = np.concatenate([b + np.argsort(-np.diag(H)[b:b + TILE_K], kind="stable") for b in range(0, K, TILE_K)])
    Hp = H[np.ix_(perm, perm)]
    U = np.linalg.cholesky(np.linalg.inv(Hp)).T  # upper Cholesky factor of H^-1 (GPTQ)
    Wp = W[:, perm]
    idx = np.zeros((N, K), np.uint8)
    cb = np.zeros((TN, TK, 8), np.uint8)
    sc = np.zeros((TN, TK), np.uint8)
    for t in range(TK):
        i1, i2 = t * TILE_K, (t + 1) * TILE_K
        cols = perm[i1:i2]  # original columns of this span (the same set as i1..i2)
        block = np.empty((N, TILE_K), np.float32)
        block[:, cols - i1] = Wp[:, i1:i2]
        q = lutb.quantize(np.ascontiguousarray(block), "binned-dp", column_weights=np.ascontiguousarray(cw[i1:i2]),
                          threads=1)
        cb[:, t], sc[:, t] = np.asarray(q.codebook)[:, 0], np.asarray(q.scale)[:, 0]
        vals = e4m3(cb[:, t]) * np.exp2(sc[:, t].astype(np.float64) - 127)[:, None]  # [TN, 8]
        rowvals = np.repeat(vals, TILE_N, 0)  # [N, 8]
        W1, Err1 = Wp[:, i1:i2].copy(), np.zeros((N, TILE_K))
        for i in range(TILE_K):
            w = W1[:, i]
            j = np.argmin(np.abs(w[:, None] - rowvals), 1)  # first minimum: ties to the lower index
            idx[:, cols[i]] = j
            err = (w - rowvals[np.arange(N), j]) / U[i1 + i, i1 + i]
            if feedback:
                W1[:, i:] -= np.outer(err, U[i1 + i, i1 + i:i2])
            Err1[:, i] = err
        if feedback:
            Wp[:, i2:] -= Err1 @ U[i1:i2, i2:]
    tiles = idx.reshape(TN, TILE_N, TK, TILE_K).transpose(0, 2, 1, 3).reshape(TN, TK, 512)
    return tiles, cb, sc


def pack(tiles):
    """Checkpoint bytes [TN, TK, 192] of 3-bit indices [TN, TK, 512] (spec section 2, as R.dequantize reads)."""
    g = tiles.astype(np.uint32).reshape(*tiles.shape[:2], 64, 8)
    word = sum(g[..., j] << (3 * j) for j in range(8))
    return np.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], -1).reshape(*tiles.shape[:2], 192).astype(np.uint8)


def checkpoint(a, model, variant, feedback=True):
    """A LUT-B checkpoint (copy of the data-free one) whose routed experts are the GPTQ fit of `variant`."""
    import torch
    from safetensors.torch import save_file as save_pt
    import lutb
    out = os.path.join(a.work, f"gptq-{model}-{variant}" + ("" if feedback else "-nofeedback"))
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    damp, order = float(variant.split("-")[0][4:]), ("diag" if variant.endswith("-diag") else "col")
    base = R.lutb_checkpoint(a, model, "data-free")
    cov = covariances(a, model)
    st = lutb.CalibrationStats(R.stats(a, model, "uniform"))
    fq = safe_open(os.path.join(base, "model.safetensors"), "pt")
    ref = safe_open(os.path.join(a.models, model, "model.safetensors"), "pt")
    d = {k: fq.get_tensor(k) for k in fq.keys()}
    blended = {L: (blend(gu, n), blend(dn, n)) for L, (gu, dn, n) in cov.items()}
    for L in st.layers:
        prefix = st.layer(L).prefix
        for k in ref.keys():
            mt = re.match(re.escape(prefix) + r"\.(\d+)\.(\w+)\.weight$", k)
            if not mt:
                continue
            e, down = int(mt.group(1)), mt.group(2) in ("w2", "down_proj")
            W = ref.get_tensor(k).to(torch.float32).numpy()
            H = blended[L][1 if down else 0][e]
            cw = st.column_weights(L, "down" if down else "gate_up")[e]
            tiles, cb, sc = gptq(W, H, cw, damp, order, feedback)
            p = k[:-len(".weight")]
            assert d[p + ".weight_packed"].shape == (*tiles.shape[:2], 192), (k, d[p + ".weight_packed"].shape)
            d[p + ".weight_packed"] = torch.from_numpy(pack(tiles))
            d[p + ".weight_codebook"] = torch.from_numpy(cb).view(d[p + ".weight_codebook"].dtype)
            d[p + ".weight_scale"] = torch.from_numpy(sc).to(d[p + ".weight_scale"].dtype)
    os.makedirs(out, exist_ok=True)
    for fn in os.listdir(base):
        if fn != "model.safetensors":
            shutil.copy(os.path.join(base, fn), os.path.join(out, fn))
    save_pt({k: v.contiguous() for k, v in d.items()}, os.path.join(out, "model.safetensors"), metadata=fq.metadata())
    return out


def check(a, model):
    """Without feedback the GPTQ path gives lutb's calibrated bytes; C's diagonal matches lutb's statistics."""
    cov = covariances(a, model)
    st = safe_open(R.stats(a, model, "uniform"), "np")
    worst = 0.0
    for L, (gu, dn, n) in cov.items():
        prefix = [p for p in R.layers({k: 0 for k in st.keys()}) if f".layers.{L}." in p][0]
        for e in range(len(n)):
            for C, proj in ((gu, "gate_up"), (dn, "down")):
                s = st.get_tensor(f"{prefix}.{e}.{proj}.x2").astype(np.float64)
                worst = max(worst, np.abs(np.diag(C[e]) - s).sum() / s.sum())
    print(f"{model}: largest sum |diag C - lutb x2| / sum x2 of an expert projection = {worst:.3g}", flush=True)
    mine = safe_open(os.path.join(checkpoint(a, model, "damp0.01", feedback=False), "model.safetensors"), "np")
    cal = safe_open(os.path.join(R.lutb_checkpoint(a, model, "uniform"), "model.safetensors"), "np")
    diff = [k for k in cal.keys() if k.endswith("weight_packed") and not np.array_equal(mine.get_tensor(k), cal.get_tensor(k))]
    print(f"{model}: without feedback, packed tensors that differ from lutb's calibrated fit: {len(diff)}", flush=True)


def output_error(a, model, fits):
    """{fit: {projection: sum_e tr(D_e H_e D_e^T) / tr(W_e H_e W_e^T)}} over all routed experts, H the
    blended C without damping: the output error that GPTQ minimises, for LUT-B checkpoints `fits`."""
    import torch
    cov = covariances(a, model)
    st = safe_open(R.stats(a, model, "uniform"), "np")
    ref = safe_open(os.path.join(a.models, model, "model.safetensors"), "pt")
    qs = {f: safe_open(os.path.join(p, "model.safetensors"), "pt") for f, p in fits.items()}
    sums = {f: {"gate_up": np.zeros(2), "down": np.zeros(2)} for f in fits}
    for L, (gu, dn, n) in cov.items():
        prefix = [p for p in R.layers({k: 0 for k in st.keys()}) if f".layers.{L}." in p][0]
        Hs = {"gate_up": blend(gu, n), "down": blend(dn, n)}
        for k in ref.keys():
            mt = re.match(re.escape(prefix) + r"\.(\d+)\.(\w+)\.weight$", k)
            if not mt:
                continue
            proj = "down" if mt.group(2) in ("w2", "down_proj") else "gate_up"
            H = Hs[proj][int(mt.group(1))]
            W = ref.get_tensor(k).to(torch.float32).numpy().astype(np.float64)
            for f, fq in qs.items():
                D = R.dequantize(fq, k[:-7])[:W.shape[0], :W.shape[1]] - W
                sums[f][proj] += [np.einsum("nk,kl,nl->", D, H, D), np.einsum("nk,kl,nl->", W, H, W)]
    return {f: {p: v[0] / v[1] for p, v in s.items()} for f, s in sums.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lutb", default=os.path.join(R.ROOT, "build", "release", "lutb"))
    ap.add_argument("--models", default=os.path.join(R.ROOT, "..", "shared", "models"))
    ap.add_argument("--calib-tokens", default=os.path.join(R.ROOT, "..", "shared", "calib", "train_tokens.safetensors"))
    ap.add_argument("--work", default=os.path.join(R.ROOT, "build", "calibration-rules"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--sets", default="samples,train-end")
    ap.add_argument("--variants", default="damp0.01,damp0.1")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--output-error", action="store_true")
    a = ap.parse_args()
    a.lutb, a.models, a.calib_tokens, a.work = map(os.path.abspath, (a.lutb, a.models, a.calib_tokens, a.work))
    a.thr = ["--threads", str(a.threads)] if a.threads else []
    os.makedirs(a.work, exist_ok=True)
    cache = R.Cache(os.path.join(a.work, "results.json"))
    models = sorted(d for d in os.listdir(a.models) if os.path.isfile(os.path.join(a.models, d, "config.json")))
    if a.check:
        for m in models:
            check(a, m)
    variants = [v for v in a.variants.split(",") if v]
    if a.output_error:
        print("\nRelative output error sum tr(D H D^T) / sum tr(W H W^T) of the routed experts (H = blended C)\n")
        print("| model | projection | data-free | uniform | " + " | ".join(variants) + " |\n|---|---|" +
              "---:|" * (2 + len(variants)))
        for m in models:
            fits = {"data-free": R.lutb_checkpoint(a, m, "data-free"), "uniform": R.lutb_checkpoint(a, m, "uniform")}
            fits.update({v: checkpoint(a, m, v) for v in variants})
            e = output_error(a, m, fits)
            for proj in ("gate_up", "down"):
                print(f"| {m} | {proj} | " + " | ".join(f"{e[f][proj]:.5f}" for f in fits) + " |", flush=True)
    for sel in [s for s in a.sets.split(",") if s]:
        print(f"\n{sel}: increase of the loss over BF16 (change against data-free binned-dp / the uniform rule)\n")
        print("| fit | " + " | ".join(models) + " |\n|---|" + "---:|" * len(models), flush=True)
        rows = [("data-free", None), ("uniform", None)] + [(v, v) for v in variants]
        for label, variant in rows:
            cells = []
            for m in models:
                b = R.loss(a, cache, m, sel, "none")
                free = R.loss(a, cache, m, sel, "lutb", "binned-dp") - b
                uni = R.loss(a, cache, m, sel, "lutb", "binned-dp", "uniform") - b
                if variant is None:
                    v = free if label == "data-free" else uni
                else:
                    q = checkpoint(a, m, variant)
                    v = cache.get(f"{m}|{sel}|gptq|binned-dp|{variant}", lambda: R.run_json(
                        [a.lutb, "eval", q, "--json"] + R.tokens_args(a, m, sel) + a.thr)["val_loss"]) - b
                cells.append(f"{v:+.4f}" + ("" if variant is None and label == "data-free" else
                                            f" ({(v - free) / free * 100:+.0f} % / {(v - uni) / uni * 100:+.0f} %)"))
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
