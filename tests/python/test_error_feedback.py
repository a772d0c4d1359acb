"""The fit with cross-column error feedback from Python: lutb.quantize(second_moments=...) and
CalibrationStats.second_moments.

With the statistics of `lutb calibrate --full-moments`, the column weights and the second moments of
each tensor give the bytes of `lutb quantize --calibration` (whose default is error feedback), one
expert at a time and as a fused stack; without the moments, the bytes of `--error-feedback off`. The
moments follow the blending rule of docs/calibration.md (checked against the file's raw tensors in
float64), moments without off-diagonal terms change nothing, and bad moments or damping are refused
by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file

import lutb
from hf_support import calibrate, model_dir, run_cli

PRIOR_TOKENS = 32.0  # n0 of docs/calibration.md
P = "model.layers.{layer}.block_sparse_moe.experts"
PROJS = (("w1", "gate_up"), ("w3", "gate_up"), ("w2", "down"))


def tensors_of(lw: lutb.LutbWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.as_tensor(t) for t in (lw.packed, lw.codebook, lw.scale))


def same_bytes(lw: lutb.LutbWeight, ckpt: dict[str, torch.Tensor], stem: str) -> bool:
    return all(torch.equal(got, ckpt[f"{stem}_{part}"].view(torch.uint8))
               for part, got in zip(("packed", "codebook", "scale"), tensors_of(lw)))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """tiny-mixtral (3 MoE layers of 8 experts, H = 192, I = 320; layer 1's expert 3 gets no
    calibration token), its statistics of 1024 tokens with the full moments, and the `lutb quantize
    --calibration` checkpoints with error feedback (the default) and without."""
    root = tmp_path_factory.mktemp("feedback")
    src = model_dir("tiny-mixtral")
    stats = calibrate(src, root / "full.safetensors", full_moments=True)
    run_cli("quantize", str(src), "-o", str(root / "on"), "--calibration", str(stats), "--no-progress")
    run_cli("quantize", str(src), "-o", str(root / "off"), "--calibration", str(stats), "--error-feedback", "off",
            "--no-progress")
    return {"src": src, "stats": stats, "root": root, "bf16": load_file(str(src / "model.safetensors")),
            "on": load_file(str(root / "on" / "model.safetensors")),
            "off": load_file(str(root / "off" / "model.safetensors"))}


# ---------------------------------------------------------------------------------------------
# CalibrationStats: the full moments
# ---------------------------------------------------------------------------------------------
def test_second_moments_follow_the_blending_rule(mixtral):
    """C_e = (n_e M_e + n0 M_layer) / (n_e + n0), M_layer = sum n_e M_e / sum n_e, from the file's raw
    PREFIX.e.gate_up.xxT / down.hhT in float64."""
    s = lutb.CalibrationStats(mixtral["stats"])
    raw = load_numpy(str(mixtral["stats"]))
    assert s.has_second_moments and all(s.layer(i).full_moments for i in s.layers)
    for layer in s.layers:
        L = s.layer(layer)
        n = L.tokens.astype(np.float64)
        for which, suffix, k in (("gate_up", "gate_up.xxT", 192), ("down", "down.hhT", 320)):
            m = np.stack([raw[f"{L.prefix}.{e}.{suffix}"] for e in range(8)]).astype(np.float64)
            m_layer = np.einsum("e,eij->ij", n, m) / n.sum()
            want = (n[:, None, None] * m + PRIOR_TOKENS * m_layer) / (n[:, None, None] + PRIOR_TOKENS)
            got = s.second_moments(layer, which)
            assert got.dtype == np.float32 and got.shape == (8, k, k)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12 * np.abs(want).max())
            np.testing.assert_array_equal(s.second_moments(layer, which, range(2, 4)), got[2:4])
            np.testing.assert_array_equal(s.second_moments_for_tensor(f"{L.prefix}.5.{'w2' if which == 'down' else 'w1'}"
                                                                      ".weight", 1, k), got[5:6])
    # layer 1's expert 3 saw no token: it takes the layer's moments
    L = s.layer(1)
    assert L.tokens[3] == 0
    m = np.stack([raw[f"{L.prefix}.{e}.down.hhT"] for e in range(8)]).astype(np.float64)
    np.testing.assert_allclose(s.second_moments(1, "down", range(3, 4))[0],
                               np.einsum("e,eij->ij", L.tokens.astype(np.float64), m) / L.tokens.sum(), rtol=1e-6)


def test_statistics_without_full_moments(mixtral, tmp_path):
    s = lutb.CalibrationStats(calibrate(mixtral["src"], tmp_path / "diag.safetensors", max_tokens=256))
    assert not s.has_second_moments and not s.layer(0).full_moments
    with pytest.raises(ValueError, match=r"diag.safetensors: layer 0 \(model.layers.0.block_sparse_moe.experts\) has "
                                         r"no full second moments \(PREFIX.e.gate_up.xxT; lutb calibrate "
                                         r"--full-moments stores them\)"):
        s.second_moments(0, "gate_up")
    full = lutb.CalibrationStats(mixtral["stats"])
    with pytest.raises(ValueError, match=r"experts: range\(6, 9\) is empty or not within the layer's experts 0..7"):
        full.second_moments(0, "down", range(6, 9))
    with pytest.raises(ValueError, match="experts: range"):
        full.second_moments(0, "down", range(0, 8, 2))
    with pytest.raises(ValueError, match="projection: 'up' is not 'gate_up' or 'down'"):
        full.second_moments(0, "up")
    with pytest.raises(ValueError, match="full.safetensors: no statistics for layer 7"):
        full.second_moments(7, "down")
    assert full.second_moments_for_tensor("model.layers.1.self_attn.q_proj.weight", 1, 192) is None


# ---------------------------------------------------------------------------------------------
# the bytes of `lutb quantize --calibration`
# ---------------------------------------------------------------------------------------------
def test_per_expert_fit_is_the_cli_checkpoint(mixtral):
    """Every routed-expert tensor: lutb.quantize with its column weights and second moments (found by
    name) gives the checkpoint of `lutb quantize --calibration`; with the column weights alone, that
    of `--error-feedback off`; and the feedback changed most tensors."""
    s = lutb.CalibrationStats(mixtral["stats"])
    bf16, on, off = mixtral["bf16"], mixtral["on"], mixtral["off"]
    changed = 0
    for layer in s.layers:
        for e in range(8):
            for proj, which in PROJS:
                stem = f"{P.format(layer=layer)}.{e}.{proj}.weight"
                w = bf16[stem]
                k = w.shape[1]
                cw = torch.from_numpy(s.weights_for_tensor(stem, 1, k))
                sm = torch.from_numpy(s.second_moments_for_tensor(stem, 1, k))
                fb = lutb.quantize(w, column_weights=cw, second_moments=sm)
                plain = lutb.quantize(w, column_weights=cw)
                assert same_bytes(fb, on, stem), stem
                assert same_bytes(plain, off, stem), stem
                changed += not torch.equal(fb.packed, plain.packed)
    assert changed >= 3 * 8 * 3 - 2, changed


def test_stacked_fit_and_numpy_give_the_cli_checkpoint(mixtral):
    """The fused [E, 2I, H] stack of [w1; w3] with the layer's [E, H] weights and [E, H, H] moments
    (as lutb.hf fits it): the per-expert checkpoint tensors tile row for tile row; numpy arrays give
    the same bytes as torch tensors."""
    s = lutb.CalibrationStats(mixtral["stats"])
    bf16, on = mixtral["bf16"], mixtral["on"]
    p = P.format(layer=1)
    w13 = torch.stack([torch.cat([bf16[f"{p}.{e}.w1.weight"], bf16[f"{p}.{e}.w3.weight"]]) for e in range(8)])
    cw, sm = s.column_weights(1, "gate_up"), s.second_moments(1, "gate_up")
    np.testing.assert_array_equal(s.second_moments_for_tensor(f"{p}.gate_up_proj", 8, 192), sm)
    q = lutb.quantize(w13, column_weights=torch.from_numpy(cw), second_moments=torch.from_numpy(sm))
    for e in range(8):
        for half, proj in ((slice(0, 40), "w1"), (slice(40, 80), "w3")):  # I / 8 = 40 tile rows each
            stem = f"{p}.{e}.{proj}.weight"
            for part, got in zip(("packed", "codebook", "scale"), tensors_of(q)):
                assert torch.equal(got[e, half], on[f"{stem}_{part}"].view(torch.uint8)), f"{stem}_{part}"
    qn = lutb.quantize(w13.float().numpy(), column_weights=cw, second_moments=sm)
    for a, b in zip(tensors_of(q), tensors_of(qn)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# the fit with error feedback
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fitter", ["binned-dp", "optimal"])
def test_moments_without_cross_terms_give_the_column_weight_bytes(fitter):
    """A diagonal C (U diagonal) or zero moments (no signal) have nothing to feed back: the bytes of
    the fit with the column weights alone."""
    rng = np.random.default_rng(8)
    w = (rng.standard_normal((3, 20, 130)) * 0.05).astype(np.float32)
    d = np.exp(rng.uniform(-3.0, 3.0, (3, 130))).astype(np.float32)
    ref = lutb.quantize(w, fitter, column_weights=d)
    for sm in (np.stack([np.diag(x) for x in d]), np.zeros((130, 130), np.float32)):
        q = lutb.quantize(w, fitter, column_weights=d, second_moments=sm)
        for a, b in zip(tensors_of(ref), tensors_of(q)):
            np.testing.assert_array_equal(a, b)


def test_feedback_lowers_the_output_error():
    """Correlated inputs (C = A A^T / n): the summed output error sum_r dw_r^T C dw_r of the fit with
    feedback is below that of the fit with the diagonal's column weights alone, by at least 10 %."""
    rng = np.random.default_rng(9)
    k = 192
    a = rng.standard_normal((k, 16)) @ rng.standard_normal((16, 4 * k)) + 0.3 * rng.standard_normal((k, 4 * k))
    c = (a @ a.T / (4 * k)).astype(np.float32)
    w = (rng.standard_normal((64, k)) * 0.05).astype(np.float32)
    d = np.diag(c).copy()

    def output_error(q):
        dw = w.astype(np.float64) - np.asarray(q.dequantize(np.float32), np.float64)
        return float(np.einsum("ri,ij,rj->", dw, c.astype(np.float64), dw))

    fb = output_error(lutb.quantize(w, column_weights=d, second_moments=c))
    plain = output_error(lutb.quantize(w, column_weights=d))
    assert fb < 0.9 * plain, (fb, plain)


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------
W = np.zeros((2, 8, 70), np.float32)
C = np.eye(70, dtype=np.float32)


