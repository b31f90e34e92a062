"""How many requests the server decodes together (--max-batch, or a default from memory), and
why; the scheduler (scheduler.py) runs them."""

from __future__ import annotations

from edge0.engine.api import EngineAPI
from edge0.server.scheduler import Scheduler

DEFAULT_MAX_BATCH = 8  # the most requests decoded together when memory allows more


def default_max_batch(engine: EngineAPI) -> tuple[int, str]:
    """(requests decoded together, why): one, plus as many as the prompt caches' memory holds
    contexts' KV caches (each one beyond the first takes that much from the pool while it runs,
    engine/batch.py), at most DEFAULT_MAX_BATCH."""
    spare = engine.spare_contexts()
    if spare is None:
        return DEFAULT_MAX_BATCH, "no KV footprint known"
    n = max(1, min(DEFAULT_MAX_BATCH, 1 + spare))
    return n, f"the prompt caches' memory holds {n - 1} more contexts' KV (--prompt-cache-memory)"


def make_scheduler(engine: EngineAPI, max_queue: int, max_batch: int | None) -> tuple[Scheduler, dict]:
    """The scheduler for `engine`, decoding up to --max-batch requests together where the engine
    can batch (else one at a time); and what /v1/stats says of the choice."""
    why_not = engine.batch_problem()
    if max_batch is None:
        max_batch, why = default_max_batch(engine) if why_not is None else (1, why_not)
    else:
        why = "--max-batch" if why_not is None or max_batch == 1 else why_not
        max_batch = max_batch if why_not is None else 1
    return Scheduler(max_queue, max_batch), {"max_batch": max_batch, "why": why}
