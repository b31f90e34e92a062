"""Perplexity on held-out text and next-token agreement with a reference run (the library behind
`edge0 eval`).

Text is tokenized once and cut into windows of `--window` tokens; each window is one forward pass
without a KV cache, or with `--decode` one decode step per token through the KV cache and the
expert cache (slower; the mode in which cache policies and substitution act). Perplexity is over
every predicted token of every window; expert bytes read are per token processed. With a reference
(another edge0 store or engine options, or an mlx-lm / Hugging Face directory run resident by
mlx-lm), it also reports how often the two models' argmax next tokens agree and the mean KL
divergence KL(reference || model) per token.
"""

from __future__ import annotations

import math

import numpy as np

from edge0.errors import Edge0Error


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def windows(tokens: list[int], window: int, max_windows: int | None) -> list[list[int]]:
    out = [tokens[i : i + window] for i in range(0, len(tokens) - 1, window)]
    out = [w for w in out if len(w) >= 2]
    return out[:max_windows] if max_windows else out


def evaluate(
    model_logits,
    tokens: list[int],
    window: int = 256,
    max_windows: int | None = None,
    reference_logits=None,
    progress: bool = False,
) -> dict:
    """`model_logits(ids) -> [T, V]` float logits. Returns perplexity (and agreement/KL to the
    reference when `reference_logits` is given) over the windows of `tokens`."""
    from tqdm import tqdm

    nll, count, agree, kl = 0.0, 0, 0, 0.0
    ws = windows(tokens, window, max_windows)
    if not ws:
        raise Edge0Error(f"--data: too little text for evaluation ({len(tokens)} tokens); give at least 2")
    for w in tqdm(ws, desc="eval", disable=not progress, unit="window"):
        lp = _log_softmax(model_logits(w))[:-1]
        target = np.array(w[1:])
        nll -= lp[np.arange(len(target)), target].sum()
        count += len(target)
        if reference_logits is not None:
            rp = _log_softmax(reference_logits(w))[:-1]
            agree += int((rp.argmax(-1) == lp.argmax(-1)).sum())
            kl += float((np.exp(rp) * (rp - lp)).sum())
    out = {
        "tokens": count,
        "windows": len(ws),
        "window": window,
        "nll": nll / count,
        "perplexity": math.exp(nll / count),
    }
    if reference_logits is not None:
        out["agreement"] = agree / count
        out["kl_to_reference"] = kl / count
    return out
