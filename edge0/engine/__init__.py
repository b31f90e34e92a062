"""The engine: a loaded model's generation loop (engine.py), how one is opened (load.py), the
reusable KV cache (kv.py), the hooks features attach through (hooks.py), statistics (stats.py)
and the passes used for checks and traces (diagnostics.py)."""

from importlib import import_module

# Imported on first use: the engine imports the backend (mlx-lm, transformers: 2 s), which the
# command line's option tables (edge0.options reads the drafters' defaults) do not need.
_EXPORTS = {
    "Engine": "edge0.engine.engine",
    "GenerationResult": "edge0.engine.engine",
    "Step": "edge0.engine.reply",
    "StepHooks": "edge0.engine.hooks",
    "open_engine": "edge0.engine.load",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'edge0.engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
