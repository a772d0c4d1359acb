"""lutb.hf.LutbConfig(calibration=STATS): quantise while loading with the column weights of `lutb
calibrate` statistics gives the bytes of `lutb quantize --calibration` and the held-out loss of
`lutb eval --calibration`; with statistics that hold the full second moments, the bytes of the CLI's
fit with cross-column error feedback (LutbConfig(error_feedback=False): those of `--error-feedback
off`); statistics of another model stop the load, naming the file and the tensor, before any weight
is fitted."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file as load_numpy  # noqa: E402
from safetensors.numpy import save_file as save_numpy  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import lutb  # noqa: E402
import lutb.hf  # noqa: E402
from hf_support import FAMILY_MODELS, calibrate, model_dir, raw_bytes, read_tensors, run_cli  # noqa: E402
from lutb.eval import perplexity  # noqa: E402

FAMILIES = list(FAMILY_MODELS)
WINDOWS = int(os.environ.get("LUTB_EVAL_WINDOWS", "8"))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """family -> (statistics of 1024 calibration tokens, the `lutb quantize --calibration` checkpoint)."""
    root = tmp_path_factory.mktemp("hf_calib")
    out = {}
    for fam, name in FAMILY_MODELS.items():
        stats = calibrate(model_dir(name), root / f"{name}.stats.safetensors")
        run_cli("quantize", str(model_dir(name)), "-o", str(root / name), "--calibration", str(stats), "--no-progress")
        out[fam] = (stats, root / name)
    return out


@pytest.fixture(scope="module")
def full_moments(tmp_path_factory):
    """family -> (statistics of 1024 tokens with the full second moments, the `lutb quantize
    --calibration` checkpoint (error feedback, the default), the one of `--error-feedback off`)."""
    root = tmp_path_factory.mktemp("hf_feedback")
    out = {}
    for fam, name in FAMILY_MODELS.items():
        stats = calibrate(model_dir(name), root / f"{name}.full.safetensors", full_moments=True)
        run_cli("quantize", str(model_dir(name)), "-o", str(root / name), "--calibration", str(stats), "--no-progress")
        run_cli("quantize", str(model_dir(name)), "-o", str(root / f"{name}.off"), "--calibration", str(stats),
                "--error-feedback", "off", "--no-progress")
        out[fam] = (stats, root / name, root / f"{name}.off")
    return out


def load_calibrated(family, stats, error_feedback=True, damping=0.01, **kw):
    cfg = lutb.hf.LutbConfig(calibration=stats, error_feedback=error_feedback, damping=damping)
    return AutoModelForCausalLM.from_pretrained(model_dir(FAMILY_MODELS[family]), dtype=torch.bfloat16,
                                                quantization_config=cfg, **kw)


def assert_saves_the_bytes_of(model, cli_dir, folder):
    """save_pretrained(folder) writes every tensor of the CLI's checkpoint, the LUT-B ones byte for byte."""
    model.save_pretrained(folder)
    mine, ref = read_tensors(folder), read_tensors(cli_dir)
    assert sorted(mine) == sorted(ref)
    lutb_keys = [k for k in ref if k.endswith(("_packed", "_codebook", "_scale"))]
    assert lutb_keys
    for k in lutb_keys:
        assert mine[k].shape == ref[k].shape and torch.equal(raw_bytes(mine[k]), raw_bytes(ref[k])), k


@pytest.mark.parametrize("family", FAMILIES)
def test_calibrated_load_saves_the_cli_bytes(family, calibrated, tmp_path):
    stats, cli_dir = calibrated[family]
    model = load_calibrated(family, stats)
    assert model.config.quantization_config.calibration == str(stats)
    model.save_pretrained(tmp_path / "saved")
    mine, ref = read_tensors(tmp_path / "saved"), read_tensors(cli_dir)
    assert sorted(mine) == sorted(ref)
    lutb_keys = [k for k in ref if k.endswith(("_packed", "_codebook", "_scale"))]
    assert lutb_keys
    for k in lutb_keys:
        assert mine[k].shape == ref[k].shape and torch.equal(raw_bytes(mine[k]), raw_bytes(ref[k])), k
    # the stored block is the CLI's: the statistics file is a loading option, not recorded
    saved_q = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    cli_q = json.loads((cli_dir / "config.json").read_text())["quantization_config"]
    assert saved_q == cli_q and "calibration" not in saved_q
    # the weights changed the fit: the data-free load holds other bytes
    free = AutoModelForCausalLM.from_pretrained(model_dir(FAMILY_MODELS[family]), dtype=torch.bfloat16,
                                                quantization_config=lutb.hf.LutbConfig())
    layer = next(m for m in free.modules() if isinstance(m, lutb.hf.LutbExperts))
    name = next(n for n, m in free.named_modules() if m is layer)
    assert not torch.equal(layer.gate_up_proj_packed, model.get_submodule(name).gate_up_proj_packed)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_moments_load_saves_the_cli_feedback_bytes(family, full_moments, tmp_path):
    """Statistics with full second moments: the default load is `lutb quantize --calibration` (error
    feedback on), error_feedback=False is `--error-feedback off`, and the two differ."""
    stats, on_dir, off_dir = full_moments[family]
    assert lutb.CalibrationStats(stats).has_second_moments
    on = load_calibrated(family, stats)
    assert_saves_the_bytes_of(on, on_dir, tmp_path / "on")
    off = load_calibrated(family, stats, error_feedback=False)
    assert_saves_the_bytes_of(off, off_dir, tmp_path / "off")
    name, layer = next((n, m) for n, m in on.named_modules() if isinstance(m, lutb.hf.LutbExperts))
    assert not torch.equal(layer.gate_up_proj_packed, off.get_submodule(name).gate_up_proj_packed)
    assert not torch.equal(layer.down_proj_packed, off.get_submodule(name).down_proj_packed)


