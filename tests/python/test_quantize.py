"""lutb.quantize and LutbWeight: bytes equal to the lutb CLI's, numpy and torch alike, checkpoint tensors."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

import lutb
from lutb import _impl


def weights(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def test_cli_byte_equality(cli, tmp_path):
    """The same tensors through `lutb quantize IN.safetensors -o OUT.safetensors --all` and lutb.quantize."""
    from safetensors.torch import load_file, save_file

    src = {
        "a.weight": weights((24, 100), 1),                   # padded in N and K
        "b.weight": weights((3, 16, 128), 2, torch.float32),  # stacked, FP32
        "c.weight": weights((40, 64), 3, torch.float16),
    }
    save_file(src, str(tmp_path / "in.safetensors"))
    subprocess.run([cli, "quantize", str(tmp_path / "in.safetensors"), "-o", str(tmp_path / "out.safetensors"),
                    "--all", "--no-progress"], check=True, capture_output=True)
    got = load_file(str(tmp_path / "out.safetensors"))
    for name, w in src.items():
        q = lutb.quantize(w)
        for suffix, mine in (("_packed", q.packed), ("_codebook", q.codebook), ("_scale", q.scale)):
            theirs = got[name + suffix]
            if theirs.dtype == torch.float8_e4m3fn:
                theirs = theirs.view(torch.uint8)
            assert theirs.shape == mine.shape, name + suffix
            assert torch.equal(theirs, mine), name + suffix


@pytest.mark.parametrize("fitter", lutb.fitter_names())
def test_numpy_and_torch_give_the_same_bytes(fitter):
    w = weights((2, 16, 128), 4, torch.float32)
    a = lutb.quantize(w, fitter)
    b = lutb.quantize(w.numpy(), fitter)
    assert isinstance(b.packed, np.ndarray)
    for x, y in ((a.packed, b.packed), (a.codebook, b.codebook), (a.scale, b.scale)):
        assert x.numpy().tobytes() == y.tobytes()
    # bfloat16 in numpy through ml_dtypes: the same values as the torch BF16 tensor.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    wb = w.to(torch.bfloat16)
    c = lutb.quantize(wb, fitter)
    d = lutb.quantize(wb.view(torch.int16).numpy().view(ml_dtypes.bfloat16), fitter)
    assert c.packed.numpy().tobytes() == d.packed.tobytes()
    assert c.scale.numpy().tobytes() == d.scale.tobytes()


def test_layout_and_error_bound():
    w = weights((3, 20, 130), 5, torch.float32)
    q = lutb.quantize(w)
    assert q.shape == (3, 20, 130)
    assert q.packed.shape == (3, 3, 3, 192) and q.packed.dtype == torch.uint8
    assert q.codebook.shape == (3, 3, 3, 8) and q.scale.shape == (3, 3, 3)
    assert q.device == "cpu"
    d = q.dequantize(torch.float32)
    assert d.shape == w.shape
    sqnr = 10 * torch.log10((w.double() ** 2).sum() / ((w.double() - d.double()) ** 2).sum())
    assert sqnr > 15.0  # 3-bit codebooks of Gaussian tiles: about 19-20 dB
    # Every dequantised value is a codebook entry of its tile times the tile's scale, exactly.
    assert torch.equal(q.dequantize(torch.bfloat16).float(), d)


def test_forced_scale_and_threads_do_not_change_bytes():
    w = weights((16, 128), 6, torch.float32)
    a = lutb.quantize(w, threads=1)
    b = lutb.quantize(w, threads=2)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.codebook, b.codebook)
    f = lutb.quantize(w, "optimal", forced_scale=120)
    assert bool((f.scale == 120).all())


def test_checkpoint_tensors_round_trip():
    w = weights((2, 16, 64), 7)
    q = lutb.quantize(w)
    t = q.tensors("model.layers.0.mlp.experts.gate_up_proj")
    assert set(t) == {"model.layers.0.mlp.experts.gate_up_proj.weight_" + s for s in ("packed", "codebook", "scale")}
    cb = t["model.layers.0.mlp.experts.gate_up_proj.weight_codebook"]
    assert cb.dtype == torch.float8_e4m3fn
    r = lutb.LutbWeight.from_tensors(t["model.layers.0.mlp.experts.gate_up_proj.weight_packed"], cb,
                                     t["model.layers.0.mlp.experts.gate_up_proj.weight_scale"], (2, 16, 64))
    assert torch.equal(r.dequantize(), q.dequantize())
    assert r.codebook.dtype == torch.uint8


def test_dequantize_torch_path_equals_the_library():
    """The torch-operation dequantisation (used on CUDA) against the C++ one, on the CPU."""
    w = weights((2, 20, 130), 8, torch.float32) * 1e3
    q = lutb.quantize(w, "optimal")
    a = _impl.dequantize_torch(q.packed, q.codebook, q.scale, q.shape)
    b = q.dequantize(torch.float32)
    assert torch.equal(a, b)


def test_numpy_path_without_torch():
    """With torch unavailable, lutb imports and its numpy path works (torch is optional)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, lutb\n"
        "w = (np.random.default_rng(0).standard_normal((2, 16, 64)) * 0.02).astype(np.float32)\n"
        "q = lutb.quantize(w)\n"
        "assert isinstance(q.packed, np.ndarray) and q.packed.shape == (2, 2, 1, 192)\n"
        "d = q.dequantize()\n"
        "assert d.dtype == np.float32 and d.shape == w.shape\n"
        "r = lutb.LutbWeight.from_tensors(q.packed, q.codebook, q.scale, q.shape)\n"
        "assert (r.dequantize() == d).all()\n"
        "assert lutb.mxfp8_qdq(w).shape == w.shape\n"
        "ids, wt = lutb.route_softmax_topk(w[0, :, :8].copy(), 2)\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_lane_major_host_permutation_is_a_bijection_per_tile():
    """lane_major_cpu (the reference of the CUDA copy) moves the same 1536 bits within each tile:
    every index of the tile reads back at its position (lutb/cuda/lane_major.hpp's lane_col map)."""
    from lutb import _lutb

    q = lutb.quantize(weights((2, 16, 128), 9))
    lm = torch.empty_like(q.packed)
    _lutb.lane_major_cpu(q.packed, lm)
    p = q.packed.reshape(-1, 64, 3).to(torch.int64)
    word = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)
    idx = ((word.unsqueeze(-1) >> torch.arange(0, 24, 3)) & 7).reshape(-1, 8, 64)  # [tile, r, c]
    b = lm.reshape(-1, 192).to(torch.int64)
    x = b[:, 0:128:4] | (b[:, 1:128:4] << 8) | (b[:, 2:128:4] << 16) | (b[:, 3:128:4] << 24)  # [tile, lane]
    y = b[:, 128::2] | (b[:, 129::2] << 8)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for j in range(16):
            c = 8 * t + j if j < 8 else 32 + 8 * t + (j - 8)
            if j < 8:
                v = (x[:, lane] >> (4 * j)) & 7
            elif j < 12:
                v = (y[:, lane] >> (4 * (j - 8))) & 7
            else:
                k = j - 12
                v = (((x[:, lane] >> (4 * k + 3)) & 1) | (((x[:, lane] >> (4 * (k + 4) + 3)) & 1) << 1)
                     | (((y[:, lane] >> (4 * k + 3)) & 1) << 2))
            assert torch.equal(v, idx[:, g, c]), (lane, j)


def test_packed_from_lane_major_inverts_the_permutation():
    """The torch inverse (used after LutbWeight.release_packed on CUDA) undoes lane_major_cpu exactly."""
    from lutb import _lutb

    q = lutb.quantize(weights((3, 24, 192), 10))
    lm = torch.empty_like(q.packed)
    _lutb.lane_major_cpu(q.packed, lm)
    assert not torch.equal(lm, q.packed)
    assert torch.equal(lutb.packed_from_lane_major(lm), q.packed)
    assert torch.equal(lutb.packed_from_lane_major(lm.reshape(-1, 192)), q.packed.reshape(-1, 192))
    with pytest.raises(TypeError, match="kernel_packed: dtype int16 is not uint8"):
        lutb.packed_from_lane_major(lm.view(torch.int16))
    with pytest.raises(ValueError, match=r"kernel_packed: shape \(3, 3, 3, 96\) does not end in 192"):
        lutb.packed_from_lane_major(lm[..., :96])
    with pytest.raises(TypeError, match="kernel_packed: expected a uint8 torch.Tensor, got ndarray"):
        lutb.packed_from_lane_major(lm.numpy())
    q.release_packed()  # no effect on the CPU
    assert q._packed is not None and q.kernel_packed() is q.packed
