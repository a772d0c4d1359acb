"""Calibrated fitting from Python: lutb.quantize(column_weights=...) and lutb.CalibrationStats.

The weighted fit gives the bytes of `lutb quantize --calibration` (checkpoint and file modes, both
weighted fitters, one expert at a time and whole stacks), constant weights give the data-free
bytes, the weighted optimum beats the data-free one on the weighted error, the column weights follow
the rule of docs/calibration.md (checked against an independent float64 reference), and bad weights
or files are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file

import lutb
from hf_support import calibrate, model_dir, run_cli

PRIOR_TOKENS = 32.0  # n0 of docs/calibration.md
MIN_WEIGHT = 1e-3


def tensors_of(lw: lutb.LutbWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return lw.packed, lw.codebook, lw.scale


def assert_same_bytes(lw: lutb.LutbWeight, ckpt: dict[str, torch.Tensor], stem: str) -> None:
    for part, got in zip(("packed", "codebook", "scale"), tensors_of(lw)):
        want = ckpt[f"{stem}_{part}"].view(torch.uint8)
        got = torch.as_tensor(got)
        assert got.shape == want.shape and torch.equal(got, want), f"{stem}_{part}"


def weighted_error(w: np.ndarray, lw: lutb.LutbWeight, d: np.ndarray) -> tuple[float, float]:
    """(sum_rc d_c (w - w_hat)^2, sum (w - w_hat)^2) in float64."""
    err = (w.astype(np.float64) - np.asarray(lw.dequantize(np.float32), dtype=np.float64)) ** 2
    return float((err * d.astype(np.float64)).sum()), float(err.sum())


# ---------------------------------------------------------------------------------------------
# the bytes of `lutb quantize --calibration`
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """tiny-mixtral (3 MoE layers of 8 experts, H = 192, I = 320: neither a multiple of 64 x 8 tiles
    of the other), its statistics of 1024 calibration tokens (layer 1's expert 3 gets none), and the
    calibrated `lutb quantize` checkpoint of them."""
    root = tmp_path_factory.mktemp("calib")
    src = model_dir("tiny-mixtral")
    stats = calibrate(src, root / "stats.safetensors")
    run_cli("quantize", str(src), "-o", str(root / "q"), "--calibration", str(stats), "--no-progress")
    return {"src": src, "stats": stats, "bf16": load_file(str(src / "model.safetensors")),
            "cli": load_file(str(root / "q" / "model.safetensors")), "root": root}


def test_statistics_of_the_cli_file(mixtral):
    s = lutb.CalibrationStats(mixtral["stats"])
    assert s.layers == (0, 1, 2)
    assert s.tokens == 1024 and s.model == str(mixtral["src"])
    assert s.metadata["format"] == "lutb-calibration"
    L = s.layer(1)
    assert (L.prefix, L.experts, L.hidden, L.intermediate) == ("model.layers.1.block_sparse_moe.experts", 8, 192, 320)
    assert L.tokens.shape == (8,) and L.gate_up_x2.shape == (8, 192) and L.down_x2.shape == (8, 320)
    # each token is routed to top-k = 2 experts of every layer
    assert all(s.layer(i).tokens.sum() == 2 * 1024 for i in s.layers)
    assert L.tokens[3] == 0 and not L.gate_up_x2[3].any()  # the expert no token reaches: weights come from the rule


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_per_expert_fit_is_the_cli_calibrated_checkpoint(mixtral, kind):
    """Every routed-expert tensor of the model: lutb.quantize with the expert's row of
    column_weights(layer, projection) gives the checkpoint's bytes (binned-dp)."""
    s = lutb.CalibrationStats(mixtral["stats"])
    bf16, cli = mixtral["bf16"], mixtral["cli"]
    checked = 0
    for layer in s.layers:
        d = {"gate_up": s.column_weights(layer, "gate_up"), "down": s.column_weights(layer, "down")}
        for e in range(8):
            for proj, which in (("w1", "gate_up"), ("w3", "gate_up"), ("w2", "down")):
                stem = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}.weight"
                w, cw = bf16[stem], d[which][e]
                if kind == "numpy":
                    w = w.float().numpy()
                else:
                    cw = torch.from_numpy(cw)
                assert_same_bytes(lutb.quantize(w, column_weights=cw), cli, stem)
                checked += 1
    assert checked == 3 * 8 * 3


