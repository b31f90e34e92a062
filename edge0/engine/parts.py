"""What the generation loop, the diagnostics passes and the pipeline use of a loaded model. The
engine is the composition root: it builds its parts once and hands these, never itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge0.engine.kv import PromptCache
from edge0.engine.prefill import Prefiller
from edge0.engine.step import Stepper


@dataclass(frozen=True)
class Parts:
    """One engine's parts as they are when handed over (a Batch takes them as it starts, so a
    drafter attached between generations is seen by the next one)."""

    model_id: str
    model: Any  # the mlx-lm model with Edge0's MoE blocks
    tokenizer: Any
    control_ids: set[int]  # chat-format control tokens: generated, never shown as text
    kv: PromptCache
    prefiller: Prefiller
    stepper: Stepper  # its `hooks` are the features' step hooks
    streaming: Any  # the experts' executors and their stats (edge0/runtime)
    store: Any  # the expert store and its reader (io_stats)
    compute_dtype: str
    resident_bytes: int  # the weights that stay in memory
    spec: Any = None  # the family spec (None: served at the universal level)
    speculation: Any = None  # the lone sequence's speculator (speculative.py)
    batch_speculation: Any = None  # the same drafter for a batch's rows, its own switch
    prerouting: Any = None  # the pre-router, when attached
    pipeline: Any = None  # this rank's end of the stage exchange (edge0/distributed)
