"""The examples' command lines on the shared tiny models: examples/heldout_loss.py and
examples/lm_eval_quantized.py evaluate a save_pretrained output (no val_tokens.safetensors, no
tokenizer) with --tokens and --tokenizer, fit with --calibration, and report each user error as one
line on stderr with exit status 1 (an input that is missing or invalid) or 2 (argparse's usage
error), never a traceback."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

import lutb.hf  # noqa: E402
from hf_support import REPO, calibrate, model_dir  # noqa: E402
from lutb.eval import perplexity  # noqa: E402

WINDOWS = 2  # windows of 256 tokens per held-out loss here: the examples' plumbing, not the protocol


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_main(name: str, argv: list, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the example's main(argv), argparse's exits included."""
    try:
        rc = example(name).main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def source():
    return model_dir("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def saved(source, tmp_path_factory):
    """save_pretrained of tiny-qwen3-moe loaded with LutbConfig: a LUT-B folder with config.json and
    the weights only."""
    out = tmp_path_factory.mktemp("examples") / "saved"
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, quantization_config=lutb.hf.LutbConfig())
    model.save_pretrained(out)
    assert not (out / "val_tokens.safetensors").exists() and not (out / "tokenizer.json").exists()
    return out


def heldout(argv, capsys) -> dict:
    rc, out, err = run_main("heldout_loss", argv, capsys)
    assert rc == 0, err
    return json.loads(out)


def test_heldout_loss_of_a_saved_model_reads_tokens(source, saved, capsys):
    tokens = source / "val_tokens.safetensors"
    rc, out, err = run_main("heldout_loss", [saved, "--max-windows", WINDOWS], capsys)
    assert (rc, out) == (1, "")
    assert err == (f"heldout_loss.py: tokens: {saved / 'val_tokens.safetensors'} does not exist; pass the token ids "
                   "with --tokens FILE\n")
    r = heldout([saved, "--tokens", tokens, "--max-windows", WINDOWS], capsys)
    assert r["lutb"] and r["act_format"] == "mxfp8"
    assert (r["windows"], r["predicted_tokens"]) == (WINDOWS, WINDOWS * 255)
    # the saved bytes are those fitted while loading, so the loss is the --lutb loss of the source
    fitted = heldout([source, "--lutb", "--max-windows", WINDOWS], capsys)
    assert r["val_loss"] == pytest.approx(fitted["val_loss"], abs=1e-9)
    bf16 = heldout([source, "--max-windows", WINDOWS], capsys)
    assert not bf16["lutb"] and 0 < fitted["val_loss"] - bf16["val_loss"] < 0.05


def test_heldout_loss_with_calibration(source, tmp_path, capsys):
    stats = calibrate(source, tmp_path / "stats.safetensors")
    r = heldout([source, "--lutb", "--calibration", stats, "--max-windows", WINDOWS], capsys)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                 quantization_config=lutb.hf.LutbConfig(calibration=stats))
    want = perplexity(model, source / "val_tokens.safetensors", max_windows=WINDOWS, batch_size=4).loss
    assert r["lutb"] and r["val_loss"] == pytest.approx(want, abs=1e-9)
    # the statistics change the fit, hence the loss
    assert r["val_loss"] != heldout([source, "--lutb", "--max-windows", WINDOWS], capsys)["val_loss"]


