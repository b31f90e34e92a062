"""`edge0.load` put together: resolve the model (a store, or the bundled demo model), open its
engine, then attach the features it serves with: pre-router heads, then the recovery adapter
(whose identity includes the heads), then the prompt-cache directory (whose identity includes
both)."""

from __future__ import annotations

from pathlib import Path

from edge0.backend.core import one_heap
from edge0.distributed.setup import connect, join, ready, stage_planner
from edge0.engine import Engine, open_engine
from edge0.engine.drafters import DEFAULT_NUM_DRAFT, make_drafter
from edge0.engine.speculative import Speculator
from edge0.lora.attach import attach_lora, store_adapter
from edge0.options import LoadOptions
from edge0.prerouter.attach import attach_prerouter, heads_path
from edge0.store.bundled import resolve_model


def load_engine(path, options: LoadOptions) -> Engine:
    """The engine for `path` (None: the bundled demo model) with `options` (validated here);
    under mlx.launch, this rank's stage of it (docs/distributed.md)."""
    options.validate()
    one_heap()  # before the reader threads allocate
    group = connect(options)
    root = resolve_model(path)
    engine = open_engine(root, options, stage_planner(group, options))
    if engine.stage is not None:
        join(engine, group, options.peer_timeout)
        if engine.pipeline is not None and not engine.pipeline.leads:
            # the other ranks keep their share of rank 0's prompt caches, as rank 0 says
            # (distributed/mirror.py): a pool of their own would keep nothing
            engine.kv.use_pool(0)
    heads = heads_path(root, options.prerouter, engine.spec)
    if heads is not None:
        attach_prerouter(engine, heads, diagnostics=options.prerouter_diagnostics)
    if options.lora is not False:
        adapter, why = (Path(options.lora).expanduser(), "") if options.lora is not None else store_adapter(engine)
        if adapter is not None:
            attach_lora(engine, adapter)
        elif why:
            engine.no_lora(why)
    # rank 0 drafts and verifies; the other ranks run the verify's forwards and mirror its rewinds
    leads = engine.pipeline is None or engine.pipeline.leads
    drafter = (
        make_drafter(options.draft, options.draft_ngram, engine.tokenizer, engine.model_id, options.dtype)
        if leads
        else None
    )
    if drafter is not None:  # speculation does not change outputs: not part of the prompt cache's identity
        engine.use_speculation(Speculator(drafter, options.num_draft or DEFAULT_NUM_DRAFT, options.draft_adaptive))
    if options.prompt_cache_dir:  # last: its identity includes the heads and the adapter (and a rank's stage)
        engine.use_prompt_cache_dir(options.prompt_cache_dir, options.prompt_cache_bytes())
    if engine.pipeline is not None:
        ready(engine)
    return engine
