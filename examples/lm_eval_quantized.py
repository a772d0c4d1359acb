"""Run lm-evaluation-harness in process on a model whose routed experts are LUT-B.

    python examples/lm_eval_quantized.py MODEL_DIR [--tokens FILE] [--tokenizer DIR] [--calibration STATS]
                                          [--device cpu|cuda] [--docs 64] [--work-dir DIR]

MODEL_DIR is a BF16 Hugging Face MoE checkpoint (quantised while loading with ``LutbConfig``,
weighted by the statistics of ``lutb calibrate`` given with --calibration) or a LUT-B checkpoint
written by ``lutb quantize`` / ``save_pretrained`` (loaded as stored). The task needs no download:
it is a local multiple-choice task built from held-out tokens (--tokens, by default
MODEL_DIR/val_tokens.safetensors): each document is a passage of held-out text, and the choices are
its true continuation and the continuations of three other passages; ``acc`` is the share of
documents where the model gives the true continuation the highest log-likelihood. The task YAML and
its JSONL dataset are written to ``--work-dir`` (a temporary folder by default). A
``save_pretrained`` output holds neither the token ids nor the tokenizer: pass the source model's
with --tokens SRC_DIR/val_tokens.safetensors --tokenizer SRC_DIR.
Exit status: 0 success; 1 an input that is missing or invalid (one line on stderr); 2 a usage error.

The same ``HFLM(pretrained=model, tokenizer=tok)`` + ``lm_eval.simple_evaluate(...)`` call runs any
installed lm-eval task on the quantised model when its dataset is available.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lutb.hf
from lutb.eval import load_tokens

# The examples' shared checks live beside them (examples/example_checks.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_checks import device_arg, device_problem, is_lutb_checkpoint  # noqa: E402

TASK_NAME = "lutb_heldout_continuation"


def write_task(tokens, tokenizer, work_dir: str, docs: int, context_tokens: int = 96,
               choice_tokens: int = 16) -> str:
    """Write ``TASK_NAME``'s YAML and JSONL under ``work_dir`` from held-out ``tokens`` (a
    safetensors file of ``input_ids`` or ids, as ``lutb.eval.load_tokens`` takes); returns the folder
    to pass to ``TaskManager(include_path=...)``.

    Document d uses tokens ``[d * stride, d * stride + context_tokens + choice_tokens)``; its
    distractors are the continuations of documents d+1, d+2, d+3 (mod docs), so every choice is real
    text of the same length in tokens.

    Raises:
        FileNotFoundError: the ``tokens`` file does not exist.
        ValueError: too few held-out tokens for ``docs`` documents, or docs < 4.
    """
    if docs < 4:
        raise ValueError(f"docs: a document needs 3 distractors from other documents, so docs >= 4; got {docs}")
    ids = load_tokens(tokens)
    span = context_tokens + choice_tokens
    stride = ids.numel() // docs
    if stride < span:
        raise ValueError(f"docs: {docs} documents of {span} tokens do not fit {ids.numel()} held-out tokens")
    passages = [ids[d * stride: d * stride + span].tolist() for d in range(docs)]
    contexts = [tokenizer.decode(p[:context_tokens]) for p in passages]
    endings = [tokenizer.decode(p[context_tokens:]) for p in passages]
    os.makedirs(work_dir, exist_ok=True)
    data = os.path.join(work_dir, "heldout_continuation.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for d in range(docs):
            order = [d, (d + 1) % docs, (d + 2) % docs, (d + 3) % docs]
            label = d % 4  # the true continuation's position rotates so that "always A" scores 0.25
            order[0], order[label] = order[label], order[0]
            f.write(json.dumps({"context": contexts[d], "choices": [endings[j] for j in order], "label": label}) + "\n")
    with open(os.path.join(work_dir, f"{TASK_NAME}.yaml"), "w", encoding="utf-8") as f:
        f.write(
            f"task: {TASK_NAME}\n"
            "dataset_path: json\n"
            "dataset_kwargs:\n"
            "  data_files:\n"
            f"    test: {json.dumps(data)}\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            'doc_to_text: "{{context}}"\n'
            'doc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{label}}"\n'
            'target_delimiter: ""\n'
            "metric_list:\n"
            "  - metric: acc\n"
            "    aggregation: mean\n"
            "    higher_is_better: true\n"
        )
    return work_dir


def load_model(model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32, fitter: str = "binned-dp",
               calibration: str | None = None, tokenizer_dir: str | None = None):
    """The model of ``model_dir`` with LUT-B routed experts: fitted while loading when the checkpoint
    is BF16 (weighted by the ``calibration`` statistics when given), as stored when it is LUT-B.
    Returns ``(model, tokenizer)``, the tokenizer of ``tokenizer_dir`` (default ``model_dir``)."""
    config = None if is_lutb_checkpoint(model_dir) else lutb.hf.LutbConfig(fitter=fitter, calibration=calibration)
    kwargs = {} if config is None else {"quantization_config": config}
    if device != "cpu":  # device_map needs accelerate; the CPU is the default placement
        kwargs["device_map"] = device
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)


def evaluate(model, tokenizer, task_dir: str, limit: int | None = None, batch_size: int = 8) -> dict:
    """``lm_eval.simple_evaluate`` of ``TASK_NAME`` on an in-process model; returns its results dict."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    tm = TaskManager(include_path=task_dir, include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=[TASK_NAME], task_manager=tm, limit=limit,
                                   log_samples=False)