def test_stacked_fit_with_the_layer_weights_is_the_cli_checkpoint(mixtral):
    """The stack [E, 2I, H] of [w1; w3] per expert (the fused gate_up of transformers) with the
    layer's [E, H] weights: the per-expert checkpoint tensors, tile row for tile row."""
    s = lutb.CalibrationStats(mixtral["stats"])
    bf16, cli = mixtral["bf16"], mixtral["cli"]
    p = "model.layers.1.block_sparse_moe.experts"
    w13 = torch.stack([torch.cat([bf16[f"{p}.{e}.w1.weight"], bf16[f"{p}.{e}.w3.weight"]]) for e in range(8)])
    cw = torch.from_numpy(s.column_weights(1, "gate_up"))
    q = lutb.quantize(w13, column_weights=cw)
    # the same weights found by the checkpoint's name of the stack, as `lutb quantize` finds them
    np.testing.assert_array_equal(s.weights_for_tensor(f"{p}.gate_up_proj", 8, 192), cw.numpy())
    np.testing.assert_array_equal(s.weights_for_tensor(f"{p}.5.w3.weight", 1, 192), cw.numpy()[5:6])
    assert s.weights_for_tensor("model.layers.1.self_attn.q_proj.weight", 1, 192) is None
    for e in range(8):
        for half, proj in ((slice(0, 40), "w1"), (slice(40, 80), "w3")):  # I / 8 = 40 tile rows each
            stem = f"{p}.{e}.{proj}.weight"
            for part, got in zip(("packed", "codebook", "scale"), tensors_of(q)):
                assert torch.equal(got[e, half], cli[f"{stem}_{part}"].view(torch.uint8)), f"{stem}_{part}"
    # the data-free fit of the same stack differs (the weights change the fit)
    assert not torch.equal(lutb.quantize(w13).packed, q.packed)


def test_optimal_weighted_fit_is_the_cli_file_mode(mixtral):
    """`lutb quantize FILE.safetensors --match ... --fitter optimal --calibration` (the C++ weighted
    optimal fit of each tensor) against lutb.quantize(fitter="optimal", column_weights=...)."""
    out = mixtral["root"] / "optimal.safetensors"
    run_cli("quantize", str(mixtral["src"] / "model.safetensors"), "-o", str(out), "--fitter", "optimal",
            "--match", r"layers\.1\.block_sparse_moe\.experts\.[0-9]+\.w[123]\.weight", "--calibration",
            str(mixtral["stats"]), "--no-progress")
    cli = load_file(str(out))
    s = lutb.CalibrationStats(mixtral["stats"])
    for e in range(8):
        for proj, which in (("w1", "gate_up"), ("w3", "gate_up"), ("w2", "down")):
            stem = f"model.layers.1.block_sparse_moe.experts.{e}.{proj}.weight"
            cw = torch.from_numpy(s.column_weights(1, which)[e])
            assert_same_bytes(lutb.quantize(mixtral["bf16"][stem], "optimal", column_weights=cw), cli, stem)


# ---------------------------------------------------------------------------------------------
# the weighted objective
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fitter", ["binned-dp", "optimal"])
def test_constant_weights_give_the_data_free_bytes(fitter):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((3, 20, 130)) * 0.05).astype(np.float32)
    free = lutb.quantize(w, fitter)
    for cw in (np.ones(130, np.float32), np.full(130, 7.25, np.float32),
               np.array([[0.5], [3.0], [1e-3]], np.float32).repeat(130, axis=1)):  # a constant per expert
        q = lutb.quantize(w, fitter, column_weights=cw)
        for a, b in zip(tensors_of(free), tensors_of(q)):
            np.testing.assert_array_equal(a, b)


def test_weighted_optimal_beats_data_free_optimal_on_the_weighted_error():
    """"optimal" is the exact minimum of its objective: with weights it has the smaller weighted
    error, without them the smaller plain error; on these tiles both inequalities are strict."""
    rng = np.random.default_rng(4)
    for seed in range(4):
        w = (rng.standard_normal((8, 64)) * 0.05).astype(np.float32)
        d = np.exp(rng.uniform(np.log(1e-2), np.log(1e2), 64)).astype(np.float32)
        weighted = lutb.quantize(w, "optimal", column_weights=d)
        free = lutb.quantize(w, "optimal")
        we_w, se_w = weighted_error(w, weighted, d)
        we_f, se_f = weighted_error(w, free, d)
        assert we_w < we_f, (seed, we_w, we_f)
        assert se_f < se_w, (seed, se_f, se_w)


