"""One rank of tests/test_distributed.py: `python tests/dist_worker.py RUNS.json OUT.json`, started
with MLX_HOSTFILE and MLX_RANK like mlx.launch does. For each run (load keywords and a prompt) it
loads the engine, generates on rank 0 (follows elsewhere) and writes what this rank saw: the
generated tokens (rank 0; a batch's and an interleaved session's too, when the run has them), the
expert files it opened, its layers, MoE layers and adapted linears, and rank 0's stats; or the
one-line refusal of a load that is refused across ranks."""

import json
import os
import sys
from pathlib import Path

import numpy as np

import edge0
from edge0.backend import distributed as bdist
from edge0.backend import lora as blora
from edge0.engine.drafters import Draft, Drafter
from edge0.errors import Edge0Error

opened: list[str] = []
_open = os.open


def counting_open(path, flags, *args, **kwargs):
    """os.open, recording every expert file this process opens."""
    if "/experts/" in str(path):
        opened.append(Path(path).name)
    return _open(path, flags, *args, **kwargs)


os.open = counting_open


class Known(Drafter):
    """Drafts the known greedy continuation of each prompt in `known` ({prompt ids: tokens}), each
    token right with probability `p` (else another token): verifies that keep and reject drafts."""

    def __init__(self, known: dict, p: float, seed: int = 0):
        self.known, self.p, self.seed = known, p, seed
        self.rng = np.random.default_rng(seed)

    def draft(self, context, k, temp=0.0, top_p=1.0, key=None):
        prompt = max((ids for ids in self.known if tuple(context[: len(ids)]) == ids), key=len)
        i = len(context) - len(prompt)
        return Draft([t if self.rng.random() < self.p else (t + 1) % 200 for t in self.known[prompt][i : i + k]])

    def fork(self):
        self.seed += 1
        return Known(self.known, self.p, self.seed)


runs = json.loads(Path(sys.argv[1]).read_text())
results = []
for run in runs:
    opened.clear()
    try:
        engine = edge0.load(run["store"], **run["options"])
    except Edge0Error as e:  # a family refused across ranks: every rank says so, and goes on
        results.append({"refused": str(e)})
        continue
    out = {
        "rank": engine.stage.rank,
        "moe_layers": sorted(engine.store.layers),
        "layers": list(range(engine.stage.start, engine.stage.end)),
        "lora": sorted(blora.lora_modules(engine.model)),
        "layerwise": engine.prefiller.layerwise,  # prefill spans layer by layer (else chunk by chunk)
        "why_not_layerwise": engine.prefiller.probe.why_not,
        "keepalive": bdist.keep_alive_settings(engine.pipeline.sockets),
    }
    if engine.follower:
        if run.get("follower_memory_low"):  # a memory watcher reading no memory left: shrink to the floor
            from edge0.server.memory import MemoryWatcher

            MemoryWatcher(engine, 10**15, 0.01, read=lambda: (0, "test")).start(engine.pipeline.run_between)
        engine.follow()
        out["expert_cache"] = engine.expert_cache()
    else:
        if run.get("controlled"):  # speculative decoding, each drafted token right with probability p
            from edge0.engine.speculative import Speculator

            wants, p = run["controlled"]
            known = {tuple(engine.encode(prompt)): want for prompt, want in wants.items()}
            engine.use_speculation(Speculator(Known(known, p), num_draft=4, adaptive=False))
        res = engine.generate(run["prompt"], max_tokens=run["max_tokens"], ignore_eos=run["ignore_eos"])
        out["speculation"] = res.stats.get("speculation")
        stats = engine.stats()
        # requests that reuse the KV cache one after another (a conversation, another, the first again)
        out["turns"] = [
            engine.generate(p, max_tokens=run["max_tokens"], ignore_eos=True, reuse_cache=True).tokens
            for p in run.get("turns", [])
        ]
        out.update(tokens=res.tokens, layer_stats=stats["layers"], ranks=stats["ranks"], prerouter=stats["prerouter"])
        if run.get("batch"):  # prompts decoded together in one batch
            got = engine.generate_batch(run["batch"], max_tokens=run["max_tokens"], ignore_eos=True)
            out["batch"] = [r.tokens for r in got]
            out["batch_stats"] = got[0].stats["batch"]
            out["batch_layer_stats"] = engine.stats()["layers"]  # every rank's, after the batch
            if engine.batch_speculation is not None:
                out["batch_speculation"] = engine.batch_speculation.counts
        # an agent's session: conversations interleaved, each turn reusing what the pool kept of it
        out["session"] = []
        for p in run.get("session", []):
            r = engine.generate(p, max_tokens=run["max_tokens"], ignore_eos=True, reuse_cache=True)
            out["session"].append({"tokens": r.tokens, "cached": r.stats["prompt_tokens"] - r.stats["prefill_tokens"]})
        if run.get("session"):  # what the ranks hold of the pool, and what rank 0 freed for the others
            out["after_session"] = {"ranks": engine.stats()["ranks"], "pool": engine.kv.stats()["memory"]}
    engine.close()
    out["prompt_cache"] = engine.kv.stats()  # after close: rank 0 flushed the disk tier, every rank saved its share
    out["opened"] = list(opened)
    results.append(out)
Path(sys.argv[2]).write_text(json.dumps(results))