def test_damping_load_saves_the_cli_bytes(full_moments, tmp_path):
    """LutbConfig(damping=1.0) is `lutb quantize --damping 1`: the CLI's bytes, other than the default's."""
    stats, on_dir, _ = full_moments["qwen3_moe"]
    cli_dir = tmp_path / "cli"
    run_cli("quantize", str(model_dir(FAMILY_MODELS["qwen3_moe"])), "-o", str(cli_dir), "--calibration", str(stats),
            "--damping", "1", "--no-progress")
    damped = load_calibrated("qwen3_moe", stats, damping=1.0)
    assert_saves_the_bytes_of(damped, cli_dir, tmp_path / "s")
    default = read_tensors(on_dir)
    key = next(k for k in default if k.endswith("_packed"))
    assert not torch.equal(raw_bytes(read_tensors(cli_dir)[key]), raw_bytes(default[key]))


def test_error_feedback_needs_full_moments(calibrated, tmp_path):
    """Statistics without full moments: error_feedback=True changes nothing (the CLI's rule)."""
    stats, cli_dir = calibrated["qwen3_moe"]
    assert not lutb.CalibrationStats(stats).has_second_moments
    assert_saves_the_bytes_of(load_calibrated("qwen3_moe", stats, error_feedback=True), cli_dir, tmp_path / "s")


def test_calibrated_increase_agrees_with_cli_eval(calibrated):
    """Held-out loss over the first WINDOWS windows: the calibrated model's increase over BF16 from
    transformers (FP32 compute) and from `lutb eval --quant lutb --calibration` (the online fit with
    the same statistics) agree within 1e-3 nats (the pattern of test_hf_eval.py)."""
    family = "mixtral"
    stats, _ = calibrated[family]
    folder = model_dir(FAMILY_MODELS[family])
    tokens = folder / "val_tokens.safetensors"
    bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    base = perplexity(bf16, tokens, max_windows=WINDOWS, batch_size=4)
    del bf16
    quant = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=lutb.hf.LutbConfig(calibration=stats))
    lut = perplexity(quant, tokens, max_windows=WINDOWS, batch_size=4)
    cli_base = run_cli("eval", str(folder), "--quant", "none", "--max-windows", str(WINDOWS))
    cli_lut = run_cli("eval", str(folder), "--quant", "lutb", "--calibration", str(stats), "--act-format", "mxfp8",
                      "--max-windows", str(WINDOWS))
    assert base.windows == cli_base["windows"] == cli_lut["windows"] == WINDOWS
    hf_increase = lut.loss - base.loss
    cli_increase = cli_lut["val_loss"] - cli_base["val_loss"]
    assert abs(hf_increase - cli_increase) < 1e-3, (hf_increase, cli_increase)


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------
def no_fit(*args, **kwargs):
    raise AssertionError("a weight was fitted before the statistics were checked")


