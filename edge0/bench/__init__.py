"""The benchmark suite behind `edge0 bench` (edge0/cli/bench.py): Edge0 against resident mlx-lm, warm and
cold storage, under a memory cap (docs/bench-suite.md)."""

import importlib

# Re-exports resolve on first use: an arm's process (`python -m edge0.bench.child`) imports this
# package too, and must not load the rest of the suite (its peak RSS is a measured number).
_EXPORTS = {"METRICS": "arms", "all_arms": "arms", "SCHEMA": "report"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
