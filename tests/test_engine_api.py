"""The server sees an engine only through edge0.engine.api.EngineAPI (and the batch it yields
through BatchAPI): the real engine and the tests' fake engine both implement it, member by member
with compatible signatures, so the fake cannot drift from what the server relies on."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import edge0
from edge0.engine.api import BatchAPI, EngineAPI
from edge0.engine.batch import Batch
from edge0.engine.parts import Parts
from tests.fake_engine import FakeBatch, FakeEngine


def drift(proto, obj) -> list[str]:
    """What `obj` lacks of `proto`: missing members, and methods whose parameters do not start
    with the protocol's (same names, same order; extra ones must have defaults)."""
    cls, problems = type(obj), []
    for name in getattr(proto, "__annotations__", {}):
        if not hasattr(obj, name):
            problems.append(f"{cls.__name__}.{name} missing")
    for name, member in vars(proto).items():
        if name.startswith("_") and name != "__len__":
            continue
        if isinstance(member, property):
            if not isinstance(getattr(cls, name, None), property):
                problems.append(f"{cls.__name__}.{name} is not a property")
            continue
        if not callable(member):
            continue
        got = getattr(cls, name, None)
        if got is None or not callable(got):
            problems.append(f"{cls.__name__}.{name} missing")
            continue
        want = [p.name for p in list(inspect.signature(member).parameters.values())[1:]]
        have = list(inspect.signature(inspect.unwrap(got)).parameters.values())[1:]
        if [p.name for p in have[: len(want)]] != want:
            problems.append(f"{cls.__name__}.{name}: parameters {[p.name for p in have]}, want {want}")
            continue
        extra = [
            p.name
            for p in have[len(want) :]
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        if extra:
            problems.append(f"{cls.__name__}.{name}: parameters without defaults {extra}")
    return problems


def test_the_real_and_the_fake_engine_implement_the_engine_api(store_for):
    real, fake = edge0.load(store_for("qwen3_moe"), prerouter=False), FakeEngine()
    for engine, kind in ((real, Batch), (fake, FakeBatch)):
        assert drift(EngineAPI, engine) == [] and isinstance(engine, EngineAPI)
        with engine.batching() as batch:
            assert drift(BatchAPI, batch) == [] and isinstance(batch, BatchAPI) and isinstance(batch, kind)
            assert not batch.busy and len(batch) == 0
    # the engine is the composition root: what it hands over is its own parts, as they are now
    parts = real.parts()
    assert all(getattr(parts, f.name) is getattr(real, f.name) for f in dataclasses.fields(Parts))


# where the engine's parts go instead of the engine (issue 48: the engine as the composition root)
TAKES_PARTS = (
    "engine/batch.py",
    "engine/solo.py",
    "engine/step.py",
    "engine/diagnostics.py",
    "distributed/pipeline.py",
)


def engine_uses(source: str) -> list[str]:
    """Where `source` takes or reaches an engine: parameters named `engine`, `.engine` attributes."""
    tree, found = ast.parse(source), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += [f"line {node.lineno}: parameter engine" for a in node.args.args if a.arg == "engine"]
        if isinstance(node, ast.Attribute) and node.attr == "engine":
            found.append(f"line {node.lineno}: .engine")
    return found


def test_the_loop_diagnostics_and_the_pipeline_receive_parts_not_the_engine():
    root = Path(edge0.__file__).parent
    assert {name: engine_uses((root / name).read_text()) for name in TAKES_PARTS} == {n: [] for n in TAKES_PARTS}
    assert engine_uses(
        "def f(engine):\n    return engine.kv\n\nclass A:\n    def g(self):\n        self.engine = 1\n"
    ) == [
        "line 1: parameter engine",
        "line 6: .engine",
    ]


def test_an_engine_that_drifts_is_named():
    class Drifted(FakeEngine):
        def chat_prompt(self, conversation, tools=None):  # a renamed parameter
            return []

        def batch_problem(self, why):  # a new parameter without a default
            return None

    drifted = Drifted()
    del drifted.tokenizer
    assert drift(EngineAPI, drifted) == [
        "Drifted.tokenizer missing",
        "Drifted.chat_prompt: parameters ['conversation', 'tools'], want ['messages', 'tools', 'template_kwargs']",
        "Drifted.batch_problem: parameters without defaults ['why']",
    ]
    assert drift(EngineAPI, type("NoStats", (FakeEngine,), {"stats": None})()) == ["NoStats.stats missing"]
