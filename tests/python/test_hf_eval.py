"""lutb.eval.perplexity (spec 8 protocol) and lm-evaluation-harness in process on LUT-B models.

The held-out test compares transformers (FP32 compute) with `lutb eval` on the first
LUTB_EVAL_WINDOWS windows (default 8; 151 is the full protocol of docs/python.md): the LUT-B
increase over BF16 must agree within 1e-3 nats, from the same fitted bytes."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

import lutb.hf  # noqa: E402
from hf_support import FAMILY_MODELS, model_dir, run_cli  # noqa: E402
from lutb.eval import load_tokens, perplexity  # noqa: E402

WINDOWS = int(os.environ.get("LUTB_EVAL_WINDOWS", "8"))


class Constant(torch.nn.Module):
    """A causal LM whose next-token distribution is softmax(bias) at every position."""

    def __init__(self, bias):
        super().__init__()
        self.bias = torch.as_tensor(bias, dtype=torch.float32)
        self.config = type("C", (), {"vocab_size": self.bias.numel()})()
        self.device = torch.device("cpu")
        self.calls = 0

    def forward(self, input_ids):
        self.calls += 1
        logits = self.bias.expand(*input_ids.shape, -1)
        return type("O", (), {"logits": logits})()


def test_perplexity_is_the_mean_nll_over_full_windows():
    bias = torch.tensor([0.0, 1.0, 2.0, 3.0])
    logp = torch.log_softmax(bias, 0)
    tokens = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0, 2, 2, 1])  # windows of 4: [0 1 2 3] [3 2 1 0]; 3 dropped
    r = perplexity(Constant(bias), tokens, window=4)
    want = -(logp[[1, 2, 3, 2, 1, 0]].double().sum() / 6).item()
    assert (r.windows, r.predicted_tokens) == (2, 6)
    assert r.loss == pytest.approx(want, abs=1e-12)
    assert r.perplexity == pytest.approx(math.exp(want), rel=1e-12)
    m = Constant(bias)
    assert perplexity(m, tokens, window=4, batch_size=2).loss == pytest.approx(want, abs=1e-12)
    assert m.calls == 1
    assert perplexity(Constant(bias), tokens, window=4, max_windows=1).predicted_tokens == 3


@pytest.mark.parametrize("kwargs, error, message", [
    ({"window": 1}, ValueError, "window: must be >= 2"),
    ({"batch_size": 0}, ValueError, "batch_size: must be >= 1"),
    ({"max_windows": 0}, ValueError, "max_windows: must be >= 1"),
    ({"tokens": [1, 2, 3]}, ValueError, "tokens: 3 tokens hold no full window of 4"),
    ({"tokens": [1, 2, 3, 9]}, ValueError, "tokens: id 9 is outside the vocabulary of 4"),
    ({"tokens": torch.tensor([0.5, 1.0])}, ValueError, "tokens: ids must be integers"),
    ({"tokens": [1, -2, 3, 0]}, ValueError, "tokens: ids must be >= 0"),
])
def test_perplexity_refuses(kwargs, error, message):
    args = {"tokens": [0, 1, 2, 3], "window": 4, **kwargs}
    with pytest.raises(error, match=message):
        perplexity(Constant([0.0, 0.0, 0.0, 0.0]), **args)


def test_load_tokens_reads_val_tokens(tmp_path):
    from safetensors.torch import save_file

    save_file({"input_ids": torch.tensor([[5, 6], [7, 8]], dtype=torch.int32)}, str(tmp_path / "t.safetensors"))
    assert load_tokens(tmp_path / "t.safetensors").tolist() == [5, 6, 7, 8]
    save_file({"ids": torch.tensor([1])}, str(tmp_path / "u.safetensors"))
    with pytest.raises(ValueError, match=r"holds no 'input_ids' tensor \(it has \['ids'\]\)"):
        load_tokens(tmp_path / "u.safetensors")
    with pytest.raises(FileNotFoundError, match="tokens: .*missing.safetensors does not exist"):
        load_tokens(tmp_path / "missing.safetensors")


def test_bf16_loss_matches_transformers_loss():
    """perplexity() equals transformers' own mean loss (labels=input_ids) window by window."""
    folder = model_dir("tiny-qwen3-moe")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = load_tokens(folder / "val_tokens.safetensors")[:512].view(2, 256)
    with torch.no_grad():  # without the router's auxiliary loss, which this config adds to `loss`
        own = sum(model(input_ids=w[None], labels=w[None], output_router_logits=False).loss.item() for w in ids) / 2
    assert perplexity(model, ids, max_windows=2).loss == pytest.approx(own, abs=2e-6)


def _increase_agrees_with_cli(family, tmp_path, device, windows):
    """transformers on `device` (FP32 compute) against `lutb eval` on the CPU, from the bytes the
    transformers model holds: the LUT-B increase over BF16 within 1e-3 nats (issue 24)."""
    folder = model_dir(FAMILY_MODELS[family])
    tokens = folder / "val_tokens.safetensors"
    placement = {} if device == "cpu" else {"device_map": device}
    bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **placement)
    base = perplexity(bf16, tokens, max_windows=windows, batch_size=4)
    del bf16
    quant = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **placement,
                                                 quantization_config=lutb.hf.LutbConfig(act_format="mxfp8"))
    lut = perplexity(quant, tokens, max_windows=windows, batch_size=4)
    # the CLI reads the bytes this model holds
    quant.save_pretrained(tmp_path / "saved")
    (tmp_path / "saved" / "val_tokens.safetensors").write_bytes(tokens.read_bytes())
    cli_base = run_cli("eval", str(folder), "--quant", "none", "--max-windows", str(windows))
    cli_lut = run_cli("eval", str(tmp_path / "saved"), "--act-format", "mxfp8", "--max-windows", str(windows))
    assert cli_lut["lutb_checkpoint"] and base.windows == cli_base["windows"] == windows
    hf_increase = lut.loss - base.loss
    cli_increase = cli_lut["val_loss"] - cli_base["val_loss"]
    print(f"{family} {device} windows {windows}: transformers BF16 {base.loss:.6f} LUT-B {lut.loss:.6f} "
          f"increase {hf_increase:+.6f}; lutb eval BF16 {cli_base['val_loss']:.6f} "
          f"LUT-B {cli_lut['val_loss']:.6f} increase {cli_increase:+.6f}")
    assert abs(hf_increase - cli_increase) < 1e-3, (hf_increase, cli_increase)
    assert abs(base.loss - cli_base["val_loss"]) < 2e-3  # the CLI rounds expert inputs and outputs to BF16
    if windows >= 151 and device == "cpu":  # the full protocol: transformers' own figure of reference_eval.json
        ref = json.loads((folder / "reference_eval.json").read_text())
        assert base.loss == pytest.approx(ref["val_loss_fp32_compute"], abs=2e-4)


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_lutb_increase_over_bf16_agrees_with_cli(family, tmp_path):
    _increase_agrees_with_cli(family, tmp_path, "cpu", WINDOWS)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and lutb.has_cuda()),
                    reason="needs a CUDA device and a CUDA build of lutb")
@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_cuda_lutb_increase_over_bf16_agrees_with_cli(family, tmp_path):
    """The same on the GPU (lutb's CUDA kernels in transformers), all 151 windows: a few seconds there."""
    pytest.importorskip("accelerate")  # device_map needs it
    _increase_agrees_with_cli(family, tmp_path, "cuda", 151)