@pytest.mark.parametrize("sm, fitter, exc, message", [
    (C.astype(np.float64), None, TypeError, "second_moments: dtype float64 is not float32"),
    (np.ones((2, 70), np.float32), None, ValueError,
     r"second_moments: shape \(2, 70\) is not \[K, K\] = \(70, 70\) or \[E, K, K\] = \(2, 70, 70\) for w of shape "
     r"\(2, 8, 70\)"),
    (np.ones((1, 70, 70), np.float32), None, ValueError, r"second_moments: shape \(1, 70, 70\) is not"),
    (torch.eye(70), None, TypeError, "second_moments: a Tensor, but w is a ndarray"),
    ([[1.0]], None, TypeError, "second_moments: expected a torch.Tensor or numpy.ndarray, got list"),
    (C, "ct-lloyd", ValueError,
     "second_moments: fitter 'ct-lloyd' has no weighted objective; error feedback needs 'binned-dp' or 'optimal'"),
])
def test_second_moments_refused(sm, fitter, exc, message):
    with pytest.raises(exc, match=message):
        lutb.quantize(W, fitter, second_moments=sm)


@pytest.mark.parametrize("i, j, value, shown", [(5, 9, float("nan"), "nan"), (9, 5, float("inf"), "inf"),
                                                (66, 66, -0.5, "-0.5")])
