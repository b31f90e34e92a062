"""Only edge0/backend/ may import mlx, mlx_lm or mlx_vlm."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "edge0"


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_only_backend_imports_mlx():
    offenders = []
    files = [p for p in PKG.rglob("*.py") if "backend" not in p.relative_to(PKG).parts]
    assert len(files) > 10  # the walk really sees the package
    for path in files:
        for name in _imports(path):
            if name.split(".")[0] in ("mlx", "mlx_lm", "mlx_vlm"):
                offenders.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert offenders == []


def test_boundary_check_catches_an_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom mlx_lm.models import cache\n")
    assert "mlx_lm.models" in list(_imports(bad))


def test_the_command_line_and_its_help_do_not_import_mlx_lm():
    """`edge0 --help`, a usage error and the option tables import no model code: mlx-lm brings
    transformers (1.8 s of `edge0 --help` before the engine package was made lazy)."""
    import subprocess
    import sys

    probe = (
        "import sys, edge0.cli, edge0.options; print(sorted(m for m in ('mlx_lm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
    out = subprocess.run(
        [sys.executable, "-c", "import edge0.engine, sys; edge0.engine.Engine; print('mlx_lm' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "True"  # the engine is still there when asked for
