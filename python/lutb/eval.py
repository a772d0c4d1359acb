"""Held-out loss of a causal language model by the spec 8 protocol, from Python.

``perplexity(model, tokens)`` cuts the token stream into non-overlapping windows of ``window``
tokens from index 0, drops the last partial window, and returns the mean next-token negative
log-likelihood in nats over the ``window - 1`` predicted positions of every window: the figure of
``reference_eval.json`` and of ``lutb eval``. Nothing is downloaded.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["PerplexityResult", "load_tokens", "perplexity"]


@dataclass(frozen=True)
class PerplexityResult:
    """loss: mean next-token NLL in nats; perplexity: exp(loss); windows and predicted_tokens: how
    many windows and predicted positions the mean is over."""

    loss: float
    perplexity: float
    windows: int
    predicted_tokens: int


def load_tokens(tokens: "str | os.PathLike | torch.Tensor | Sequence[int]") -> torch.Tensor:
    """Token ids as a 1-D int64 CPU tensor.

    ``tokens`` is a safetensors file holding ``input_ids`` (any integer dtype, any shape: flattened
    in order, as ``val_tokens.safetensors`` of the shared models), a tensor, or a sequence of ints.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the path is not a regular file, the file is not a readable safetensors file
            (truncated, a corrupt header), it has no ``input_ids`` tensor, or the ids are not integers
            or are negative.
    """
    if isinstance(tokens, (str, os.PathLike)):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = os.fspath(tokens)
        if not os.path.exists(path):
            raise FileNotFoundError(f"tokens: {path} does not exist")
        if not os.path.isfile(path):  # safetensors says "No such device (os error 19)" of a folder
            raise ValueError(f"tokens: {path} is not a regular file")
        try:
            data = load_file(path)
        except SafetensorError as e:  # neither an OSError nor a ValueError: the message alone names no file
            raise ValueError(f"tokens: {path} is not a readable safetensors file: {e}") from None
        if "input_ids" not in data:
            raise ValueError(f"tokens: {path} holds no 'input_ids' tensor (it has {sorted(data)})")
        ids = data["input_ids"]
    elif isinstance(tokens, torch.Tensor):
        ids = tokens
    else:
        ids = torch.as_tensor(list(tokens))
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"tokens: ids must be integers, got dtype {ids.dtype}")
    ids = ids.reshape(-1).to("cpu", torch.int64)
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"tokens: ids must be >= 0, got {int(ids.min())}")
    return ids


@torch.no_grad()
def perplexity(model, tokens, window: int = 256, *, max_windows: int | None = None,
               batch_size: int = 1) -> PerplexityResult:
    """Mean next-token NLL of ``model`` over non-overlapping windows of ``tokens`` (spec 8).

    Args:
        model: a transformers causal LM (``model(input_ids).logits`` of shape ``[B, window, V]``);
            inputs are sent to ``model.device`` (the first device of a ``device_map`` model).
        tokens: see ``load_tokens``.
        window: tokens per window (256 in spec 8); each window predicts ``window - 1`` positions.
        max_windows: evaluate only the first ``max_windows`` windows (all when None).
        batch_size: windows per forward pass; the result does not depend on it beyond FP rounding.

    Returns:
        PerplexityResult; the NLL sum is accumulated in float64 from FP32 log-softmax values.

    Raises:
        ValueError: window < 2, batch_size < 1, max_windows < 1, fewer tokens than one window, or a
            token id outside the model's vocabulary.
    """
    if window < 2:
        raise ValueError(f"window: must be >= 2 (a window predicts window - 1 tokens), got {window}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows: must be >= 1 or None, got {max_windows}")
    ids = load_tokens(tokens)
    n = ids.numel() // window
    if n == 0:
        raise ValueError(f"tokens: {ids.numel()} tokens hold no full window of {window}")
    if max_windows is not None:
        n = min(n, max_windows)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and ids.numel() and int(ids[: n * window].max()) >= vocab:
        raise ValueError(f"tokens: id {int(ids[: n * window].max())} is outside the vocabulary of {vocab}")
    windows = ids[: n * window].view(n, window)
    device = getattr(model, "device", torch.device("cpu"))
    total = 0.0
    for start in range(0, n, batch_size):
        batch = windows[start:start + batch_size].to(device)
        logits = model(input_ids=batch).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, batch[:, 1:].unsqueeze(-1)).squeeze(-1)
        total += float(nll.double().sum())
    count = n * (window - 1)
    loss = total / count
    return PerplexityResult(loss=loss, perplexity=math.exp(loss), windows=n, predicted_tokens=count)