def test_second_moment_values_refused(i, j, value, shown):
    sm = np.stack([C, C])
    sm[1, i, j] = value
    with pytest.raises(ValueError, match=fr"^second_moments: expert 1, \[{i}\]\[{j}\] is {shown}; second moments must "
                                         r"be finite, the diagonal >= 0$"):
        lutb.quantize(W, second_moments=sm)
    with pytest.raises(ValueError, match=fr"^second_moments: \[{i}\]\[{j}\] is {shown};"):
        lutb.quantize(torch.from_numpy(W), second_moments=torch.from_numpy(sm[1]))


def test_damping_refused():
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"^damping: {bad} is not finite and >= 0$"):
            lutb.quantize(W, second_moments=C, damping=bad)
    with pytest.raises(TypeError, match="damping: expected a float, got str"):
        lutb.quantize(W, second_moments=C, damping="0.1")
    # a singular C with no damping has no Cholesky factor
    singular = np.ones((70, 70), np.float32)
    with pytest.raises(ValueError, match=r"quantize: tensor w, expert 0: the second moments plus damping \(H = C \+ 0 "
                                         r"\* mean\(diag C\) \* I\) are not positive definite .*; raise the damping"):
        lutb.quantize(W + 0.5, second_moments=singular, damping=0.0)
    lutb.quantize(W + 0.5, second_moments=singular)  # the default damping 0.01 makes it definite


