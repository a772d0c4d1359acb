"""Run lm-evaluation-harness in process on a model whose routed experts are LUT-B.

    python examples/lm_eval_quantized.py MODEL_DIR [--device cpu|cuda] [--docs 64] [--work-dir DIR]

MODEL_DIR is a BF16 Hugging Face MoE checkpoint (quantised while loading with ``LutbConfig``) or a
LUT-B checkpoint written by ``lutb quantize`` / ``save_pretrained`` (loaded as stored). The task
needs no download: it is a local multiple-choice task built from the model's own held-out tokens
(``val_tokens.safetensors``): each document is a passage of held-out text, and the choices are its
true continuation and the continuations of three other passages; ``acc`` is the share of documents
where the model gives the true continuation the highest log-likelihood. The task YAML and its
JSONL dataset are written to ``--work-dir`` (a temporary folder by default).

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

TASK_NAME = "lutb_heldout_continuation"


def write_task(model_dir: str, tokenizer, work_dir: str, docs: int, context_tokens: int = 96,
               choice_tokens: int = 16) -> str:
    """Write ``TASK_NAME``'s YAML and JSONL under ``work_dir`` from ``model_dir``'s
    ``val_tokens.safetensors``; returns the folder to pass to ``TaskManager(include_path=...)``.

    Document d uses tokens ``[d * stride, d * stride + context_tokens + choice_tokens)``; its
    distractors are the continuations of documents d+1, d+2, d+3 (mod docs), so every choice is real
    text of the same length in tokens.

    Raises:
        FileNotFoundError: ``model_dir`` has no ``val_tokens.safetensors``.
        ValueError: too few held-out tokens for ``docs`` documents, or docs < 4.
    """
    from lutb.eval import load_tokens

    if docs < 4:
        raise ValueError(f"docs: a document needs 3 distractors from other documents, so docs >= 4; got {docs}")
    ids = load_tokens(os.path.join(model_dir, "val_tokens.safetensors"))
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


def load_model(model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32, fitter: str = "binned-dp"):
    """The model of ``model_dir`` with LUT-B routed experts: fitted while loading when the checkpoint
    is BF16, as stored when it is LUT-B. Returns ``(model, tokenizer)``."""
    import lutb.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        stored = json.load(f).get("quantization_config")
    kwargs = {} if stored else {"quantization_config": lutb.hf.LutbConfig(fitter=fitter)}
    if device != "cpu":  # device_map needs accelerate; the CPU is the default placement
        kwargs["device_map"] = device
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    model.eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def evaluate(model, tokenizer, task_dir: str, limit: int | None = None, batch_size: int = 8) -> dict:
    """``lm_eval.simple_evaluate`` of ``TASK_NAME`` on an in-process model; returns its results dict."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    tm = TaskManager(include_path=task_dir, include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=[TASK_NAME], task_manager=tm, limit=limit,
                                   log_samples=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--docs", type=int, default=64, help="documents in the local task (default 64)")
    p.add_argument("--work-dir", default=None, help="where the task YAML and JSONL go (default: a temporary folder)")
    a = p.parse_args(argv)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    model, tok = load_model(a.model_dir, a.device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = write_task(a.model_dir, tok, a.work_dir or tmp, a.docs)
        res = evaluate(model, tok, task_dir)
    acc = res["results"][TASK_NAME]["acc,none"]
    err = res["results"][TASK_NAME].get("acc_stderr,none")
    print(f"{TASK_NAME}: acc {acc:.4f}" + (f" +- {err:.4f}" if isinstance(err, float) else "") + f" ({a.docs} documents)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
