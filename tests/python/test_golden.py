"""Golden vectors of ../shared/golden (spec 2, 3, 4, 5) through the Python API, numpy and torch."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import lutb


def f32(h: str) -> float:
    return struct.unpack("<f", struct.pack("<I", int(h, 16)))[0]


def f32_array(rows) -> np.ndarray:
    return np.array([[f32(v) for v in r] for r in rows], dtype=np.float32)


def e4m3_value(b: int) -> float:
    return float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float()[0])


def tiles_to_weight(tiles: list, tn: int, tk: int, lead=()):
    packed = np.array([list(bytes.fromhex(t["packed"])) for t in tiles], dtype=np.uint8)
    codebook = np.array([t["codebook"] for t in tiles], dtype=np.uint8)
    scale = np.array([t["scale"] for t in tiles], dtype=np.uint8)
    return (packed.reshape(lead + (tn, tk, 192)), codebook.reshape(lead + (tn, tk, 8)),
            scale.reshape(lead + (tn, tk)))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_dequantize_golden(golden, kind):
    g = golden("lutb_dequant")
    n, k = g["N"], g["K"]
    tiles = sorted(g["tiles"], key=lambda t: (t["tn"], t["tk"]))
    p, c, s = tiles_to_weight(tiles, n // 8, k // 64)
    if kind == "torch":
        p, c, s = (torch.from_numpy(a) for a in (p, c, s))
    w = lutb.LutbWeight.from_tensors(p, c, s, (n, k))
    want = np.array([f32(v) for v in g["W"]], dtype=np.float32).reshape(n, k)
    got = w.dequantize(np.float32 if kind == "numpy" else torch.float32)
    got = got if kind == "numpy" else got.numpy()
    assert got.tobytes() == want.tobytes()


def test_mxfp8_golden(golden):
    g = golden("mxfp8_blocks")
    for rule in ("rceil", "floor"):
        x = np.array([[f32(v) for v in c["input"]] for c in g["cases"]], dtype=np.float32)
        want = np.empty_like(x)
        for i, c in enumerate(g["cases"]):
            b = c[rule]["scale"]
            if b == 255:
                want[i] = np.nan
            else:
                want[i] = [e4m3_value(q) * 2.0 ** (b - 127) for q in c[rule]["elements"]]
        for arr in (x, torch.from_numpy(x)):
            got = np.asarray(lutb.mxfp8_qdq(arr, rule))
            np.testing.assert_array_equal(got, want, err_msg=f"{rule} {type(arr).__name__}")


def test_deepseek_routing_golden(golden):
    for c in golden("deepseek_routing")["cases"]:
        logits = np.array([[f32(v) for v in c["logits"]]], dtype=np.float32)
        bias = np.array([f32(v) for v in c["e_score_correction_bias"]], dtype=np.float32)
        want_w = np.array([float(v) for v in c["weights"]])
        for lg, b in ((logits, bias), (torch.from_numpy(logits), torch.from_numpy(bias))):
            ids, w = lutb.route_deepseek(lg, b, c["top_k"], c["n_group"], c["topk_group"], c["norm_topk_prob"],
                                         c["routed_scaling_factor"])
            assert np.asarray(ids)[0].tolist() == c["expert_ids"]
            np.testing.assert_allclose(np.asarray(w)[0], want_w, rtol=1e-6)


def test_moe_layer_golden(golden):
    g = golden("lutb_moe_layer")
    e, h, i = g["E"], g["H"], g["I"]
    x = torch.from_numpy(f32_array(g["x"])).to(torch.bfloat16)
    ids = torch.tensor(g["topk_ids"], dtype=torch.int64)
    wts = torch.from_numpy(f32_array(g["topk_weights"]))
    parts13, parts2 = [], []
    for ex in g["experts"]:
        parts13.append(tiles_to_weight(ex["w13"], 2 * i // 8, h // 64))
        parts2.append(tiles_to_weight(ex["w2"], h // 8, i // 64))
    w13 = lutb.LutbWeight.from_tensors(*(torch.from_numpy(np.stack(a)) for a in zip(*parts13)), (e, 2 * i, h))
    w2 = lutb.LutbWeight.from_tensors(*(torch.from_numpy(np.stack(a)) for a in zip(*parts2)), (e, h, i))
    out = lutb.moe_experts(x, ids, wts, w13, w2).float().numpy()
    want = f32_array(g["out"])
    # The golden file's own acceptance rule: relative L2 error <= 1e-3, no NaN.
    assert not np.isnan(out).any()
    assert np.linalg.norm(out - want) / np.linalg.norm(want) <= 1e-3
