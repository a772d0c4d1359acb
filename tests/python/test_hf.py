"""lutb.hf: LUT-B routed experts through transformers' quantizer, config and experts registries.

Loads quantise while loading with the bytes of `lutb quantize`, load `lutb quantize` checkpoints as
stored, save the same format, and refuse unsupported families and corrupt tensors by name."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import lutb  # noqa: E402
import lutb.hf  # noqa: E402
from hf_support import FAMILY_MODELS, model_dir, raw_bytes, read_tensors, run_cli  # noqa: E402

FAMILIES = list(FAMILY_MODELS)


class _CliCheckpoints:
    """family -> the `lutb quantize` (binned-dp, CPU) checkpoint of the shared model, written on first
    use: a test skips only when a model it reads is absent (the GPU machine is given two of three)."""

    def __init__(self, root):
        self.root, self.made = root, {}

    def __getitem__(self, family):
        if family not in self.made:
            name = FAMILY_MODELS[family]
            run_cli("quantize", str(model_dir(name)), "-o", str(self.root / name), "--no-progress")
            self.made[family] = self.root / name
        return self.made[family]


@pytest.fixture(scope="module")
def cli_checkpoints(tmp_path_factory):
    return _CliCheckpoints(tmp_path_factory.mktemp("cli"))


def load_online(family, **kw):
    return AutoModelForCausalLM.from_pretrained(
        model_dir(FAMILY_MODELS[family]), dtype=torch.bfloat16, quantization_config=lutb.hf.LutbConfig(), **kw
    )


# ---------------------------------------------------------------------------------------------
# registries and config
# ---------------------------------------------------------------------------------------------
def test_registries_hold_lut_b():
    from transformers.integrations.moe import ExpertsInterface
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZATION_CONFIG_MAPPING["lut_b"] is lutb.hf.LutbConfig
    assert AUTO_QUANTIZER_MAPPING["lut_b"] is lutb.hf.LutbHfQuantizer
    assert ExpertsInterface._global_mapping["lutb"] is lutb.hf.lutb_experts_forward
    importlib.reload(lutb.hf)  # a second import registers again without "already registered"
    assert AUTO_QUANTIZER_MAPPING["lut_b"] is lutb.hf.LutbHfQuantizer


def test_config_block_is_the_cli_block():
    d = lutb.hf.LutbConfig(fitter="optimal").to_dict()
    assert d == {
        "quant_method": "lut_b", "format": "lut-b", "tile": [8, 64], "index_bits": 3, "codebook_size": 8,
        "codebook_dtype": "float8_e4m3fn", "scale_dtype": "ue8m0", "fitter": "optimal", "activation": "mxfp8",
        "activation_block": 32, "logical_shapes": {},
    }
    back = lutb.hf.LutbConfig.from_dict(dict(d, modules="x", logical_shapes={"a.weight": [3, 5]}))
    assert (back.fitter, back.act_format, back.modules, back.logical_shapes) == ("optimal", "mxfp8", "x",
                                                                                  {"a.weight": [3, 5]})
    assert lutb.hf.LutbConfig(act_format="bf16").to_dict()["activation"] == "bf16"


@pytest.mark.parametrize("kwargs, message", [
    ({"act_format": "fp4"}, "act_format 'fp4'"),
    ({"fitter": ""}, "fitter must be a non-empty string"),
    ({"tile": [16, 64]}, r"quantization_config.tile: \[16, 64\] is not supported"),
    ({"index_bits": 4}, "quantization_config.index_bits: 4"),
    ({"scale_dtype": "e8m0"}, "quantization_config.scale_dtype"),
    # a stored block's logical_shapes is refused as lutb eval refuses it, naming the key
    ({"logical_shapes": "abc"}, "quantization_config.logical_shapes: must be an object"),
    ({"logical_shapes": 5}, "quantization_config.logical_shapes: must be an object"),
    ({"logical_shapes": [["a.weight", [3, 5]]]}, "quantization_config.logical_shapes: must be an object"),
    ({"logical_shapes": {"a.weight": [3, 0]}}, r"quantization_config.logical_shapes.a.weight: must be an array of "
                                               r"positive integers, got \[3, 0\]"),
    ({"logical_shapes": {"a.weight": "3x5"}}, "quantization_config.logical_shapes.a.weight: must be an array"),
    ({"logical_shapes": {"a.weight": [3.0, 5]}}, "quantization_config.logical_shapes.a.weight: must be an array"),
])
def test_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lutb.hf.LutbConfig(**kwargs)


def test_stored_config_matches_cli(cli_checkpoints):
    stored = json.loads((cli_checkpoints["qwen3_moe"] / "config.json").read_text())["quantization_config"]
    mine = lutb.hf.LutbConfig.from_dict(stored).to_dict()
    assert mine == stored


# ---------------------------------------------------------------------------------------------
# online quantisation, pre-quantized loading, saving
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_online_load_saves_the_cli_bytes(family, cli_checkpoints, tmp_path):
    model = load_online(family)
    text = model.config.get_text_config()
    assert text._experts_implementation == "lutb"
    experts = [m for m in model.modules() if isinstance(m, lutb.hf.LutbExperts)]
    assert len(experts) == sum(1 for L in model.model.layers if hasattr(L.mlp, "experts"))
    if family == "deepseek_v3":
        # dense first layer and shared experts stay as loaded
        assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
        assert type(model.model.layers[1].mlp.shared_experts).__name__ == "DeepseekV3MLP"
        assert model.model.layers[1].mlp.shared_experts.gate_proj.weight.dtype == torch.bfloat16
    for m in experts:
        assert m.gate_up_proj_packed.dtype == torch.uint8 and "gate_up_proj" not in m._parameters
    model.save_pretrained(tmp_path / "saved")
    mine, ref = read_tensors(tmp_path / "saved"), read_tensors(cli_checkpoints[family])
    assert sorted(mine) == sorted(ref)
    lutb_keys = [k for k in ref if k.endswith(("_packed", "_codebook", "_scale"))]
    assert len(lutb_keys) == 3 * 3 * len(experts) * experts[0].num_experts
    for k in ref:
        if k.endswith("e_score_correction_bias"):  # transformers keeps it in FP32 (_keep_in_fp32_modules)
            assert torch.equal(mine[k].to(ref[k].dtype), ref[k]), k
            continue
        assert mine[k].dtype == ref[k].dtype and mine[k].shape == ref[k].shape, k
        assert torch.equal(raw_bytes(mine[k]), raw_bytes(ref[k])), k
    saved_q = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    cli_q = json.loads((cli_checkpoints[family] / "config.json").read_text())["quantization_config"]
    assert saved_q == cli_q


@pytest.mark.parametrize("family", FAMILIES)
def test_prequantized_load_does_not_refit(family, cli_checkpoints, monkeypatch):
    online = load_online(family)
    ids = torch.arange(3, 67).view(1, 64)
    want = online(ids).logits

    def no_fit(*a, **k):
        raise AssertionError("a LUT-B checkpoint was fitted again")

    monkeypatch.setattr(lutb, "quantize", no_fit)
    model = AutoModelForCausalLM.from_pretrained(cli_checkpoints[family], dtype=torch.bfloat16)
    assert isinstance(model.config.quantization_config, lutb.hf.LutbConfig)
    want_buffers, got_buffers = dict(online.named_buffers()), dict(model.named_buffers())
    assert sorted(want_buffers) == sorted(got_buffers)
    for n, b in got_buffers.items():
        assert torch.equal(b, want_buffers[n]), n
    got = model(ids).logits
    assert torch.equal(got, want)
    # the experts really are LUT-B: the BF16 model gives other logits
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir(FAMILY_MODELS[family]), dtype=torch.bfloat16)
    assert not torch.equal(bf16(ids).logits, got)


@pytest.mark.parametrize("family", FAMILIES)
def test_prequantized_load_in_float32(family, cli_checkpoints):
    # transformers loads a pre-quantized checkpoint's renamed tensors in their stored dtype (Mixtral's
    # block_sparse_moe.gate.weight becomes mlp.gate.weight): a BF16 router in an FP32 model stopped
    # the forward with "expected m1 and m2 to have the same dtype".
    model = AutoModelForCausalLM.from_pretrained(cli_checkpoints[family], dtype=torch.float32)
    floats = {n: t.dtype for n, t in model.state_dict().items() if t.is_floating_point()}
    assert floats and not {n: d for n, d in floats.items() if d != torch.float32}
    online = AutoModelForCausalLM.from_pretrained(model_dir(FAMILY_MODELS[family]), dtype=torch.float32,
                                                  quantization_config=lutb.hf.LutbConfig())
    ids = torch.arange(3, 67).view(1, 64)
    with torch.no_grad():
        got, want = model(ids).logits, online(ids).logits
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_prequantized_load_keeps_an_unknown_fitter_record(cli_checkpoints, tmp_path):
    # The stored fitter records what wrote the weights (spec 2.2); lutb eval reads any name, and a
    # pre-quantized load never fits, so a fitter this lutb lacks must not stop the load.
    src = cli_checkpoints["qwen3_moe"]
    folder = tmp_path / "other-writer"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["fitter"] = "gptq-lutb"
    (folder / "config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert model.config.quantization_config.fitter == "gptq-lutb"
    ids = torch.arange(3, 35).view(1, 32)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["fitter"] == "gptq-lutb"
    # Fitting while loading with that name is refused before any weight is read.
    with pytest.raises(ValueError, match="fitter 'gptq-lutb' is not one of"):
        AutoModelForCausalLM.from_pretrained(model_dir("tiny-qwen3-moe"), dtype=torch.bfloat16,
                                             quantization_config={"quant_method": "lut_b", "fitter": "gptq-lutb"})


def test_lane_major_buffers_save_and_move_in_checkpoint_order(cli_checkpoints):
    """On CUDA a LutbExperts module holds its index bytes once, in the kernels' lane-major order.
    Emulated here on the CPU with the host reference of that order: state_dict() gives checkpoint
    order, and rebuilding the weights (as after a move) converts the buffer back."""
    from lutb import _lutb

    model = AutoModelForCausalLM.from_pretrained(cli_checkpoints["qwen3_moe"], dtype=torch.bfloat16)
    ids = torch.arange(3, 35).view(1, 32)
    want_logits = model(ids).logits
    want = {k: v.clone() for k, v in model.state_dict().items()}
    m = model.model.layers[1].mlp.experts
    for p in ("gate_up_proj", "down_proj"):
        packed = getattr(m, f"{p}_packed")
        lm = torch.empty_like(packed)
        _lutb.lane_major_cpu(packed, lm)
        assert not torch.equal(lm, packed)
        setattr(m, f"{p}_packed", lm)
        m._lane_major[p] = True
    got = model.state_dict()
    for k in ("model.layers.1.mlp.experts.gate_up_proj_packed", "model.layers.1.mlp.experts.down_proj_packed"):
        assert torch.equal(got[k], want[k]), k
    m._lutb_cache = None  # as after .to(): the next forward rebuilds from the buffers
    assert torch.equal(model(ids).logits, want_logits)
    assert not any(m._lane_major.values())
    assert torch.equal(m.down_proj_packed, want["model.layers.1.mlp.experts.down_proj_packed"])


def test_saved_checkpoint_reads_in_cli_eval(cli_checkpoints, tmp_path):
    model = load_online("mixtral")
    model.save_pretrained(tmp_path / "saved")
    for f in ("val_tokens.safetensors",):
        shutil.copy(model_dir("tiny-mixtral") / f, tmp_path / "saved" / f)
    mine = run_cli("eval", str(tmp_path / "saved"), "--max-windows", "2")
    ref = run_cli("eval", str(cli_checkpoints["mixtral"]), "--max-windows", "2")
    assert mine["lutb_checkpoint"] and mine["windows"] == 2
    assert mine["val_loss"] == ref["val_loss"]


def tiny_olmoe(folder):
    cfg = transformers.OlmoeConfig(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                                   num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.OlmoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def test_olmoe_online_load_matches_cli(tmp_path):
    src = tiny_olmoe(tmp_path / "olmoe")
    run_cli("quantize", str(src), "-o", str(tmp_path / "cli"), "--no-progress")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16,
                                                 quantization_config=lutb.hf.LutbConfig())
    assert sum(isinstance(m, lutb.hf.LutbExperts) for m in model.modules()) == 2
    model.save_pretrained(tmp_path / "saved")
    mine, ref = read_tensors(tmp_path / "saved"), read_tensors(tmp_path / "cli")
    assert sorted(k for k in ref if k.endswith("_packed")) == sorted(k for k in mine if k.endswith("_packed"))
    for k in ref:
        assert torch.equal(raw_bytes(mine[k]), raw_bytes(ref[k])), k
    out = model(torch.arange(16).view(1, 16)).logits
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------
def test_unsupported_family_is_named(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported \(supported: qwen3_moe, mixtral"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "llama", quantization_config=lutb.hf.LutbConfig())


def test_nan_weight_stops_the_load_naming_the_stack(tmp_path, capfd, caplog):
    src = tiny_olmoe(tmp_path / "olmoe")
    t = load_file(str(src / "model.safetensors"))
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert key in t
    t[key][3, 5] = float("nan")
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    # transformers collects the error of the fit in its load report and stops the load with it
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, quantization_config=lutb.hf.LutbConfig())
    out, err = capfd.readouterr()
    # expert 2's up rows follow its 64 gate rows in the fused stack: row 64 + 3
    assert ("quantize: tensor model.layers.1.mlp.experts.gate_up_proj, expert 2, tile (8, 0): NaN at row 67 col 5"
            in out + err + caplog.text)


def corrupt_copy(src, dst, key, edit):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(str(f))
    edit(t, key)
    save_file(t, str(f), metadata={"format": "pt"})
    return dst


def test_corrupt_scale_is_named(cli_checkpoints, tmp_path):
    key = "model.layers.2.mlp.experts.5.up_proj.weight_scale"

    def edit(t, k):
        t[k][1, 2] = 255

    bad = corrupt_copy(cli_checkpoints["qwen3_moe"], tmp_path / "bad", key, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.gate_up_proj_scale \(from "
                       r"model\.layers\.2\.mlp\.experts\.\*\.gate_proj\.weight_scale and "
                       r"model\.layers\.2\.mlp\.experts\.\*\.up_proj\.weight_scale\): expert 5, tile \(33, 2\) "
                       r"has scale byte 255"):
        AutoModelForCausalLM.from_pretrained(bad, dtype=torch.bfloat16)


def test_nan_codebook_is_named(cli_checkpoints, tmp_path):
    key = "model.layers.0.block_sparse_moe.experts.3.w2.weight_codebook"

    def edit(t, k):
        t[k].view(torch.uint8)[0, 1, 4] = 0x7F

    bad = corrupt_copy(cli_checkpoints["mixtral"], tmp_path / "bad", key, edit)
    with pytest.raises(ValueError, match=r"down_proj_codebook \(from model\.layers\.0\.block_sparse_moe\.experts\.\*"
                       r"\.w2\.weight_codebook\): expert 3, tile \(0, 1\) entry 4 is an E4M3 NaN"):
        AutoModelForCausalLM.from_pretrained(bad, dtype=torch.bfloat16)


def test_missing_expert_tensor_is_named(cli_checkpoints, tmp_path):
    key = "model.layers.3.mlp.experts.7.down_proj.weight_packed"
    bad = corrupt_copy(cli_checkpoints["deepseek_v3"], tmp_path / "bad", key, lambda t, k: t.pop(k))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.experts\.down_proj_packed \(from "
                       r"model\.layers\.3\.mlp\.experts\.\*\.down_proj\.weight_packed\): shape \(15, 32, 2, 192\) "
                       r"differs from \(16, 32, 2, 192\)"):
        AutoModelForCausalLM.from_pretrained(bad, dtype=torch.bfloat16)


def test_other_experts_implementations_are_refused():
    with pytest.raises(ValueError, match="'grouped_mm': a LUT-B model runs its experts with 'lutb' only"):
        lutb.hf.LUTB_EXPERTS_FUNCTIONS.get_interface("grouped_mm", None)
    model = AutoModelForCausalLM.from_pretrained(model_dir("tiny-qwen3-moe"), dtype=torch.bfloat16,
                                                 experts_implementation="lutb")
    with pytest.raises(TypeError, match="Qwen3MoeExperts holds unquantised weights"):
        model(torch.arange(8).view(1, 8))


# ---------------------------------------------------------------------------------------------
# GPU (skipped without CUDA): the GPU fitter's bytes, and a model spread over two GPUs
# ---------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and lutb.has_cuda()),
                          reason="needs a CUDA device and a CUDA build of lutb")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_online_load_saves_the_cli_bytes(family, cli_checkpoints, tmp_path):
    pytest.importorskip("accelerate")  # device_map needs it
    model = load_online(family, device_map="cuda")
    assert all(m.gate_up_proj_packed.is_cuda for m in model.modules() if isinstance(m, lutb.hf.LutbExperts))
    model.save_pretrained(tmp_path / "saved")
    mine, ref = read_tensors(tmp_path / "saved"), read_tensors(cli_checkpoints[family])
    for k in ref:
        if k.endswith(("_packed", "_codebook", "_scale")):
            assert torch.equal(raw_bytes(mine[k]), raw_bytes(ref[k])), k
    # The forward in FP32 compute on both devices: only the experts' FP32 summation order differs
    # (spec 4), which can move a BF16-rounded expert output by one unit; BF16 compute would add the
    # non-expert layers' own rounding differences between the devices.
    del model
    ids = torch.arange(3, 67).view(1, 64)
    gpu = AutoModelForCausalLM.from_pretrained(cli_checkpoints[family], dtype=torch.float32, device_map="cuda")
    cpu = AutoModelForCausalLM.from_pretrained(cli_checkpoints[family], dtype=torch.float32)
    with torch.no_grad():
        a, b = gpu(ids.cuda()).logits.cpu(), cpu(ids).logits
    rel = ((a - b).norm() / b.norm()).item()
    print(f"{family}: logits GPU vs CPU, FP32 compute: relative L2 {rel:.2e}, max abs {(a - b).abs().max().item():.3e}")
    assert rel < 1e-2


@cuda
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_device_map_auto_over_two_gpus(cli_checkpoints):
    pytest.importorskip("accelerate")
    path = cli_checkpoints["qwen3_moe"]
    one = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0")
    size = (path / "model.safetensors").stat().st_size
    # GPU 0 holds about half of the model, so the planner puts the later layers on GPU 1
    two = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="auto",
                                               max_memory={0: size // 2, 1: 4 * size})
    devices = {m.gate_up_proj_packed.device for m in two.modules() if isinstance(m, lutb.hf.LutbExperts)}
    assert len(devices) == 2
    ids = torch.arange(3, 67).view(1, 64).cuda()
    assert torch.equal(one(ids).logits.cpu(), two(ids).logits.cpu())


@cuda
@pytest.mark.cuda
def test_cuda_static_cache_generate_compiled_matches_eager(cli_checkpoints):
    """generate() with a static cache compiles the forward (torch.compile, CUDA graphs); the LUT-B
    experts op runs inside it and gives the eager tokens."""
    model = AutoModelForCausalLM.from_pretrained(cli_checkpoints["qwen3_moe"], dtype=torch.bfloat16,
                                                 device_map="cuda")
    ids = torch.arange(3, 35).view(2, 16).cuda()
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, cache_implementation="static", pad_token_id=0)
    model.config.output_router_logits = False  # the checkpoint's training option; generate() needs no aux loss
    model.generation_config.disable_compile = True
    eager = model.generate(input_ids=ids, **kw)
    model.generation_config.disable_compile = False
    compiled = model.generate(input_ids=ids, **kw)
    compiled = model.generate(input_ids=ids, **kw)  # the second call replays the compiled graph
    assert torch.equal(eager, compiled)
