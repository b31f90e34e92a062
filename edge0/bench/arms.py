"""The arms: what each one runs (BASES), the per-arm metrics, and the spec handed to an arm's process."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge0.bench.model import Model
from edge0.errors import Edge0Error
from edge0.store.format import HEADS_FILE

PREROUTER = "<prerouter>"  # placeholder in an arm's load options: the --prerouter path (or the store's)
LORA = "<lora>"  # placeholder: the --lora path (or the store's adapter for the serving K)


@dataclass(frozen=True)
class Base:
    """One way of running the model. Edge0 bases get a warm and a cold arm each."""

    name: str
    runtime: str  # "edge0" or "mlx-lm"
    load: dict = field(default_factory=dict)
    needs_prerouter: bool = False
    needs_lora: bool = False
    storages: tuple = ("warm", "cold")  # edge0 arms to make from this base


# Adding an arm is one entry here.
BASES = (
    Base("mlx-lm", "mlx-lm"),
    Base("exact", "edge0", {"decode_executor": "exact", "prerouter": False, "lora": False}),
    Base("staged", "edge0", {"decode_executor": "staged", "prerouter": False, "lora": False}),
    Base("hot", "edge0", {"decode_executor": "hot", "prerouter": False, "lora": False}),
    Base(
        "prerouter", "edge0", {"decode_executor": "staged", "prerouter": PREROUTER, "lora": False}, needs_prerouter=True
    ),
    # the decode cost of the recovery LoRA: compare with prerouter-warm
    Base(
        "prerouter-lora",
        "edge0",
        {"decode_executor": "staged", "prerouter": PREROUTER, "lora": LORA},
        needs_prerouter=True,
        needs_lora=True,
        storages=("warm",),
    ),
)
CAPPED = ("mlx-lm", "exact", "staged", "hot", "prerouter")  # run under the memory cap (and any --read-limit)


@dataclass(frozen=True)
class Arm:
    name: str
    base: Base
    storage: str  # "warm", "cold" or "capped"
    cancellable: bool = False  # generate with should_stop, as the server does (the prefill checks it per layer)

    @property
    def runtime(self) -> str:
        return self.base.runtime


def all_arms() -> list[Arm]:
    arms = [Arm("mlx-lm-resident", BASES[0], "warm")]
    edge = [b for b in BASES if b.runtime == "edge0"]
    arms += [Arm(f"{b.name}-warm", b, "warm") for b in edge if "warm" in b.storages]
    arms += [Arm(f"{b.name}-cold", b, "cold") for b in edge if "cold" in b.storages]
    by_name = {b.name: b for b in BASES}
    arms += [Arm(f"{n}-capped", by_name[n], "capped") for n in CAPPED]
    return arms


# Per-arm numbers (positive and finite, or null where they do not apply).
METRICS = (
    "decode_tps",
    "prefill_tps",
    "ttft_s",
    "load_s",
    "wall_s",
    "mlx_peak_bytes",
    "mlx_decode_peak_bytes",
    "mlx_load_peak_bytes",
    "peak_rss_bytes",
    "resident_bytes",
    "expert_cache_bytes",
    "expert_bytes_read",
    "decode_expert_bytes_read",
    "hit_rate",
    "stall_ms_per_step",
    "host_syncs_per_step",
    "expert_reads_per_step",
    "io_max_queue_depth",
    "prompt_tokens",
    "generation_tokens",
    "prefill_expert_bytes_read",
    "prefill_stall_ms",
    "lookahead_recall",  # how often the next layer's predicted experts were routed (--lookahead)
    "lookahead_wasted_bytes",  # bytes read ahead on a prediction the route did not take
    "early_experts_per_step",  # predicted experts computed before their route reached the host (streaming/early.py)
    "early_unused_per_step",  # ... that the route did not take (computed for nothing)
)
COUNTERS = ("fallbacks", "dropped_experts")

SIZES = {  # preset -> (bench-model size, prompt tokens, decode tokens)
    "full": ("full", 40, 32),
    "quick": ("quick", 40, 32),
}


def resolved_load(arm: Arm, args) -> dict:
    """The arm's engine options with the placeholders replaced by the --prerouter / --lora files
    (None: the store's own heads / adapter; the child reports if none fits)."""
    given = {PREROUTER: args.prerouter, LORA: args.lora}
    return {k: given.get(v, v) if isinstance(v, str) else v for k, v in arm.base.load.items()}


def arm_spec(arm: Arm, model: Model, args, budget: int, sizes: dict) -> dict:
    spec = {
        "name": arm.name,
        "runtime": arm.runtime,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "dtype": args.dtype,
        "cancellable": arm.cancellable,
    }
    if arm.runtime == "mlx-lm":
        spec["mlx_model"] = str(model.mlx)
        files = sorted(model.mlx.glob("*.safetensors"))
    else:
        load = resolved_load(arm, args)
        load["expert_cache"] = budget
        load["dtype"] = args.dtype
        if args.routing != "uniform":  # synthetic routes replace the gates; the pre-router arms read one step ahead
            load.update(prerouter=False, lora=False)
            spec.update(routing=args.routing, lookahead=arm.base.needs_prerouter)
        if arm.storage == "cold":
            load["cold_reads"] = True  # every expert read comes from storage, as with a model > RAM
        spec.update(
            store=str(model.store),
            load=load,
            prerouter_required=arm.base.needs_prerouter and args.routing == "uniform",
            lora_required=arm.base.needs_lora,
        )
        files = sorted(model.store.rglob("*.safetensors"))
    if arm.storage in ("cold", "capped"):
        spec["evict"] = [str(f) for f in files]
    else:
        spec["prewarm"] = [str(f) for f in files]
    return spec


def skip_reason(arm: Arm, model: Model, args, cgroup_parent) -> str:
    if arm.runtime == "mlx-lm" and model.mlx is None:
        return model.mlx_missing_reason
    if args.routing != "uniform" and arm.base.needs_lora:
        return f"--routing {args.routing}: the recovery LoRA is trained for the model's own routes"
    if (
        args.routing == "uniform"
        and arm.base.needs_prerouter
        and args.prerouter is None
        and not (model.store / HEADS_FILE).is_file()
    ):
        return (
            "no pre-router heads for this model: the store has no prerouter.safetensors and --prerouter "
            "was not given (train some with edge0 train-prerouter)"
        )
    if arm.base.needs_lora and args.lora is None and not any(model.store.glob("lora*.safetensors")):
        return (
            "no recovery LoRA for this model: the store has no adapter and --lora was not given "
            "(train one with edge0 train-lora)"
        )
    if arm.storage == "capped":
        if args.no_cap:
            return "--no-cap"
        if cgroup_parent is None:
            return args._cgroup_reason
    return ""


def select_arms(spec: str | None) -> list[Arm]:
    arms = all_arms()
    if not spec:
        return arms
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    names = {a.name for a in arms} | {b.name for b in BASES}
    bad = [w for w in wanted if w not in names]
    if bad:
        raise Edge0Error(
            f"--arms {','.join(bad)}: unknown; choose from {', '.join(a.name for a in arms)} "
            f"(or an executor name: {', '.join(b.name for b in BASES)})"
        )
    return [a for a in arms if a.name in wanted or a.base.name in wanted]