def write_ids(path, **tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


# (argv with SRC = tiny-qwen3-moe, SAVED = its save_pretrained output, TMP = an empty folder,
#  IDS = a safetensors file without input_ids, BADJSON / LIST = folders whose config.json is cut short /
#  a JSON list; exit status; what stderr's last line holds)
HELDOUT_ERRORS = [
    (["/nonexistent"], 1, "heldout_loss.py: MODEL_DIR: /nonexistent is not a folder"),
    (["TMP"], 1, "heldout_loss.py: MODEL_DIR: TMP has no config.json"),
    (["BADJSON"], 1,
     "heldout_loss.py: MODEL_DIR: BADJSON/config.json is not valid JSON: Expecting value: line 1 column 15 (char 14)"),
    (["LIST"], 1, "heldout_loss.py: MODEL_DIR: LIST/config.json is not a JSON object"),
    (["SRC", "--tokens", "TMP"], 1, "heldout_loss.py: tokens: TMP is not a regular file"),
    (["SRC", "--tokens", "TMP/missing.safetensors"], 1,
     "heldout_loss.py: tokens: TMP/missing.safetensors does not exist"),
    (["SRC", "--tokens", "IDS"], 1, "heldout_loss.py: tokens: IDS holds no 'input_ids' tensor (it has ['ids'])"),
    (["SRC", "--lutb", "--calibration", "TMP/missing.safetensors"], 1,
     "heldout_loss.py: calibration: TMP/missing.safetensors does not exist"),
    (["SRC", "--calibration", "IDS"], 2, "error: --calibration weights the --lutb fit; add --lutb"),
    (["SAVED", "--lutb", "--calibration", "IDS"], 2,
     "error: --calibration: SAVED is a LUT-B checkpoint, loaded as stored (nothing is fitted)"),
    (["SRC", "--lutb", "--calibration", "IDS", "--fitter", "ct-lloyd"], 2,
     "error: LutbConfig: fitter 'ct-lloyd' has no weighted objective; calibration needs 'binned-dp' or 'optimal'"),
    (["SRC", "--fitter", "k-means"], 2, "error: argument --fitter: invalid choice: 'k-means'"),
    (["SRC", "--max-windows", "0"], 2, "error: argument --max-windows: '0' is not an integer >= 1"),
    (["SRC", "--tokens"], 2, "error: argument --tokens: expected one argument"),
    (["SRC", "--device", "gpu"], 2, "error: argument --device: 'gpu' is not cpu, cuda or cuda:N"),
]


def broken_configs(tmp_path) -> dict:
    """BADJSON and LIST: model folders whose config.json is cut short and is a JSON list."""
    folders = {}
    for key, text in (("BADJSON", '{"model_type":'), ("LIST", "[]")):
        folders[key] = tmp_path / key.lower()
        folders[key].mkdir()
        (folders[key] / "config.json").write_text(text)
    return {k: str(v) for k, v in folders.items()}


@pytest.mark.parametrize("argv, status, message", HELDOUT_ERRORS, ids=[" ".join(c[0]) for c in HELDOUT_ERRORS])
def test_heldout_loss_user_errors(argv, status, message, source, saved, tmp_path, capsys):
    names = {"SRC": str(source), "SAVED": str(saved), "TMP": str(tmp_path),
             "IDS": str(write_ids(tmp_path / "ids.safetensors", ids=torch.tensor([1]))), **broken_configs(tmp_path)}

    def fill(s: str) -> str:
        for k, v in names.items():
            s = s.replace(k, v)
        return s

    rc, out, err = run_main("heldout_loss", [fill(a) for a in argv], capsys)
    assert (rc, out) == (status, "")
    assert "Traceback" not in err and err.endswith("\n")
    lines = err.splitlines()
    if status == 1:
        assert lines == [fill(message)]
    else:
        assert lines[0].startswith("usage: ") and fill(message) in lines[-1]


@pytest.mark.parametrize("name", ["heldout_loss", "lm_eval_quantized"])
def test_example_missing_model_dir_as_a_command(name):
    r = subprocess.run([sys.executable, str(REPO / "examples" / f"{name}.py"), "/nonexistent"], capture_output=True,
                       text=True)
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"{name}.py: MODEL_DIR: /nonexistent is not a folder\n")


def test_lm_eval_example_user_errors(source, saved, tmp_path, capsys):
    tokens = source / "val_tokens.safetensors"
    rc, out, err = run_main("lm_eval_quantized", [saved], capsys)
    assert (rc, out, err) == (1, "", f"lm_eval_quantized.py: tokens: {saved / 'val_tokens.safetensors'} does not "
                                     "exist; pass the token ids with --tokens FILE\n")
    # transformers would give this folder an empty tokenizer: the example refuses it
    rc, out, err = run_main("lm_eval_quantized", [saved, "--tokens", tokens], capsys)
    assert (rc, out, err) == (1, "", f"lm_eval_quantized.py: tokenizer: {saved} has no tokenizer.json or "
                                     "tokenizer_config.json; pass the source model's folder with --tokenizer DIR\n")
    rc, out, err = run_main("lm_eval_quantized", [saved, "--tokens", tokens, "--tokenizer", source, "--calibration",
                                                  tokens], capsys)
    assert rc == 2 and out == "" and err.splitlines()[-1].endswith(
        f"error: --calibration: {saved} is a LUT-B checkpoint, loaded as stored (nothing is fitted)")
    rc, out, err = run_main("lm_eval_quantized", [source, "--docs", "3"], capsys)
    assert rc == 2 and err.splitlines()[-1].endswith("error: argument --docs: '3' is not an integer >= 4 (a document "
                                                     "takes 3 others' continuations)")


