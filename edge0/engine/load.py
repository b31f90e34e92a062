"""Open a store and assemble its engine: manifest checks, compute dtype, resident weights,
the expert store and the executors. Features (pre-router, adapter) attach afterwards."""

from __future__ import annotations

from pathlib import Path

from edge0.backend import assemble as bas
from edge0.backend import core as B
from edge0.backend import io as bio
from edge0.backend import kvcache as bkv
from edge0.backend import lookahead as bla
from edge0.backend import vision as bvision
from edge0.engine.engine import Engine
from edge0.engine.prefill import default_span
from edge0.engine.solo import KV_GROUP
from edge0.errors import Edge0Error
from edge0.families import supported
from edge0.spec import MoESpec, model_dims, moe_dims
from edge0.store import ExpertStore, open_manifest
from edge0.store.consistency import check_config
from edge0.store.format import RESIDENT_FILE
from edge0.store.resident import check_resident
from edge0.streaming.budget import Reserve, context_tokens, served_context
from edge0.streaming.dispatch import Streaming
from edge0.units import parse_size


def open_engine(root: Path, options, stage_for=None) -> Engine:
    """The engine of the store at `root`, loaded with validated LoadOptions `options`.
    `stage_for(root, manifest, config)` (edge0.distributed) may return this rank's pipeline stage:
    then only its layers are loaded and only their experts streamed."""
    manifest = open_manifest(root, verify=options.verify)
    config = bio.read_config(root, f"{REBUILD}, or put back the config.json it was converted with")
    check_config(root, config, manifest)  # before anything is built from it
    tokenizer = _load_tokenizer(root, options.trust_remote_code)
    # the family's model from config.json alone (never evaluated): checked against the store, and
    # the KV footprint is measured on it, as `edge0 plan` measures it
    built = _build(root, config)
    _check_config(root, config, manifest, built)
    _check_layer_executors(options, manifest)
    spec = MoESpec.from_dict(manifest["spec"]) if manifest.get("spec") else None
    if spec is None:
        _universal_checks(manifest, options)
    k = spec.serving_k(options.top_k) if spec else None
    ckpt_dtype = next(
        (t["dtype"] for l in manifest["expert_layers"] for n, t in l["tensors"].items() if n.endswith("scales")), "F32"
    )
    compute = B.pick_compute_dtype(options.dtype, B.ST_DTYPES.get(ckpt_dtype, "float32"))
    stage = stage_for(root, manifest, config) if stage_for else None
    local = stage.restrict(manifest) if stage else manifest
    store = ExpertStore(
        root,
        local,
        cold_reads=options.cold_reads,
        io=options.io,
        check_experts=options.check_experts,
        pace_reads=options.pace_reads,
    )
    # hashed on a thread while the backend loads it (--verify has hashed every file already)
    check = check_resident(root, manifest) if options.check_experts and not options.verify else None
    try:
        model = bas.assemble(
            root,
            RESIDENT_FILE,
            local,
            config,
            spec,
            k,
            compute,
            stage=(stage.rank, stage.size, list(stage.split)) if stage else None,
        )
    except Exception as e:
        if check is not None:
            check.result()  # damage explains a failed load better than the loader's own error
        if isinstance(e, (ValueError, ArithmeticError)):  # a config the weights do not fit (shapes, sizes)
            raise Edge0Error(
                f"{root / 'config.json'} does not fit the store's weights ({type(e).__name__}: {e}); put back "
                f"the config.json it was converted with, or {REBUILD}"
            ) from None
        raise
    if check is not None:
        check.result()
        store.resident_checked = check.name
    tower = _tower(root, manifest, config, compute, model, stage)
    # the default expert cache is sized now, with the resident weights already in memory
    reserve = _reserve(built, config, compute, options)
    streaming = Streaming(store, compute, k or _native_k(config), options, reserve)
    bas.attach_executors(model, streaming.layers)
    if options.lookahead != "off":
        shapes = {l: (d.num_experts, d.k) for l, d in streaming.layers.items()}
        streaming.use_lookahead(options.lookahead, bla.attach_lookahead(model, shapes))
    engine = Engine(root, model, tokenizer, store, streaming, spec, k, compute, stage)
    engine.use_tower(*tower)
    # the other conversations' KV caches: what was given, else the default budget's share
    pool, sized_for = streaming.prompt_caches
    engine.kv.use_pool(pool, sized_for)
    engine.kv.context_bytes = reserve.kv
    return engine


def _tower(root: Path, manifest: dict, config: dict, compute: str, model, stage) -> tuple:
    """(the store's vision tower or None, why a VL model has none): loaded before the expert cache
    is sized, so its default leaves the tower's memory."""
    entry = manifest.get("vision")
    if entry is None:
        if bvision.has_tower(config):
            return None, f"text only: the store holds no vision tower (converted before images were kept; {REBUILD})"
        return None, ""
    if stage is not None:
        return None, "text only across ranks"
    if not bvision.available():
        return None, "text only: mlx-vlm is not installed (pip install 'edge0[vision]')"
    return bvision.load_tower(root, entry, config, compute, model), ""