def test_ops_quantize_checks_second_moments():
    """torch.ops.lutb.quantize called directly runs the same checks and gives the same bytes."""
    rng = np.random.default_rng(10)
    w = torch.from_numpy((rng.standard_normal((2, 8, 70)) * 0.05).astype(np.float32))
    a = torch.from_numpy(rng.standard_normal((70, 140)).astype(np.float32))
    c = a @ a.T / 140
    with pytest.raises(ValueError, match=r"second_moments: expert 0, \[0\]\[0\] is -1.0"):
        torch.ops.lutb.quantize(w, "binned-dp", -1, 0, "w", None, -torch.eye(70).expand(2, 70, 70))
    with pytest.raises(ValueError, match="damping: -1.0 is not finite and >= 0"):
        torch.ops.lutb.quantize(w, "binned-dp", -1, 0, "w", None, c, -1.0)
    p, cb, s = torch.ops.lutb.quantize(w, "binned-dp", -1, 0, "w", None, c, 0.05)
    q = lutb.quantize(w, second_moments=c, damping=0.05)
    assert torch.equal(p, q.packed) and torch.equal(cb, q.codebook) and torch.equal(s, q.scale)
    assert not torch.equal(p, lutb.quantize(w, second_moments=c).packed)  # the damping matters


@pytest.mark.cuda
def test_cuda_second_moments_refused():
    w = torch.zeros(2, 8, 70)
    with pytest.raises(ValueError, match=r"^second_moments: the fit with cross-column error feedback runs on the CPU "
                                         r"only \(it has no GPU fitter\); quantize w.cpu\(\) and move the result"):
        lutb.quantize(w.cuda(), second_moments=torch.eye(70))
    with pytest.raises(ValueError, match="second_moments: the fit with cross-column error feedback runs on the CPU"):
        torch.ops.lutb.quantize(w.cuda(), "binned-dp", -1, 0, "w", None, torch.eye(70).cuda())
    with pytest.raises(ValueError, match="second_moments: on cuda:0, but w is on cpu"):
        lutb.quantize(w, second_moments=torch.eye(70).cuda())
