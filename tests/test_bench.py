"""`edge0 bench` smoke test: the whole suite on a tiny bench model, JSON schema and numbers.

Performance is not tested here (see docs/bench-suite.md); this checks that every arm runs in its
own process, that the JSON has the documented shape, that every reported number is positive and
finite, that greedy tokens match mlx-lm resident in every edge0 arm, and the trace output."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from edge0.bench import METRICS, SCHEMA, all_arms
from edge0.bench.cgroup import read_limit_refusal
from edge0.cli.bench import main
from edge0.errors import Edge0Error

ROOT = Path(__file__).resolve().parents[1]
# Rates and stalls can be exactly 0 on a tiny model (e.g. no hit in a few steps); all else > 0.
MAY_BE_ZERO = {
    "hit_rate",
    "stall_ms_per_step",
    "host_syncs_per_step",
    "prefill_stall_ms",
    "lookahead_wasted_bytes",
    "early_experts_per_step",  # a tiny model's predictions may agree too rarely to compute early
    "early_unused_per_step",
}


def _maker():
    spec = importlib.util.spec_from_file_location("make_bench_model", ROOT / "scripts" / "make_bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tiny"
    with contextlib.redirect_stderr(io.StringIO()):
        _maker().make_bench_model(out, "tiny", quiet=True)
    return out


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_bench_model_is_deterministic(tiny_model, tmp_path):
    with contextlib.redirect_stderr(io.StringIO()):
        again = _maker().make_bench_model(tmp_path / "again", "tiny", store=False, quiet=True)
    assert _digest(again / "mlx") == _digest(tiny_model / "mlx")
    meta = json.loads((tiny_model / "bench-model.json").read_text())
    assert meta["expert_bytes"] > 0 and meta["shape"]["experts"] == 16
    assert (tiny_model / "store" / "edge0-manifest.json").is_file()
    assert not list(tmp_path.glob(".*partial*"))  # atomic: nothing left behind


def _check_numbers(name: str, metrics: dict) -> None:
    assert set(metrics) == set(METRICS), name
    for k, v in metrics.items():
        if v is None:
            continue
        assert isinstance(v, (int, float)) and not isinstance(v, bool), (name, k, v)
        assert math.isfinite(v), (name, k, v)
        assert v > 0 or (k in MAY_BE_ZERO and v == 0), (name, k, v)


RATE = 400 * 10**6  # a read limit far above what 5 tokens of the tiny model read: it must not change them
# each runtime and the exact and staged executors warm, staged cold, staged capped and the
# pre-router arms (skipped at once: the tiny model has no heads); one arm costs ~1.5 s of the suite,
# the others run the same paths with another executor or storage
LEFT_OUT = {"exact-cold", "hot-cold", "exact-capped", "hot-capped", "hot-warm", "mlx-lm-capped"}
ARMS = [a.name for a in all_arms() if a.name not in LEFT_OUT]


def test_quick_suite_json(tiny_model, tmp_path):
    out, trace, docs = tmp_path / "bench.json", tmp_path / "trace.json", tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    # the capped arms run inside a read limit where this machine allows one (else the flag is refused)
    limited = not read_limit_refusal(tiny_model / "store", RATE)
    with contextlib.redirect_stdout(io.StringIO()) as table, contextlib.redirect_stderr(io.StringIO()):
        assert (
            main(
                [
                    "--model",
                    str(tiny_model),
                    "--prompt-tokens",
                    "36",
                    "--decode-tokens",
                    "5",
                    "--out",
                    str(out),
                    "--trace-arm",
                    "staged-cold",
                    "--trace-out",
                    str(trace),
                    "--append-docs",
                    str(docs),
                    *(["--read-limit", "400MB/s"] if limited else []),
                    "--arms",
                    ",".join(ARMS),
                ]
            )
            == 0
        )
    r = json.loads(out.read_text())
    assert r["schema"] == SCHEMA
    for key in ("date", "command", "machine", "git", "packages", "model", "settings", "arms", "summary"):
        assert key in r, key
    assert r["command"].startswith("edge0 bench --model")
    assert r["packages"]["mlx"] and r["packages"]["mlx-lm"] and r["machine"]["cpus"] >= 1
    assert r["settings"]["decode_tokens"] == 5 and r["settings"]["greedy"] is True
    assert [a["name"] for a in r["arms"]] == ARMS

    by = {a["name"]: a for a in r["arms"]}
    for name in ("mlx-lm-resident", "exact-warm", "staged-warm", "staged-cold"):
        a = by[name]
        assert a["status"] == "ok", (name, a["reason"])
        _check_numbers(name, a["metrics"])
        m = a["metrics"]
        for k in ("decode_tps", "prefill_tps", "ttft_s", "mlx_peak_bytes", "peak_rss_bytes"):
            assert m[k] is not None, (name, k)
        assert m["generation_tokens"] == 5 and m["prompt_tokens"] == 36
        if a["runtime"] == "edge0":
            assert m["expert_bytes_read"] > 0
            assert a["tokens_match_resident"] is True, name  # greedy, same weights, same dtype
            assert a["prompt_digest"] == by["mlx-lm-resident"]["prompt_digest"]
    for name in ("prerouter-warm", "prerouter-cold"):  # the tiny model has no heads
        assert by[name]["status"] == "skipped" and "pre-router" in by[name]["reason"]
    for name in ("staged-capped",):
        a = by[name]
        assert a["status"] in ("ok", "killed", "skipped", "failed") and (a["status"] == "ok" or a["reason"])
        if a["status"] == "ok":
            _check_numbers(name, a["metrics"])
    cap = r["settings"]["memory_cap"]
    assert (cap["cap_bytes"] or 0) > 0 or cap["skipped"]
    rl = r["settings"]["read_limit"]
    assert rl["rate_bytes_per_s"] == (RATE if limited else None)
    if limited:
        assert rl["arms"] == "capped" and rl["device"] and rl["cgroup_version"] in (1, 2)
        for name in (n for n, a in by.items() if a["storage"] == "capped" and a["status"] == "ok"):
            # capped arms start evicted: every store byte they use comes through the limited disk
            assert by[name]["read_limit"]["device_bytes_read"] > 0, name
            assert f"| {name} | capped, 400 MB/s |" in table.getvalue()
        assert "Read limit: 400 MB/s on the store's disk" in table.getvalue()

    device, warm = r["device_read"], r["page_cache_read"]
    assert device["bytes_per_s"] > 0 and device["bytes"] > 0 and device["queue_depth"] >= 1
    assert warm["warm"] and warm["bytes_per_s"] > 0
    assert by["staged-warm"]["roofline"]["read_rate"] == warm["bytes_per_s"]
    assert by["staged-cold"]["roofline"]["read_rate"] == device["bytes_per_s"]
    resident = by["mlx-lm-resident"]["metrics"]["decode_tps"]
    for name in ("exact-warm", "staged-warm", "staged-cold"):
        roof, m = by[name]["roofline"], by[name]["metrics"]
        assert roof["bytes_per_token"] == pytest.approx(m["decode_expert_bytes_read"] / 4)  # 5 tokens, 4 steps
        assert roof["roofline_tps"] <= resident and roof["efficiency"] == pytest.approx(
            m["decode_tps"] / roof["roofline_tps"]
        )
        assert f"| {name} | " in table.getvalue().split("Roofline:")[1]
    assert by["mlx-lm-resident"]["roofline"] is None

    steps = json.loads(trace.read_text())["steps"]
    assert len(steps) == 5 and steps[0]["phase"] == "prefill+first"
    for s in steps:
        assert s["wall_ms"] > 0 and s["compute_ms"] >= 0 and s["stall_ms"] >= 0 and s["bytes_read"] >= 0
        assert len(s["layer_stall_ms"]) == 2
    assert "| staged-warm | warm |" in table.getvalue()
    assert "## Bench suite" in docs.read_text() and "| mlx-lm-resident |" in docs.read_text()


@pytest.mark.slow  # 21 s of child processes; the quick suite's JSON (above) runs by default
def test_prompt_curve(tiny_model, tmp_path):
    """--prompt-lengths: one row per length and arm, the prefill's reads as a multiple of the store
    (a layer-major prefill reads each layer's experts at most once per span), the same tokens."""
    out = tmp_path / "curve.json"
    with contextlib.redirect_stdout(io.StringIO()) as table, contextlib.redirect_stderr(io.StringIO()):
        assert main(["--model", str(tiny_model), "--prompt-lengths", "40", "--no-cap", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    (point,) = r["prompt_curve"]
    assert point["prompt_tokens"] == 40 and point["settings"]["decode_tokens"] == 2
    by = {a["name"]: a for a in point["arms"]}
    assert set(by) == {"mlx-lm-resident", "staged-warm", "staged-warm-server", "staged-capped"}
    assert by["staged-capped"]["status"] == "skipped" and "--no-cap" in by["staged-capped"]["reason"]
    experts = point["settings"]["expert_bytes"]
    for name in ("staged-warm", "staged-warm-server"):
        a = by[name]
        assert a["status"] == "ok" and a["tokens_match_resident"] is True, (name, a["reason"])
        _check_numbers(name, a["metrics"])
        assert 0 < a["metrics"]["prefill_expert_bytes_read"] <= experts  # one span: the store once at most
    assert "| 40 | staged-warm-server |" in table.getvalue()
    assert not list(tmp_path.glob(".*tmp*"))  # the JSON was written whole


@pytest.mark.slow  # 22 s: two servers and the batch children
def test_concurrency_table_and_servers_side_by_side(tiny_model, tmp_path):
    """--concurrency: per B, the batch against one after another with the same tokens, its ceiling
    from a B-token step's measured cost, reads per token and the union; then edge0 serve and
    mlx_lm.server at the same concurrency with the same texts."""
    out = tmp_path / "conc.json"
    argv = ["--model", str(tiny_model), "--concurrency", "1,2", "--no-cap", "--decode-tokens", "4", "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()) as table, contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    r = json.loads(out.read_text())
    (warm,) = r["concurrency"]
    assert warm["setting"] == "warm" and warm["status"] == "ok", warm.get("reason")
    assert r["settings"]["skipped"] == {"capped": "--no-cap"}
    one, two = warm["rows"]
    assert (one["batch"], two["batch"]) == (1, 2) and one["tokens_identical"] and two["tokens_identical"]
    assert one["step_cost"] == 1.0 and two["step_cost"] > 0
    for row in (one, two):
        assert row["speedup"] == pytest.approx(row["batch_decode_tps"] / row["serial_decode_tps"])
        assert row["of_ceiling"] == pytest.approx(row["speedup"] * row["step_cost"] / row["batch"])
        assert row["serial_bytes_per_token"] > 0 and row["batch_bytes_per_token"] >= 0
    assert 0 < two["union_per_routed"] <= 1 and one["union_per_routed"] is None
    servers = r["servers"]
    assert [row["concurrency"] for row in servers["rows"]] == [1, 2] and servers["texts_identical"] == [True, True]
    for row in servers["rows"]:
        assert row["edge0"]["generated_tokens"] == row["mlx-lm"]["generated_tokens"] == 4 * row["concurrency"]
    assert servers["edge0"]["batching"]["max_batch"] == 2  # --max-batch set to the widest B
    assert "| warm | 2 |" in table.getvalue() and "| 2 |" in table.getvalue().split("mlx_lm.server")[1]


def test_a_killed_child_keeps_what_it_reported_before():
    """--concurrency's child reports its rows after each B: killed later (the memory cap's OOM
    killer), the rows measured before stay in the result, beside the reason."""
    from edge0.bench.runner import run_child

    out = run_child({"rows": [{"batch": 1}]}, 60, module="tests.dying_child")
    assert out["status"] == "killed" and "SIGKILL" in out["reason"]
    assert out["partial"] == {"status": "partial", "rows": [{"batch": 1}]}


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--arms", "nosuch"], "--arms"),
        (["--trace-arm", "staged-warm"], "--trace-arm"),
        (["--decode-tokens", "1"], "--decode-tokens"),
        (["--prompt-lengths", "512,x"], "--prompt-lengths"),
        (["--prompt-lengths", "512", "--arms", "staged-warm"], "--prompt-lengths"),
        (["--expert-cache", "150%", "--arms", "staged-warm", "--no-plot"], "--expert-cache"),
        (["--concurrency", "0,2"], "--concurrency"),
        (["--concurrency", "two"], "--concurrency"),
        (["--concurrency", "2", "--arms", "staged-warm"], "--concurrency runs its own settings"),
        (["--long-prompt", "512"], "go with --concurrency"),
    ],
)
def test_usage_errors(tiny_model, tmp_path, argv, field):
    with pytest.raises(Edge0Error, match=field):
        main(["--model", str(tiny_model), "--out", str(tmp_path / "b.json"), *argv])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--read-limit", "fast"], "--read-limit 'fast': not a rate"),
        (["--read-limit", "100KB/s"], "at least 1MB/s"),
        (["--read-limit", "200MB/s", "--no-cap"], "--no-cap"),
        (["--read-limit", "200MB/s", "--arms", "staged-warm"], "selects none"),
        (["--pace-reads", "20MB/s"], "--pace-reads go with --concurrency"),
        (["--concurrency", "1", "--pace-reads", "slow"], "--pace-reads 'slow': not a rate"),
        (["--concurrency", "1", "--pace-reads", "20MB/s", "--no-cap"], "--pace-reads adds a capped setting"),
    ],
)
def test_read_limit_usage_errors(tiny_model, tmp_path, argv, needle):
    with pytest.raises(Edge0Error, match=re.escape(needle)):
        main(["--model", str(tiny_model), "--out", str(tmp_path / "b.json"), *argv])


