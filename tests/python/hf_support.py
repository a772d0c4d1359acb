"""Shared helpers of the transformers and calibration tests: where the shared models, the calibration
tokens and the lutb CLI are, one CLI runner and calibration statistics made by it. Tests that need
any of them skip when it is absent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, shared_dir  # noqa: E402  (tests/python is on sys.path under pytest)

FAMILY_MODELS = {"qwen3_moe": "tiny-qwen3-moe", "mixtral": "tiny-mixtral", "deepseek_v3": "tiny-deepseek-v3"}


def model_dir(name: str) -> Path:
    """A shared model's folder; skips the test when it is absent."""
    s = shared_dir()
    if s is None or not (s / "models" / name).is_dir():
        pytest.skip(f"shared model {name} not found (set LUTB_SHARED_DIR)")
    return s / "models" / name


def cli_path() -> Path:
    """The lutb CLI, found as conftest's `cli` fixture finds it (LUTB_CLI, else build/release/lutb or
    build/cpu/lutb, else PATH), for module-scoped fixtures; skips the test when none exists."""
    env = os.environ.get("LUTB_CLI")
    candidates = [Path(env)] if env else [REPO / "build" / "release" / "lutb", REPO / "build" / "cpu" / "lutb"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    found = shutil.which("lutb")
    if found and not env:
        return Path(found)
    pytest.skip("lutb CLI not found (build it with `cmake --build --preset cpu --target lutb_cli` or set LUTB_CLI)")


def read_tensors(folder: Path) -> dict:
    """Every tensor of a checkpoint folder's *.safetensors (torch), but the shared models' token and
    activation files."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        if f.name in ("val_tokens.safetensors", "moe_activations.safetensors"):
            continue
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def raw_bytes(t):
    """A torch tensor's bytes as uint8 (for byte-for-byte comparisons of any dtype)."""
    import torch

    return t.contiguous().view(torch.uint8)


def calibration_tokens() -> Path:
    """../shared/calib/train_tokens.safetensors (the calibration set; never the models' val_tokens);
    skips the test when it is absent."""
    s = shared_dir()
    if s is None or not (s / "calib" / "train_tokens.safetensors").is_file():
        pytest.skip("shared calibration tokens not found (set LUTB_SHARED_DIR)")
    return s / "calib" / "train_tokens.safetensors"


def calibrate(model: Path, out: Path, max_tokens: int = 1024, full_moments: bool = False) -> Path:
    """`lutb calibrate MODEL --tokens ../shared/calib/train_tokens.safetensors --max-tokens N -o OUT`
    (1024 tokens: under a second on the shared models), with --full-moments when asked; returns OUT."""
    run_cli("calibrate", str(model), "--tokens", str(calibration_tokens()), "--max-tokens", str(max_tokens), "-o",
            str(out), *(["--full-moments"] if full_moments else []))
    return out


def run_cli(*args: str, threads: int = 1) -> dict:
    """Runs `lutb ARGS --json` and returns its JSON summary (the last line of stdout); a non-zero
    exit fails the test with the CLI's stderr."""
    cmd = [str(cli_path()), *args, "--json"]
    if args[0] in ("quantize", "eval"):
        cmd += ["--threads", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])