def test_broadcast_weights_equal_the_full_array():
    rng = np.random.default_rng(5)
    w = torch.from_numpy((rng.standard_normal((2, 3, 8, 64)) * 0.05).astype(np.float32))
    d = torch.from_numpy(rng.uniform(0.1, 10.0, 64).astype(np.float32))
    a = lutb.quantize(w, column_weights=d)
    b = lutb.quantize(w, column_weights=d.expand(6, 64).contiguous())
    c = lutb.quantize(w, column_weights=torch.stack([d, d * 2], 1).reshape(-1)[::2].expand(6, 64))  # strided
    for x, y, z in zip(tensors_of(a), tensors_of(b), tensors_of(c)):
        assert torch.equal(x, y) and torch.equal(x, z)


# ---------------------------------------------------------------------------------------------
# refusals of column_weights
# ---------------------------------------------------------------------------------------------
W = np.zeros((2, 8, 70), np.float32)


@pytest.mark.parametrize("cw, fitter, exc, message", [
    (np.ones(70, np.float64), None, TypeError, "column_weights: dtype float64 is not float32"),
    (np.ones((2, 64), np.float32), None, ValueError,
     r"column_weights: shape \(2, 64\) is not \[K\] = \(70,\) or \[E, K\] = \(2, 70\) for w of shape \(2, 8, 70\)"),
    (np.ones((1, 70), np.float32), None, ValueError, r"column_weights: shape \(1, 70\) is not"),
    (torch.ones(70), None, TypeError, "column_weights: a Tensor, but w is a ndarray"),
    ([1.0] * 70, None, TypeError, "column_weights: expected a torch.Tensor or numpy.ndarray, got list"),
    (np.ones(70, np.float32), "ct-lloyd", ValueError,
     "column_weights: fitter 'ct-lloyd' has no weighted objective; column weights need 'binned-dp' or 'optimal'"),
    (np.ones(70, np.float32), "multistart", ValueError, "column_weights: fitter 'multistart' has no weighted"),
])
def test_column_weights_refused(cw, fitter, exc, message):
    with pytest.raises(exc, match=message):
        lutb.quantize(W, fitter, column_weights=cw)


@pytest.mark.parametrize("value, shown", [(0.0, "0.0"), (-1.5, "-1.5"), (float("nan"), "nan"),
                                          (float("inf"), "inf")])
def test_column_weight_values_refused(value, shown):
    cw = np.ones((2, 70), np.float32)
    cw[1, 66] = value
    with pytest.raises(ValueError, match=f"^column_weights: expert 1, column 66 is {shown}; column weights must "
                                         "be finite and > 0$"):
        lutb.quantize(W, column_weights=cw)
    with pytest.raises(ValueError, match=f"^column_weights: column 66 is {shown};"):
        lutb.quantize(torch.from_numpy(W), column_weights=torch.from_numpy(cw[1]))


def test_ops_quantize_checks_column_weights():
    """torch.ops.lutb.quantize called directly runs the same checks."""
    w = torch.zeros(2, 8, 70)
    with pytest.raises(ValueError, match="column_weights: expert 0, column 3 is 0.0"):
        torch.ops.lutb.quantize(w, "binned-dp", -1, 0, "w", torch.ones(2, 70).index_fill_(1, torch.tensor([3]), 0))
    with pytest.raises(ValueError, match="column_weights: fitter 'ct-lloyd' has no weighted objective"):
        torch.ops.lutb.quantize(w, "ct-lloyd", -1, 0, "w", torch.ones(70))
    with pytest.raises(TypeError, match="column_weights: dtype bfloat16 is not float32"):
        torch.ops.lutb.quantize(w, "optimal", -1, 0, "w", torch.ones(70, dtype=torch.bfloat16))
    p, c, s = torch.ops.lutb.quantize(w + 0.5, "optimal", -1, 0, "w", torch.ones(70))
    assert p.shape == (2, 1, 2, 192) and torch.equal(s, lutb.quantize(w + 0.5, "optimal").scale)