def test_read_limit_refused_in_one_line_where_reads_cannot_be_limited(tiny_model, tmp_path):
    """A store on a file system with no disk (tmpfs) cannot be throttled: refused before any arm runs."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm (tmpfs) here")
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        shutil.copytree(tiny_model / "store", shm / "store")
        with pytest.raises(Edge0Error) as e:
            main(["--model", str(shm / "store"), "--out", str(tmp_path / "b.json"), "--read-limit", "200MB/s"])
        msg = str(e.value)
        assert msg.startswith("--read-limit 200MB/s: cannot limit reads here: ") and "\n" not in msg
        assert not (tmp_path / "b.json").exists()
    finally:
        shutil.rmtree(shm)


def test_not_a_model(tmp_path):
    with pytest.raises(Edge0Error, match="--model"):
        main(["--model", str(tmp_path), "--out", str(tmp_path / "b.json")])


def test_the_roofline_is_the_slower_of_compute_and_reads():
    """Hand-set numbers: 10 MB read per token at 100 MB/s is 10 tok/s of reads; resident 25 tok/s."""
    from edge0.bench.roofline import arm_roofline

    arm = {
        "status": "ok",
        "runtime": "edge0",
        "metrics": {"decode_tps": 8.0, "decode_expert_bytes_read": 40e6, "generation_tokens": 5},
    }
    r = arm_roofline(arm, 25.0, 100e6)
    assert r["bytes_per_token"] == 10e6 and r["roofline_tps"] == 10.0 and r["bound"] == "reads"
    assert r["efficiency"] == 0.8 and r["achieved_read_rate"] == 80e6
    fast = arm_roofline(arm, 25.0, 1e9)  # 100 tok/s of reads: compute bounds it
    assert fast["roofline_tps"] == 25.0 and fast["bound"] == "compute" and fast["efficiency"] == 8 / 25
    assert arm_roofline({**arm, "runtime": "mlx-lm"}, 25.0, 100e6) is None
    assert r["wasted_per_token"] == 0 and r["lookahead_recall"] is None  # no lookahead figures: nothing read ahead
    ahead = {**arm, "metrics": {**arm["metrics"], "lookahead_recall": 0.9, "lookahead_wasted_bytes": 4e6}}
    assert arm_roofline(ahead, 25.0, 100e6)["wasted_per_token"] == 1e6  # 4 MB over 4 decode steps
    assert r["early_per_step"] is None
    early = {**arm, "metrics": {**arm["metrics"], "early_experts_per_step": 90.5, "early_unused_per_step": 0.25}}
    assert (
        arm_roofline(early, 25.0, 100e6)["early_per_step"],
        arm_roofline(early, 25.0, 100e6)["early_unused_per_step"],
    ) == (90.5, 0.25)


def test_warm_arms_are_judged_at_the_page_cache_rate_cold_ones_at_the_disk_capped_ones_at_the_limit():
    from edge0.bench.roofline import add_rooflines

    metrics = {"decode_tps": 8.0, "decode_expert_bytes_read": 40e6, "generation_tokens": 5}  # 10 MB a token
    arms = [
        {"name": n, "storage": n.split("-")[1], "status": "ok", "runtime": "edge0", "metrics": metrics}
        for n in ("staged-warm", "staged-cold", "staged-capped")
    ]
    arms.append(
        {
            "name": "mlx-lm-resident",
            "storage": "warm",
            "status": "ok",
            "runtime": "mlx-lm",
            "metrics": {"decode_tps": 25.0},
        }
    )
    result = {"arms": arms, "settings": {"read_limit": {"rate_bytes_per_s": 50e6}}}
    add_rooflines(result, 100e6, 2e9)
    by = {a["name"]: a["roofline"] for a in arms}
    assert [by[n]["read_rate"] for n in ("staged-warm", "staged-cold", "staged-capped")] == [2e9, 100e6, 50e6]
    # the page cache copies 200 tok/s of reads: compute bounds the warm arm, below an efficiency of 1
    assert by["staged-warm"]["roofline_tps"] == 25.0 and by["staged-warm"]["efficiency"] == 8 / 25
    assert by["staged-cold"]["roofline_tps"] == 10.0 and by["staged-capped"]["roofline_tps"] == 5.0
    assert by["mlx-lm-resident"] is None


def test_the_disk_rate_is_measured_over_the_stores_expert_rows(tiny_model):
    from edge0.bench.roofline import measure_read_rate
    from edge0.store.format import MANIFEST

    read = measure_read_rate(tiny_model / "store", queue_depth=2, seconds=5)
    assert read["bytes_per_s"] > 0 and read["queue_depth"] == 2
    # each expert row read at most once: within 5 s the tiny store is read whole, row by row
    layers = json.loads((tiny_model / "store" / MANIFEST).read_text())["expert_layers"]
    assert read["bytes"] == sum(e["num_experts"] * e["expert_stride"] for e in layers) or read["seconds"] >= 5
    warm = measure_read_rate(tiny_model / "store", queue_depth=2, seconds=5, warm=True)
    assert warm["warm"] and not warm["page_cache_dropped"] and warm["bytes"] == read["bytes"]


def test_decode_against_resident_repeat_by_repeat():
    """Hand-set runs: each repeat's edge0 run over the resident run of the same repeat, None where a
    run failed; the summary's headline ratio stays that of the medians."""
    from edge0.bench.report import _repeat_lines, by_repeat, summary

    def arm(name, runtime, tps):
        runs = [{"status": "ok", "decode_tps": t} if t else {"status": "failed"} for t in tps]
        ok = [t for t in tps if t]
        return {
            "name": name,
            "runtime": runtime,
            "status": "ok",
            "metrics": {"decode_tps": sorted(ok)[len(ok) // 2]},
            "runs": runs,
        }

    result = {
        "arms": [
            arm("mlx-lm-resident", "mlx-lm", [3.0, 2.0, 4.0]),
            arm("staged-warm", "edge0", [2.7, 2.0, None]),
            arm("exact-warm", "edge0", [1.5, 1.0, 2.0]),
        ]
    }
    assert by_repeat(result) == {
        "staged-warm": [pytest.approx(0.9), 1.0, None],
        "exact-warm": [0.5, 0.5, 0.5],
    }
    sm = summary(result)
    assert sm["decode_vs_resident_by_repeat"]["exact-warm"] == [0.5, 0.5, 0.5]
    assert sm["staged_warm_vs_resident_decode"] == pytest.approx(2.7 / 3.0)
    assert _repeat_lines(result)[1] == (
        "Decode against resident mlx-lm in the same repeat (the arms interleaved): "
        "staged-warm 0.90x, 1.00x, -; exact-warm 0.50x, 0.50x, 0.50x."
    )
    one = {"arms": [arm("mlx-lm-resident", "mlx-lm", [3.0]), arm("staged-warm", "edge0", [2.7])]}
    assert _repeat_lines(one) == [] and by_repeat(one) == {"staged-warm": [pytest.approx(0.9)]}
    assert by_repeat({"arms": [arm("staged-warm", "edge0", [2.7])]}) == {}
