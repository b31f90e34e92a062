"""Shared fixtures: tiny checkpoints (built once per session) converted into edge0 stores."""

import contextlib
import hashlib
import io
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import httpx._transports.default
import pytest

from tests.fixtures.make import fixture_dir, reference_dir

STORE_CODE = Path(__file__).resolve().parents[1] / "edge0" / "store"

# httpx builds a new SSL context for every top-level httpx.get/post (loading certifi's CA bundle:
# 62 ms on the CI VM, 18 of the hostile battery's 25 s); the tests speak plain HTTP to loopback,
# so one default context serves them all.
_SHARED_SSL = httpx.create_ssl_context()
_create_ssl_context = httpx._transports.default.create_ssl_context


def _shared_ssl_context(verify=True, cert=None, trust_env=True):
    if verify is True and cert is None and trust_env:
        return _SHARED_SSL
    return _create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)


httpx._transports.default.create_ssl_context = _shared_ssl_context


def pytest_configure(config):
    """One fixture cache for the whole run: the xdist workers (spawned after this, with this
    environment) share the checkpoints and mlx-lm references they build, instead of each building
    its own (fixture directories are written atomically, so concurrent builders do not clash)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("EDGE0_FIXTURE_CACHE"):
        return
    config._edge0_fixture_cache = tempfile.mkdtemp(prefix="edge0-fixtures-")
    os.environ["EDGE0_FIXTURE_CACHE"] = config._edge0_fixture_cache


# The longest test files first (15-45 s each on the CI VM, measured with --durations), so the two
# xdist workers, which take whole files in collection order (--dist loadfile), end together: in
# alphabetical order the measured durations put 237 s of tests on one worker and 271 s on the other.
LONG_FILES = [
    "test_distributed.py",
    "test_token_identity.py",
    "test_bench.py",
    "test_server_clients.py",
    "test_executors.py",
    "test_prerouter.py",
    "test_server_ui.py",
    "test_errors.py",
    "test_server_limits.py",
    "test_batch.py",
    "test_hardening.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: each file's own order kept


def pytest_unconfigure(config):
    path = getattr(config, "_edge0_fixture_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("EDGE0_FIXTURE_CACHE", None)


@pytest.fixture(scope="session", autouse=True)
def edge0_cache(tmp_path_factory):
    """Keep the bundled model's conversion out of the user's cache during tests."""
    path = tmp_path_factory.mktemp("edge0-cache")
    old = os.environ.get("EDGE0_CACHE")
    os.environ["EDGE0_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("EDGE0_CACHE", None)
    else:
        os.environ["EDGE0_CACHE"] = old


@pytest.fixture(scope="session")
def store_for(tmp_path_factory):
    """store_for(family, source="hf"|"mlx", **fixture_kw) -> an edge0 store directory.

    "hf" converts the HF-layout fixture; "mlx" indexes mlx-lm's own `convert -q` output of it."""
    from edge0.store.convert import convert

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


# hidden 512 so each expert is ~0.44 MB in int4; 128 experts x 2 layers ~ 108 MiB of experts,
# 162x the other weights.
BIG = {
    "hidden_size": 512,
    "moe_intermediate_size": 512,
    "num_experts": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "dtype": "bfloat16",
}


@pytest.fixture(scope="session")
def big_store():
    """A store whose routed experts are far larger than its other weights (and than test budgets);
    built once for all the workers (8 s on the CI VM). Read-only."""
    from edge0.store.convert import convert
    from tests.fixtures.make import cached_dir, make_memory_fixture, routed_expert_bytes

    def build(root):
        hf, ratio = make_memory_fixture(root / "hf", **BIG)
        routed, other = routed_expert_bytes(hf)
        assert ratio >= 10 and routed >= 10 * other
        convert(str(hf), root / "store", quiet=True)

    # a converted store: a persistent $EDGE0_FIXTURE_CACHE must not serve one an older converter wrote
    converter = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(STORE_CODE.glob("*.py")))).hexdigest()[:12]
    return cached_dir("big-store", "qwen3_moe", build, converter=converter, **BIG) / "store"