def test_statistics_of_another_model_stop_the_load(calibrated, tmp_path, monkeypatch):
    monkeypatch.setattr(lutb, "quantize", no_fit)
    # tiny-deepseek-v3's statistics have no layer 0 (a dense layer there); tiny-qwen3-moe's layer 0 is MoE
    other, _ = calibrated["deepseek_v3"]
    with pytest.raises(ValueError, match=f"{other}: no calibration statistics for tensor "
                                         r"model\.layers\.0\.mlp\.experts\.gate_up_proj \(no layer's experts prefix "
                                         r"matches; the file has layers \[1, 2, 3\]"):
        load_calibrated("qwen3_moe", other)
    # Mixtral's statistics name its experts block_sparse_moe: none matches a qwen3 layer
    with pytest.raises(ValueError, match="no calibration statistics for tensor model.layers.0.mlp.experts"):
        load_calibrated("qwen3_moe", calibrated["mixtral"][0])
    # the same layers with other column counts: every down statistic cut to 128 of 256 columns
    own, _ = calibrated["qwen3_moe"]
    t = load_numpy(str(own))
    cut = {k: (v[:128] if k.endswith(".down.x2") else v) for k, v in t.items()}
    bad = tmp_path / "cut.safetensors"
    save_numpy(cut, str(bad), metadata={"format": "lutb-calibration"})
    with pytest.raises(ValueError, match=f"{bad}: tensor model.layers.0.mlp.experts.down_proj is fitted as 16 "
                                         r"expert\(s\) x 256 columns, but the statistics of its input \(down\) have 16 "
                                         r"expert\(s\) x 128 columns \(were they collected on this model\?\)"):
        load_calibrated("qwen3_moe", bad)
    # statistics of a model with more layers (layer 3's copied as layer 9): as the CLI refuses them
    more = dict(t)
    more.update({k.replace("model.layers.3.", "model.layers.9."): v for k, v in t.items()
                 if k.startswith("model.layers.3.")})
    extra = tmp_path / "more.safetensors"
    save_numpy(more, str(extra), metadata={"format": "lutb-calibration"})
    with pytest.raises(ValueError, match=rf"{extra}: layer 9 \(model\.layers\.9\.mlp\.experts\) has statistics, but "
                                         r"the model has no routed experts under that prefix \(were they collected on "
                                         r"this model\?\)"):
        load_calibrated("qwen3_moe", extra)
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_calibrated("qwen3_moe", tmp_path / "missing.safetensors")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"fitter": "ct-lloyd", "calibration": "s.safetensors"}, ValueError,
     "fitter 'ct-lloyd' has no weighted objective; calibration needs 'binned-dp' or 'optimal'"),
    ({"fitter": "multistart", "calibration": "s.safetensors"}, ValueError, "fitter 'multistart' has no weighted"),
    ({"calibration": 3}, TypeError, "calibration must be a path"),
    ({"calibration": "s.safetensors", "error_feedback": "on"}, TypeError, "error_feedback must be a bool, got str"),
    ({"calibration": "s.safetensors", "damping": -0.5}, ValueError, "damping -0.5 is not finite and >= 0"),
    ({"calibration": "s.safetensors", "damping": float("nan")}, ValueError, "damping nan is not finite and >= 0"),
    ({"calibration": "s.safetensors", "damping": float("inf")}, ValueError, "damping inf is not finite and >= 0"),
    ({"calibration": "s.safetensors", "damping": "0.1"}, TypeError, "damping must be a real number, got str"),
    ({"calibration": "s.safetensors", "damping": True}, TypeError, "damping must be a real number, got bool"),
])
def test_config_refuses_calibration(kwargs, error, message):
    with pytest.raises(error, match=message):
        lutb.hf.LutbConfig(**kwargs)


def test_config_keeps_calibration_out_of_the_stored_block(tmp_path):
    cfg = lutb.hf.LutbConfig(fitter="optimal", calibration=tmp_path / "s.safetensors")
    assert cfg.calibration == str(tmp_path / "s.safetensors")
    assert "calibration" not in cfg.to_dict()
    assert lutb.hf.LutbConfig.from_dict(cfg.to_dict()).calibration is None
    off = lutb.hf.LutbConfig(fitter="optimal", calibration=tmp_path / "s.safetensors",
                              error_feedback=False)
    assert off.error_feedback is False and cfg.error_feedback is True
    assert off.to_dict() == cfg.to_dict() and "error_feedback" not in off.to_dict()
    damped = lutb.hf.LutbConfig(fitter="optimal", calibration=tmp_path / "s.safetensors", damping=1)
    assert damped.damping == 1.0 and cfg.damping == 0.01
    # numpy's bool (what a flag read from an array is) is a bool, as for the routers' renormalize
    np_off = lutb.hf.LutbConfig(fitter="optimal", calibration=tmp_path / "s.safetensors",
                                 error_feedback=np.bool_(False))
    assert np_off.error_feedback is False
    assert damped.to_dict() == cfg.to_dict() and "damping" not in damped.to_dict()
    assert lutb.hf.LutbHfQuantizer.requires_calibration is False  # fits BF16 weights while loading


# ---------------------------------------------------------------------------------------------
# GPU (skipped without CUDA)
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_calibrated_load_saves_the_cli_bytes(family, calibrated, tmp_path):
    pytest.importorskip("accelerate")  # device_map needs it
    stats, cli_dir = calibrated[family]
    model = load_calibrated(family, stats, device_map="cuda")
    assert all(m.gate_up_proj_packed.is_cuda for m in model.modules() if isinstance(m, lutb.hf.LutbExperts))
    model.save_pretrained(tmp_path / "saved")
    mine, ref = read_tensors(tmp_path / "saved"), read_tensors(cli_dir)
    for k in ref:
        if k.endswith(("_packed", "_codebook", "_scale")):
            assert torch.equal(raw_bytes(mine[k]), raw_bytes(ref[k])), k


@pytest.mark.cuda
def test_cuda_full_moments_load_fits_on_the_cpu(full_moments, tmp_path):
    """device_map="cuda" with error feedback: each stack is fitted on the CPU and its buffers moved to
    the GPU; the bytes are the CLI's."""
    pytest.importorskip("accelerate")
    stats, on_dir, _ = full_moments["mixtral"]
    model = load_calibrated("mixtral", stats, device_map="cuda")
    assert all(m.gate_up_proj_packed.is_cuda for m in model.modules() if isinstance(m, lutb.hf.LutbExperts))
    assert_saves_the_bytes_of(model, on_dir, tmp_path / "saved")
