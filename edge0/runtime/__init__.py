"""The api floor: `edge0.load` put together from the engine and the features it serves with."""

from edge0.runtime.load import load_engine

__all__ = ["load_engine"]