# ---------------------------------------------------------------------------------------------
# the rule for rarely routed experts, against an independent float64 reference
# ---------------------------------------------------------------------------------------------
def rule_reference(tokens: np.ndarray, x2: np.ndarray) -> np.ndarray:
    """docs/calibration.md: blend with the layer by token count, divide by the column mean, floor at
    1e-3; all ones when no token reached the layer."""
    n = tokens.astype(np.float64)[:, None]
    x = x2.astype(np.float64)
    if n.sum() <= 0:
        return np.ones_like(x)
    m_layer = (n * x).sum(0) / n.sum()
    d = (n * x + PRIOR_TOKENS * m_layer) / (n + PRIOR_TOKENS)
    return np.maximum(d / d.mean(1, keepdims=True), MIN_WEIGHT)


def write_stats(path, tokens, gate_up, down, prefix="model.layers.0.mlp.experts", metadata=None):
    t = {}
    for e in range(len(tokens)):
        t[f"{prefix}.{e}.gate_up.x2"] = np.asarray(gate_up[e], np.float32)
        t[f"{prefix}.{e}.down.x2"] = np.asarray(down[e], np.float32)
        t[f"{prefix}.{e}.tokens"] = np.asarray([tokens[e]], np.float32)
    save_numpy(t, str(path), metadata=metadata or {"format": "lutb-calibration", "model": "synthetic", "tokens": "9"})
    return path


def test_column_weights_follow_the_rule(mixtral):
    from lutb import _lutb

    assert (_lutb.CALIBRATION_PRIOR_TOKENS, _lutb.CALIBRATION_MIN_RELATIVE_WEIGHT) == (PRIOR_TOKENS, MIN_WEIGHT)
    s = lutb.CalibrationStats(mixtral["stats"])
    for layer in s.layers:
        L = s.layer(layer)
        for which, x2 in (("gate_up", L.gate_up_x2), ("down", L.down_x2)):
            got = s.column_weights(layer, which)
            assert got.dtype == np.float32 and got.shape == x2.shape
            np.testing.assert_allclose(got, rule_reference(L.tokens, x2), rtol=2e-6, atol=0)
            np.testing.assert_allclose(got.astype(np.float64).mean(1), 1.0, rtol=1e-5)


def test_rule_edge_cases(tmp_path):
    H, I = 64, 8
    rng = np.random.default_rng(6)
    gu = rng.uniform(0.5, 2.0, (3, H)).astype(np.float32)
    dn = rng.uniform(0.5, 2.0, (3, I)).astype(np.float32)
    gu[:, 7] = 0.0  # a column silent in the whole layer: floored at 1e-3
    gu[1] = 0.0     # expert 1: no token, no statistics
    dn[1] = 0.0
    s = lutb.CalibrationStats(write_stats(tmp_path / "a.safetensors", [100.0, 0.0, 5.0], gu, dn))
    w = s.column_weights(0, "gate_up")
    np.testing.assert_allclose(w, rule_reference(np.array([100.0, 0.0, 5.0]), gu), rtol=2e-6)
    assert (w[:, 7] == np.float32(MIN_WEIGHT)).all()
    m_layer = (100.0 * gu[0].astype(np.float64) + 5.0 * gu[2]) / 105.0  # the expert without tokens takes the layer's
    np.testing.assert_allclose(w[1], np.maximum(m_layer / m_layer.mean(), MIN_WEIGHT), rtol=2e-6)
    # no token reached the layer: all ones (the data-free fit)
    s0 = lutb.CalibrationStats(write_stats(tmp_path / "b.safetensors", [0.0, 0.0, 0.0], gu * 0, dn * 0))
    np.testing.assert_array_equal(s0.column_weights(0, "down"), np.ones((3, I), np.float32))


