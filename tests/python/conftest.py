"""Shared fixtures of the Python tests: the ../shared data folder, the lutb CLI binary, the CUDA marker."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def shared_dir() -> pathlib.Path | None:
    """LUTB_SHARED_DIR, else ../shared beside the repository; None when absent."""
    env = os.environ.get("LUTB_SHARED_DIR")
    p = pathlib.Path(env) if env else REPO.parent / "shared"
    return p if p.is_dir() else None


@pytest.fixture
def golden():
    """Loads ../shared/golden/NAME.json; skips the test when the folder is absent."""
    import json

    d = shared_dir()
    if d is None or not (d / "golden").is_dir():
        pytest.skip("../shared/golden is absent (set LUTB_SHARED_DIR)")

    def load(name: str):
        return json.loads((d / "golden" / f"{name}.json").read_text())

    return load


@pytest.fixture
def cli() -> str:
    """Path of the lutb CLI: LUTB_CLI, else build/release/lutb or build/cpu/lutb; skips when absent."""
    env = os.environ.get("LUTB_CLI")
    candidates = [env] if env else [str(REPO / "build" / p / "lutb") for p in ("release", "cpu")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    found = shutil.which("lutb")
    if found and not env:
        return found
    pytest.skip("the lutb CLI is not built (cmake --preset release; or set LUTB_CLI)")


def _cuda_ready() -> bool:
    try:
        import torch

        import lutb
    except ImportError:
        return False
    return torch.cuda.is_available() and lutb.has_cuda()


def pytest_collection_modifyitems(config, items):
    if _cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and a CUDA build of lutb")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