def docs_arg(s: str) -> int:
    if not s.isdigit() or int(s) < 4:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer >= 4 (a document takes 3 others' continuations)")
    return int(s)


def fail(message: str) -> int:
    print(f"lm_eval_quantized.py: {message}", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--tokens", metavar="FILE", help="held-out token ids (default MODEL_DIR/val_tokens.safetensors)")
    p.add_argument("--tokenizer", metavar="DIR", help="folder of the tokenizer (default MODEL_DIR)")
    p.add_argument("--calibration", metavar="STATS", help="statistics of `lutb calibrate` for fitting a BF16 model")
    p.add_argument("--device", default="cpu", type=device_arg, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--docs", metavar="N", type=docs_arg, default=64, help="documents in the local task (default 64)")
    p.add_argument("--work-dir", default=None, help="where the task YAML and JSONL go (default: a temporary folder)")
    a = p.parse_args(argv)

    if not os.path.isfile(os.path.join(a.model_dir, "config.json")):
        return fail(f"MODEL_DIR: {a.model_dir} " + ("has no config.json" if os.path.isdir(a.model_dir)
                                                   else "is not a folder"))
    try:
        stored = is_lutb_checkpoint(a.model_dir)
    except ValueError as e:
        return fail(str(e))
    if a.calibration and stored:
        p.error(f"--calibration: {a.model_dir} is a LUT-B checkpoint, loaded as stored (nothing is fitted)")
    tokens = a.tokens or os.path.join(a.model_dir, "val_tokens.safetensors")
    if not os.path.exists(tokens):  # a folder is refused by load_tokens, as not a regular file
        hint = "" if a.tokens else "; pass the token ids with --tokens FILE"
        return fail(f"tokens: {tokens} does not exist{hint}")
    # transformers gives a folder without tokenizer files an empty tokenizer rather than an error
    tok_dir = a.tokenizer or a.model_dir
    if not any(os.path.isfile(os.path.join(tok_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        hint = "" if a.tokenizer else "; pass the source model's folder with --tokenizer DIR"
        return fail(f"tokenizer: {tok_dir} has no tokenizer.json or tokenizer_config.json{hint}")
    if a.calibration and not os.path.isfile(a.calibration):
        return fail(f"calibration: {a.calibration} does not exist")
    if problem := device_problem(a.device):
        return fail(problem)
    if a.work_dir:  # before the model loads: the task files are written after it
        try:
            os.makedirs(a.work_dir, exist_ok=True)
        except OSError as e:
            return fail(f"--work-dir: {a.work_dir}: cannot create it: {e.strerror}")
    try:
        ids = load_tokens(tokens)
    except ValueError as e:  # no input_ids tensor, or ids that are not integers >= 0
        return fail(str(e))

    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model, tok = load_model(a.model_dir, a.device, dtype, calibration=a.calibration, tokenizer_dir=tok_dir)
            task_dir = write_task(ids, tok, a.work_dir or tmp, a.docs)
        except (OSError, ValueError) as e:  # an unreadable or invalid checkpoint, statistics or token file
            return fail(str(e))
        res = evaluate(model, tok, task_dir)
    acc = res["results"][TASK_NAME]["acc,none"]
    err = res["results"][TASK_NAME].get("acc_stderr,none")
    spread = f" +- {err:.4f}" if isinstance(err, float) else ""
    print(f"{TASK_NAME}: acc {acc:.4f}{spread} ({a.docs} documents)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