# ---------------------------------------------------------------------------------------------
# refusals of CalibrationStats
# ---------------------------------------------------------------------------------------------
def test_calibration_stats_refusals(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        lutb.CalibrationStats(tmp_path / "missing.safetensors")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        lutb.CalibrationStats(tmp_path)
    with pytest.raises(TypeError, match="path: expected a str or os.PathLike, got int"):
        lutb.CalibrationStats(3)
    f = tmp_path / "other.safetensors"
    save_numpy({"input_ids": np.zeros(4, np.int32)}, str(f))
    with pytest.raises(ValueError, match=f"{f}: tensor input_ids is not a calibration statistic"):
        lutb.CalibrationStats(f)
    g = tmp_path / "f16.safetensors"
    save_numpy({"model.layers.0.mlp.experts.0.gate_up.x2": np.ones(64, np.float16)}, str(g))
    with pytest.raises(ValueError, match=f"{g}: tensor model.layers.0.mlp.experts.0.gate_up.x2 has dtype F16"):
        lutb.CalibrationStats(g)
    gu, dn = np.ones((2, 64)), np.ones((2, 8))
    dn[1, 3] = -1.0
    h = write_stats(tmp_path / "neg.safetensors", [1.0, 1.0], gu, dn)
    with pytest.raises(ValueError, match=f"{h}: tensor model.layers.0.mlp.experts.1.down.x2 holds -1 at \\[3\\]"):
        lutb.CalibrationStats(h)
    s = lutb.CalibrationStats(write_stats(tmp_path / "ok.safetensors", [1.0, 1.0], gu, np.ones((2, 8))))
    with pytest.raises(ValueError, match="projection: 'up' is not 'gate_up' or 'down'"):
        s.column_weights(0, "up")
    with pytest.raises(ValueError, match="ok.safetensors: no statistics for layer 4"):
        s.column_weights(4, "down")
    with pytest.raises(TypeError, match="layer: expected an int"):
        s.column_weights("0", "down")
    with pytest.raises(ValueError, match=r"ok.safetensors: tensor model.layers.0.mlp.experts.down_proj is fitted as "
                                         r"2 expert\(s\) x 16 columns, but the statistics of its input \(down\) have "
                                         r"2 expert\(s\) x 8 columns"):
        s.weights_for_tensor("model.layers.0.mlp.experts.down_proj", 2, 16)


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): the weighted GPU fit gives the CPU bytes
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("fitter", ["binned-dp", "optimal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_expert", [True, False])
def test_cuda_weighted_fit_same_bytes_as_cpu(fitter, dtype, per_expert):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(3, 20, 130, generator=g) * 0.05).to(dtype)
    shape = (3, 130) if per_expert else (130,)
    d = torch.exp(torch.empty(shape).uniform_(-4.0, 4.0, generator=g))
    d[..., 128:] = 0.25  # the padded tile's logical columns (130 = 2 tiles + 2 columns)
    a = lutb.quantize(w, fitter, column_weights=d)
    b = lutb.quantize(w.cuda(), fitter, column_weights=d.cuda())
    assert not torch.equal(a.packed, lutb.quantize(w, fitter).packed)
    for x, y in zip(tensors_of(a), tensors_of(b)):
        assert torch.equal(x, y.cpu())


@pytest.mark.cuda
def test_cuda_weighted_fit_of_a_model_expert_is_the_cli_checkpoint(mixtral):
    s = lutb.CalibrationStats(mixtral["stats"])
    p = "model.layers.1.block_sparse_moe.experts"
    for e in (0, 3):  # expert 3: no calibration token, the layer's statistics
        stem = f"{p}.{e}.w2.weight"
        cw = torch.from_numpy(s.column_weights(1, "down")[e]).cuda()
        q = lutb.quantize(mixtral["bf16"][stem].cuda(), column_weights=cw)
        assert_same_bytes(q.to("cpu"), mixtral["cli"], stem)


@pytest.mark.cuda
def test_cuda_column_weights_refused_like_the_cpu():
    w = torch.zeros(2, 8, 70)
    with pytest.raises(ValueError, match="column_weights: on cpu, but w is on cuda"):
        lutb.quantize(w.cuda(), column_weights=torch.ones(70))
    cw = torch.ones(2, 70)
    cw[1, 9] = float("nan")
    with pytest.raises(ValueError) as cpu:
        lutb.quantize(w, column_weights=cw)
    with pytest.raises(ValueError) as gpu:
        lutb.quantize(w.cuda(), column_weights=cw.cuda())
    assert str(cpu.value) == str(gpu.value)
    with pytest.raises(ValueError, match="column_weights: fitter 'ct-lloyd' has no weighted objective"):
        lutb.quantize(w.cuda(), "ct-lloyd", column_weights=cw.cuda())
