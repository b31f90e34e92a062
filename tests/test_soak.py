"""A short soak (scripts/soak_server.py's loop): requests through the real server on the bundled demo
model with its pre-router heads. Nothing the engine keeps for the pre-router may grow with the
number of decode steps (the stager once appended an event per layer and step, forever); the
1,000-request run and its RSS numbers are in docs/server.md."""

from __future__ import annotations

import importlib.util
import os
from collections import deque
from pathlib import Path

import edge0
from edge0.server.config import ServerConfig
from tests.fake_server import running_server

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("soak_server", ROOT / "scripts" / "soak_server.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def state_items(*roots) -> int:
    """Items of every list, tuple, dict, set and deque reachable from `roots` through edge0 objects
    (mlx arrays, threads and other libraries' objects are not followed)."""
    seen, stack, n = set(), list(roots), 0
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, dict):  # mlx modules are dicts of their children
            n += len(o)
            stack += [*o.keys(), *o.values()]
        elif isinstance(o, (list, tuple, set, frozenset, deque)):
            n += len(o)
            stack += list(o)
        if type(o).__module__.startswith("edge0.") and hasattr(o, "__dict__"):
            stack += list(vars(o).values())
    return n


def test_prerouter_state_does_not_grow_with_decode_steps():
    soak = _script()
    engine = edge0.load(None)  # the bundled demo model ships pre-router heads
    assert engine.prerouting is not None and engine.hooks is not None
    items = {}

    def sample():
        items[len(items)] = state_items(engine.hooks, engine.prerouting)
        return soak.rss_bytes(os.getpid())

    with running_server(engine, ServerConfig()) as url:
        r = soak.soak(url, requests=9, first=3, rss=sample, max_tokens=4, every=3)
    assert r["requests"] == 9 and r["completion_tokens"] == 9 * 4 and r["prerouter"]
    assert [s["requests"] for s in r["samples"]] == [3, 6, 9]
    steps = 3 * 4  # decode steps between two samples
    # caches bounded by the model (experts seen, LRU order) may still settle; a per-step history
    # adds at least one item per step
    assert items[2] - items[1] < steps, items
    assert items[1] - items[0] < steps, items
    engine.close()