def _load_tokenizer(root: Path, trust_remote_code: bool):
    """The store's tokenizer, loaded before the weights so that a missing or damaged one fails first."""
    try:
        return bio.load_tokenizer(root, trust_remote_code)
    except Edge0Error:
        raise
    except Exception as e:  # noqa: BLE001 - whatever transformers raises on missing or damaged files
        raise Edge0Error(
            f"{root}: its tokenizer does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"put back the tokenizer files it was converted with (tokenizer.json, tokenizer_config.json), or "
            f"{REBUILD}; edge0 verify {root} names the files that differ"
        ) from None


def _reserve(built, config: dict, compute: str, options) -> Reserve:
    """What the default expert cache leaves memory for: the KV cache at the context
    (--context-tokens), prefill activations at that context, the --prompt-cache-memory given or
    None, and one KV cache at the context served (the default prompt caches' unit). The KV bytes
    are those the family's own caches hold in the compute dtype, measured on `built`, the whole
    model built from config.json (backend.kvcache: latent attention, sliding windows and recurrent
    states as the family lays them out; a pipeline stage's own model would exchange with other
    ranks in its forward); the activations follow docs/long-prompts.md ("Memory"): 6 x T x D x 4
    bytes."""
    context = context_tokens(config, options.context_tokens)
    served = served_context(config, options.context_tokens)
    hidden = model_dims(config)[0]
    span = min(context, options.prefill_span or default_span(hidden))
    try:
        footprint = bkv.kv_footprint(built, options.kv_bits, options.kv_group_size, compute)
        kv, served_kv = footprint.bytes_at(context), footprint.bytes_at(served)
    except (ValueError, TypeError, AttributeError) as e:
        if options.kv_bits and "group size" in str(e):  # mlx-lm's quantized cache needs key widths it divides
            raise Edge0Error(KV_GROUP.format(group=options.kv_group_size)) from None
        if options.kv_bits:  # latent attention, attention sinks: mlx-lm's attention takes no quantized cache
            raise Edge0Error(
                f"--kv-bits: {config.get('model_type')}'s attention in mlx-lm does not take a quantized KV cache "
                f"({type(e).__name__}: {e}); run it without --kv-bits"
            ) from None
        raise
    pool = None if options.prompt_cache_memory is None else parse_size(options.prompt_cache_memory)
    return Reserve(kv, context, 6 * span * hidden * 4, pool, served_kv, served)


REBUILD = "convert the checkpoint again (edge0 convert --hf-path SRC -o DIR)"


def _build(root: Path, config: dict):
    """The family's mlx-lm model built from config.json (lazy: nothing evaluated)."""
    try:
        return bio.build_model(config, root)
    except ArithmeticError as e:  # a value the checks before let through (ZeroDivisionError, OverflowError)
        raise Edge0Error(
            f"{root / 'config.json'}: mlx-lm cannot build the model from it ({type(e).__name__}: {e}); {REBUILD}"
        ) from None


def _check_config(root: Path, config: dict, manifest: dict, built) -> None:
    """config.json (`built`: its model) must describe the MoE model the manifest indexes: the same
    model_type, routed experts in the same modules (assembly replaces them by path); its sizes were
    checked against the store before (store/consistency.py)."""
    path = root / "config.json"
    found = bio.expert_modules(built, root, supported())
    if config["model_type"] != manifest["model_type"]:
        raise Edge0Error(
            f"{path}: model_type {config['model_type']!r}, but the store holds a "
            f"{manifest['model_type']!r} model; {REBUILD}"
        )
    if {p for p, _ in found} != {l["module"] for l in manifest["expert_layers"]}:
        raise Edge0Error(
            f"{path}: its model has routed experts in {len(found)} layers, not in the "
            f"{len(manifest['expert_layers'])} MoE layers the store holds; {REBUILD}"
        )


def _check_layer_executors(options, manifest: dict) -> None:
    """--layer-executor must name MoE layers of this store (other layers have no executor)."""
    moe = sorted(l["layer"] for l in manifest["expert_layers"])
    for layer, choice in sorted(options.layer_executors.items()):
        if layer not in moe:
            spec = ",".join(f"{layer}:{phase}={name}" for phase, name in choice.items())
            raise Edge0Error(
                f"--layer-executor {spec}: layer {layer} is not a MoE layer of this store; "
                f"its MoE layers are {_spans(moe)}"
            )


def _spans(layers: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    runs: list[list[int]] = []
    for n in layers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _universal_checks(manifest: dict, options) -> None:
    """Options that need Edge0's own routing, refused for a family served at the universal level."""
    family = manifest["model_type"]
    if options.top_k is not None:
        raise Edge0Error(
            f"--top-k: {family} has no MoESpec (universal level); the serving width can only be changed for spec'd "
            "families"
        )
    if options.cache_policy == "smoe" or options.substitute_alpha:
        flag = "--cache-policy smoe" if options.cache_policy == "smoe" else "--substitute-alpha"
        raise Edge0Error(
            f"{flag} needs router scores, which Edge0 has only for spec'd families ({family} "
            "is served at the universal level); use --cache-policy lru, lfu or arc without substitution"
        )


def _native_k(config: dict) -> int:
    """Experts per token of a universal-level family (its slot sets must hold one route)."""
    return moe_dims(config)[1] or 1
