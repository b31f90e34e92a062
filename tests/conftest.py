"""Shared fixtures: tiny checkpoints (built once per session) converted into edge0 stores."""

import contextlib
import io

import pytest

from tests.fixtures.make import fixture_dir, reference_dir


@pytest.fixture(scope="session")
def store_for(tmp_path_factory):
    """store_for(family, source="hf"|"mlx", **fixture_kw) -> an edge0 store directory.

    "hf" converts the HF-layout fixture; "mlx" indexes mlx-lm's own `convert -q` output of it."""
    from edge0.convert import convert

    built = {}

    def make(family, source="hf", **kw):
        key = (family, source, tuple(sorted(kw.items())))
        if key not in built:
            src = fixture_dir(family, **kw) if source == "hf" else reference_dir(family, **kw)
            out = tmp_path_factory.mktemp("stores") / f"{family}-{source}"
            with contextlib.redirect_stderr(io.StringIO()):
                built[key] = convert(str(src), out, quiet=True)
        return built[key]

    return make
