"""Recording routing traces (the library behind `edge0 trace`): every MoE layer's routes and
router scores while the model reads held-out text (teacher-forced) and then generates from it."""

from __future__ import annotations

import datetime
import hashlib
from pathlib import Path

import numpy as np

from edge0.cache import tracefile
from edge0.errors import Edge0Error
from edge0.store.format import manifest_hash

DOC_SEP = "<|endoftext|>"


def split_prompts(engine, text: str, prompts: int, prompt_tokens: int) -> list[list[int]]:
    """Token ids of up to `prompts` prompts of at most `prompt_tokens` tokens: the first documents
    of `text` (split at <|endoftext|>), or equal chunks of it when it has fewer documents."""
    docs = [d.strip() for d in text.split(DOC_SEP) if d.strip()]
    if len(docs) >= prompts:
        out = [engine.encode(d)[:prompt_tokens] for d in docs[:prompts]]
    else:
        # Generous 16 characters per token: encode only what the prompts can use.
        ids = engine.encode(text.replace(DOC_SEP, "\n")[: 16 * prompts * prompt_tokens])
        step = max(1, len(ids) // prompts)
        out = [ids[i : i + min(step, prompt_tokens)] for i in range(0, step * prompts, step)]
    out = [p for p in out if len(p) >= 2]
    if not out:
        raise Edge0Error("--data: the text is too short to make a prompt of 2 tokens or more; pass a longer file")
    return out


def record(engine, prompts: list[list[int]], max_tokens: int, source: dict) -> tracefile.Trace:
    """Run each prompt (prefill = teacher forcing), then greedily generate `max_tokens` tokens
    (0: teacher forcing only); every processed token is one step of the returned trace."""
    layers = sorted(engine.store.layers)
    chunks: dict[int, list] = {l: [] for l in layers}

    def observe(layer, indices, scores):
        chunks[layer].append((np.asarray(indices), np.asarray(scores, dtype=np.float16)))

    tokens, phase, starts = [], [], []
    engine.observe_routes(observe)
    try:
        for prompt in prompts:
            res = engine.generate(prompt, max_tokens=max(1, max_tokens), ignore_eos=True)
            fed = res.tokens[:-1] if max_tokens > 0 else []  # the last sampled token is never fed
            starts.append(len(tokens))
            tokens += list(prompt) + list(fed)
            phase += [0] * len(prompt) + [1] * len(fed)
    finally:
        engine.observe_routes(None)
    routes = np.stack([np.concatenate([i for i, _ in chunks[l]]) for l in layers])
    scores = np.stack([np.concatenate([s for _, s in chunks[l]]) for l in layers])
    if routes.shape[1] != len(tokens):
        raise RuntimeError(f"recorded {routes.shape[1]} route rows for {len(tokens)} tokens")
    meta = {
        "model": engine.model_id,
        "manifest_hash": manifest_hash(engine.root),
        "num_experts": engine.spec.num_experts,
        "top_k": int(routes.shape[2]),
        "layers": layers,
        "expert_bytes": [engine.store.expert_nbytes(l) for l in layers],
        "score_kind": engine.spec.routing.score_function if engine.spec.routing.kind == "grouped" else "softmax",
        "source": source,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return tracefile.Trace(routes, scores, np.array(tokens), np.array(phase), np.array(starts), meta)


def record_file(engine, data: Path, prompts: int, prompt_tokens: int, max_tokens: int) -> tracefile.Trace:
    """`record` on prompts cut from a text file, with the file's identity as the source."""
    if not data.is_file():
        raise Edge0Error(f"{data}: no such file; pass --data with a text file (e.g. data/valid.txt)")
    raw = data.read_bytes()
    chosen = split_prompts(engine, raw.decode("utf-8", errors="replace"), prompts, prompt_tokens)
    source = {
        "data": str(data),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "prompts": len(chosen),
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
    }
    return record(engine, chosen, max_tokens, source)


def synthetic_record(engine, steps: int, seed: int = 0) -> tracefile.Trace:
    """A trace of `steps` qwen3-like synthetic routes (edge0.cache.synthetic) with this engine's
    shape (experts, top-k, MoE layers, expert bytes) and identity: no model run."""
    from edge0.cache.synthetic import synthetic_trace

    if engine.spec is None:
        raise Edge0Error(
            f"--routing qwen3-like: {engine.model_id} is served at the universal level; synthetic routes need a "
            "spec'd family"
        )
    layers = sorted(engine.store.layers)
    meta = {
        "model": engine.model_id,
        "manifest_hash": manifest_hash(engine.root),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return synthetic_trace(
        engine.spec.num_experts, engine.k, layers, [engine.store.expert_nbytes(l) for l in layers], steps, seed, meta
    )
