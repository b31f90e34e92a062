"""Joining the ranks at load: the group (only under mlx.launch), the checks that every rank loads
the same store with the same split and serving options, and each rank's stage."""

from __future__ import annotations

import hashlib
import json

from edge0.backend import distributed as bdist
from edge0.backend import io as bio
from edge0.backend import kvcache as bkv
from edge0.backend import stages as bstages
from edge0.distributed.pipeline import Pipeline
from edge0.distributed.split import Stage, plan_split
from edge0.errors import Edge0Error
from edge0.store.format import RESIDENT_FILE, manifest_hash, sha256_file

_WIDTH = 64  # bytes each rank contributes to an agreement check
_TRAITS = 256  # bytes each rank contributes to cache_traits


def connect(options):
    """The group of ranks when this process is one of several started by mlx.launch, else None.
    Called before anything slow, so that the ranks meet within --peer-timeout."""
    return bdist.init_group(options.peer_timeout) if bdist.launched() else None


def agree(group, what: str, value: str, fix: str) -> None:
    """Every rank must hold the same `value` (compared in full up to 64 characters, else by
    sha256); an Edge0Error on every rank otherwise."""
    text = value if len(value) <= _WIDTH else hashlib.sha256(value.encode()).hexdigest()
    every = [v.rstrip(b"\0").decode() for v in bdist.all_gather_bytes(group, text.encode().ljust(_WIDTH, b"\0"))]
    differ = [r for r, v in enumerate(every) if v != every[0]]
    if differ:
        r = differ[0]
        raise Edge0Error(
            f"rank {group.rank()}: {what} differs between ranks (rank 0: {every[0][:16]}, rank {r}: "
            f"{every[r][:16]}); {fix}"
        )


def stage_planner(group, options):
    """open_engine's `stage_for`: None when there is nothing to plan (one process, no split)."""
    if group is None and options.pipeline_split is None:
        return None
    return lambda root, manifest, config: plan_stage(group, root, RESIDENT_FILE, manifest, config, options)


def plan_stage(group, root, resident_file: str, manifest: dict, config: dict, options) -> Stage | None:
    """This rank's stage, or None in one process (where a --pipeline-split must be the one count
    that covers every layer)."""
    if group is not None:  # the root cause first: a different store makes every other check differ
        agree(
            group,
            "the store (manifest hash)",
            manifest_hash(root),
            "every rank must load the same store: copy one store to every machine, or convert the same checkpoint on "
            "each",
        )
    model = bio.build_model(config, root)
    num_layers = bstages.num_layers(model)
    ranks = group.size() if group is not None else 1
    split = plan_split(
        root, resident_file, manifest, num_layers, ranks, options.pipeline_split, bstages.layer_groups(model)
    )
    if group is None:
        return None
    agree(group, "the layer split", ",".join(map(str, split)), "start every rank with the same --pipeline-split")
    moe = tuple(sorted(int(l["layer"]) for l in manifest["expert_layers"]))
    return Stage(group.rank(), ranks, split, moe)


def join(engine, group, peer_timeout: float = 60.0) -> None:
    """Give a staged engine its end of the stage exchange (before the features attach: the
    pre-router connects its cross-stage predictions to it), with what every rank's share of a
    prompt cache allows (`cache_traits`)."""
    engine.pipeline = Pipeline(group, engine.stage, engine.parts(), engine.stats, peer_timeout)
    engine.pipeline.traits = cache_traits(group, engine.kv.make())


def cache_traits(group, cache) -> dict:
    """What the ranks' shares of a prompt cache (this rank's: `cache`) allow together: a
    speculative verify's rewind (`rewind_problem`: the first rank's reason it cannot, None if
    every rank can), whether it feeds the kept tokens again (`replays`: some rank's layers may not
    be cut back: recurrent state, a sliding window), and a batched verify (`drop_tails`: every
    rank's rows can drop their tails)."""
    problem = bkv.rewind_problem(cache)
    mine = json.dumps([problem[:200] if problem else None, bkv.replays(cache), bkv.rows_can_drop_tails(cache)])
    every = [json.loads(v.rstrip(b"\0")) for v in bdist.all_gather_bytes(group, mine.encode().ljust(_TRAITS, b"\0"))]
    problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(every) if p]
    return {
        "rewind_problem": problems[0] if problems else None,
        "replays": any(r for _, r, _ in every),
        "drop_tails": all(t for _, _, t in every),
    }


def ready(engine) -> None:
    """After the features are attached: check that every rank serves with the same options
    (serving width, dtype, heads, adapter, substitution), then let rank 0 lead."""
    pipe = engine.pipeline
    serving = {
        "k": engine.k,
        "dtype": engine.compute_dtype,
        "substitute_alpha": engine.streaming.options.substitute_alpha,
        "heads": sha256_file(engine.heads_path) if engine.heads_path else None,
        "lora": sha256_file(engine.lora_path) if engine.lora_path else None,
        "prompt_cache_dir": engine.kv.disk is not None,  # every rank keeps its share of the tier, or none does
    }
    agree(
        pipe.group,
        "the serving options (top-k, dtype, pre-router heads, LoRA adapter, substitution, prompt-cache dir)",
        json.dumps(serving, sort_keys=True),
        "start every rank with the same flags and the same sidecar files",
    )
    if pipe.leads:
        pipe.lead()