@pytest.mark.parametrize("name", ["heldout_loss", "lm_eval_quantized"])
def test_examples_refuse_bad_inputs_in_one_line(name, source, tmp_path, capsys):
    """A config.json that is not JSON, a truncated tokens file and --device cuda without a GPU are
    one line naming the file or argument, exit status 1, never a traceback."""
    bad = broken_configs(tmp_path)["BADJSON"]
    rc, out, err = run_main(name, [bad], capsys)
    assert (rc, out, err) == (1, "", f"{name}.py: MODEL_DIR: {bad}/config.json is not valid JSON: Expecting value: "
                                     "line 1 column 15 (char 14)\n")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((source / "val_tokens.safetensors").read_bytes()[:100])
    rc, out, err = run_main(name, [source, "--tokens", cut], capsys)
    assert (rc, out) == (1, "") and len(err.splitlines()) == 1, err
    assert err.startswith(f"{name}.py: tokens: {cut} is not a readable safetensors file: "), err
    if not torch.cuda.is_available():
        rc, out, err = run_main(name, [source, "--device", "cuda"], capsys)
        assert (rc, out, err) == (1, "", f"{name}.py: device: cuda: no usable CUDA device here "
                                         "(torch.cuda.is_available() is False)\n")


def test_lm_eval_example_checks_work_dir_before_loading(source, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    rc, out, err = run_main("lm_eval_quantized", [source, "--work-dir", tmp_path / "file" / "task"], capsys)
    assert (rc, out, err) == (1, "", f"lm_eval_quantized.py: --work-dir: {tmp_path / 'file' / 'task'}: cannot create "
                                     "it: Not a directory\n")


def test_lm_eval_example_runs_in_process(source, tmp_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")  # lm_eval's HFLM imports it
    ex = example("lm_eval_quantized")
    model, tok = ex.load_model(str(source), "cpu", torch.float32)
    assert any(isinstance(m, lutb.hf.LutbExperts) for m in model.modules())
    task_dir = ex.write_task(source / "val_tokens.safetensors", tok, str(tmp_path / "task"), docs=16)
    lines = (tmp_path / "task" / "heldout_continuation.jsonl").read_text().splitlines()
    docs = [json.loads(x) for x in lines]
    assert len(docs) == 16 and [d["label"] for d in docs[:5]] == [0, 1, 2, 3, 0]
    assert all(len(d["choices"]) == 4 and len(set(d["choices"])) == 4 for d in docs)
    res = ex.evaluate(model, tok, task_dir, batch_size=4)
    r = res["results"][ex.TASK_NAME]
    assert res["n-samples"][ex.TASK_NAME]["effective"] == 16
    # a model trained on this text finds the true continuation far more often than chance (0.25)
    assert 0.5 <= r["acc,none"] <= 1.0


def test_lm_eval_example_on_a_saved_model(source, saved, tmp_path, capsys):
    """The command line on a save_pretrained output, with the source's token ids and tokenizer: the
    task is built from those tokens, and the model scores far above chance (0.25)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    rc, out, err = run_main("lm_eval_quantized", [saved, "--tokens", source / "val_tokens.safetensors", "--tokenizer",
                                                  source, "--docs", 8, "--work-dir", tmp_path / "task"], capsys)
    assert rc == 0, err
    docs = [json.loads(x) for x in (tmp_path / "task" / "heldout_continuation.jsonl").read_text().splitlines()]
    assert len(docs) == 8 and all(d["context"] and len(set(d["choices"])) == 4 for d in docs)
    head, acc = out.split(": acc ")
    assert head == "lutb_heldout_continuation" and out.rstrip().endswith("(8 documents)")
    assert 0.5 <= float(acc.split()[0]) <= 1.0
