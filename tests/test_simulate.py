"""Simulator, learned-policy training and the budget planner, on synthetic and fixture traces."""

import json

import pytest

from edge0.cache import tracefile
from edge0.cache.learn import train
from edge0.cache.replay import parse_budgets, parse_byte_budgets, simulate
from edge0.errors import Edge0Error
from tests.test_trace import synthetic_trace

ALL = ["lru", "lfu", "arc", "smoe", "flashmoe", "belady"]


@pytest.fixture(scope="module")
def synth():
    return synthetic_trace(layers=2, steps=800, experts=8, k=2)


@pytest.fixture(scope="module")
def synth_file(synth, tmp_path_factory):
    return tracefile.write(tmp_path_factory.mktemp("sim") / "synth.npz", synth)


def test_budget_parsing():
    assert [(b.label, b.capacity) for b in parse_budgets("1/8, 1/4,0.5,3", 16)] == [
        ("1/8", 2),
        ("1/4", 4),
        ("0.5", 8),
        ("3", 3),
    ]
    assert [b.capacity for b in parse_byte_budgets("3MiB,2.5MB", [1 << 20] * 2, 8)] == [1, 1]
    assert parse_byte_budgets("1GiB", [1 << 20] * 2, 8)[0].capacity == 8  # capped at all experts
    for bad in ("x", "0", "2/1", "17"):
        with pytest.raises(Edge0Error, match="--budget"):
            parse_budgets(bad, 16)
    with pytest.raises(Edge0Error, match="holds no expert"):
        parse_byte_budgets("1MiB", [1 << 20] * 2, 8)


def test_belady_bounds_every_policy(synth):
    model, _ = train(synth, [3], rounds=1, epochs=1, max_decisions=2000, log=lambda *_: None)
    budgets = parse_budgets("1,2,3,5", synth.num_experts)
    results = simulate(synth, ALL, budgets, {"flashmoe": {"weights": model}})
    by = {(r.policy, r.budget.capacity): r for r in results}
    for b in budgets:
        best = by[("belady", b.capacity)]
        for p in ALL:
            assert by[(p, b.capacity)].hits <= best.hits, (p, b)
            assert by[(p, b.capacity)].hits + by[(p, b.capacity)].misses == 2 * 800 * 2
        assert best.bytes_read == best.misses * (1 << 20)
    # With 2 slots and top-2 every policy must evict the whole previous route: all agree.
    assert len({by[(p, 2)].hits for p in ALL}) == 1
    assert by[("belady", 5)].hit_rate > by[("lru", 5)].hit_rate


def test_simulate_cli_table_and_json(synth_file, capsys):
    from edge0.cli.simulate import main

    assert main(["--trace", str(synth_file), "--budget", "1/4,3/8", "--budget-bytes", "6MiB"]) == 0
    out = capsys.readouterr().out
    assert "| policy | 1/4 (2/8) | 3/8 (3/8) | 6MiB (3/8) |" in out
    for p in ("lru", "lfu", "arc", "smoe", "belady"):
        assert f"| {p} |" in out
    assert main(["--trace", str(synth_file), "--policies", "lru,belady", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["policy"] for r in doc["results"]} == {"lru", "belady"} and doc["steps"] == 800
    with pytest.raises(Edge0Error, match="needs --cache-weights"):
        main(["--trace", str(synth_file), "--policies", "flashmoe"])
    with pytest.raises(Edge0Error, match="unknown"):
        main(["--trace", str(synth_file), "--policies", "mru"])


def test_train_cache_policy_cli(synth_file, tmp_path, capsys):
    from edge0.cache.flashmoe import load_model
    from edge0.cli.simulate import main as simulate_main
    from edge0.cli.train_cache_policy import main

    out = tmp_path / "policy.safetensors"
    assert (
        main(
            [
                "--trace",
                str(synth_file),
                "--out",
                str(out),
                "--budget",
                "3,5",
                "--epochs",
                "1",
                "--rounds",
                "2",
                "--max-decisions",
                "1500",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "| flashmoe |" in text and "| belady |" in text and "held-out" in text
    model = load_model(str(out))
    meta = model.metadata
    assert json.loads(meta["budgets"]) == {"3": 3, "5": 5}
    assert json.loads(meta["training"])["held_out_steps"] == 160
    assert set(json.loads(meta["held_out_hit_rates"])) >= {"lru@3", "belady@5", "flashmoe@3"}
    assert len(json.loads(meta["trace_sha256"])) == 64
    assert simulate_main(["--trace", str(synth_file), "--budget", "3", "--cache-weights", str(out)]) == 0
    assert "| flashmoe |" in capsys.readouterr().out
    with pytest.raises(Edge0Error, match="--holdout"):
        main(["--trace", str(synth_file), "--out", str(out), "--holdout", "1.5"])


def test_plan_on_fixture_store(store_for, tmp_path, capsys):
    from edge0.cli.plan import main

    data = tmp_path / "text.txt"
    data.write_text("a few words about lists, files and modules. " * 40)
    report = tmp_path / "plan.json"
    assert (
        main(
            [
                "--model",
                str(store_for("qwen3_moe")),
                "--data",
                str(data),
                "--prompts",
                "2",
                "--prompt-tokens",
                "24",
                "--max-tokens",
                "4",
                "--budget",
                "1/4,1/2,1/1",
                "--json",
                str(report),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| 1/4 | 2 |" in out and "recommended:" in out
    doc = json.loads(report.read_text())
    assert [r["experts_per_layer"] for r in doc["predictions"]] == [2, 4, 8]
    speeds = [r["tok_s"] for r in doc["predictions"]]
    assert speeds == sorted(speeds)  # fewer misses never predict slower decoding
    m = doc["measured"]
    assert m["large_cache"]["step_s"] > 0 and m["topk_slots"]["bytes_per_token"] > m["large_cache"]["bytes_per_token"]


def test_simulated_substitution_saves_reads(synth, synth_file, capsys):
    from edge0.cli.simulate import main

    budgets = parse_budgets("3,5", synth.num_experts)
    base = {r.budget.capacity: r for r in simulate(synth, ["lru"], budgets)}
    same = {r.budget.capacity: r for r in simulate(synth, ["lru"], budgets, alpha=0.0)}
    subst = {r.budget.capacity: r for r in simulate(synth, ["lru"], budgets, alpha=0.3)}
    for c in (3, 5):
        assert (same[c].hits, same[c].misses, same[c].substitutions) == (base[c].hits, base[c].misses, 0)
        assert subst[c].substitutions > 0 and subst[c].bytes_read < base[c].bytes_read
    assert main(["--trace", str(synth_file), "--budget", "3", "--substitute-alpha", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "CHANGES OUTPUTS" in out and "| belady |" not in out


def test_simulate_on_synthetic_routes(capsys):
    from edge0.cli.simulate import main

    assert (
        main(
            [
                "--routing",
                "qwen3-like",
                "--layers",
                "2",
                "--steps",
                "600",
                "--budget",
                "1/4",
                "--policies",
                "lru,belady",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    rates = {r["policy"]: r["hit_rate"] for r in out["results"]}
    assert out["steps"] == 600 and 0.74 < rates["lru"] < 0.88 and rates["belady"] > rates["lru"]
