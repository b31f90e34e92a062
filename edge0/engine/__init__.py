"""The engine: a loaded model's generation loop (engine.py), how one is opened (load.py), the
reusable KV cache (kv.py), the hooks features attach through (hooks.py), statistics (stats.py)
and the passes used for checks and traces (diagnostics.py)."""

from edge0.engine.engine import Engine, GenerationResult
from edge0.engine.hooks import StepHooks
from edge0.engine.load import open_engine
from edge0.engine.reply import Step

__all__ = ["Engine", "GenerationResult", "Step", "StepHooks", "open_engine"]
