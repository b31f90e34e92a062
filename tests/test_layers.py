"""The package's floors, bottom up: no module imports from a floor above its own, and no two
modules import each other, directly or around a loop. Every import counts, also one inside a
function. docs/architecture.md draws the same diagram."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "edge0"

# (floor, packages), bottom up. A module belongs to the floor of its package; the package root
# holds only the shared modules of ROOT (each in its floor) and packages. "edge0" alone is the
# package's __init__, the public `edge0.load`.
FLOORS = [
    ("base", []),
    ("backend", ["edge0.backend"]),
    ("data", ["edge0.store", "edge0.cache", "edge0.families", "edge0.formats"]),
    ("streaming", ["edge0.streaming"]),
    ("engine", ["edge0.engine"]),
    ("features", ["edge0.prerouter", "edge0.lora", "edge0.distributed"]),
    ("api", ["edge0.runtime", "edge0"]),
    ("apps", ["edge0.server", "edge0.bench", "edge0.planning"]),
    ("cli", ["edge0.cli"]),
]
# The package root's own modules: the shared names, and the entry points.
ROOT = {
    "errors": "base",
    "version": "base",
    "units": "base",
    "spec": "base",
    "textstream": "base",
    "sampling": "base",
    "options": "engine",
    "__main__": "cli",
    "serve": "cli",
}
_FLOOR_INDEX = {name: i for i, (name, _) in enumerate(FLOORS)}
RANK = {
    **{prefix: i for i, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes},
    **{f"edge0.{m}": _FLOOR_INDEX[f] for m, f in ROOT.items()},
}


def floor(module: str) -> int:
    matches = [p for p in RANK if module == p or module.startswith(p + ".")]
    if not matches:
        raise AssertionError(f"{module} is in no floor of tests/test_layers.py: add it to FLOORS")
    return RANK[max(matches, key=len)]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every edge0 module `path` imports (absolute or relative, at any depth)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            out.add(base)
            # `from edge0.x import y` may name a module y
            out.update(
                f"{base}.{a.name}"
                for a in node.names
                if (PKG.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                or (PKG.parent / f"{base}.{a.name}".replace(".", "/") / "__init__.py").exists()
            )
    return {m for m in out if m == "edge0" or m.startswith("edge0.")}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) - {module_name(p)} for p in PKG.rglob("*.py")}


def upward(g: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} (floor {FLOORS[floor(m)][0]}) imports {d} (floor {FLOORS[floor(d)][0]})"
        for m, deps in g.items()
        for d in deps
        if floor(d) > floor(m)
    )


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_floor_and_imports_only_downward():
    g = graph()
    assert len(g) > 60 and "edge0.engine.engine" in g  # the walk really sees the package
    assert upward(g) == []


def test_the_package_root_holds_only_shared_modules_and_packages():
    loose = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__" and p.stem not in ROOT)
    assert loose == [], f"modules at the package root that belong in a floor's package: {loose}"
    packages = {f"edge0.{p.parent.name}" for p in PKG.glob("*/__init__.py")}
    assert packages <= set(RANK), f"packages in no floor: {sorted(packages - set(RANK))}"


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    g = {
        "edge0.store.format": {"edge0.engine.engine"},
        "edge0.engine.engine": {"edge0.store.format"},
        "edge0.cache.policy": {"edge0.errors"},
    }
    assert upward(g) == ["edge0.store.format (floor data) imports edge0.engine.engine (floor engine)"]
    assert cycles(g) == [["edge0.engine.engine", "edge0.store.format"]]


def test_relative_imports_resolve(tmp_path, monkeypatch):
    pkg = tmp_path / "edge0" / "shelf"
    pkg.mkdir(parents=True)
    (tmp_path / "edge0" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "box.py").write_text("")
    f = pkg / "reader.py"
    f.write_text("from . import box\nfrom ..errors import Edge0Error\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path / "edge0")
    assert imports(f) == {"edge0.shelf", "edge0.shelf.box", "edge0.errors"}


# -- the decode step has one home -------------------------------------------------------------
STEP_CALLS = ("before_step", "multi_token", "before_forward", "after_forward", "kept", "step_done", "end_step")


def step_protocol_calls(root: Path) -> dict[str, list[str]]:
    """module -> the step-protocol methods it calls on something other than `self.inner` (a hooks
    wrapper passing a call on)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func.value
            passed_on = isinstance(target, ast.Attribute) and target.attr == "inner"
            if node.func.attr in STEP_CALLS and not passed_on:
                found.setdefault(str(path.relative_to(root)), []).append(node.func.attr)
    return found


def test_only_the_stepper_calls_the_step_hooks():
    calls = step_protocol_calls(PKG)
    assert list(calls) == ["engine/step.py"], calls
    assert sorted(set(calls["engine/step.py"])) == sorted(STEP_CALLS)


def test_the_step_check_catches_a_copy(tmp_path):
    (tmp_path / "loop.py").write_text("def run(e, s):\n    e.hooks.before_forward(s)\n    e.streaming.end_step()\n")
    (tmp_path / "wrap.py").write_text("def step_done(self, s):\n    self.inner.step_done(s)\n")
    assert step_protocol_calls(tmp_path) == {"loop.py": ["before_forward", "end_step"]}
