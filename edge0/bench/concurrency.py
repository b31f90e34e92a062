"""`edge0 bench --concurrency B,B,...`: several sequences decoded together against the same
requests one after another, per setting (docs/bench-suite.md#concurrency).

Each setting runs in its own process: warm (the store in the page cache, the expert cache at
--expert-cache), capped (a memory cgroup, the page cache emptied first), with --read-limit
capped with the store's disk reads throttled (a cgroup), and with --pace-reads capped with the
expert reads paced as from a disk of that rate (store/pacing.py: no credit for idle time). For
each B the process generates B different prompts one after another (`generate`), then together
(`generate_batch`), and measures the cost of a B-token step against a 1-token step of one
sequence in the same engine (a verify's forward, the tokens of a true continuation): B / that
cost is the setting's ceiling, what a batch would gain if B rows cost what B tokens of one
sequence cost. Under --routing qwen3-like the B tokens of that step route as the batch's B rows
do (token j as row j's text, after one untimed step), so it reads the union a batch step reads;
one sequence's own B tokens, which share far more experts, give `step_cost_one_sequence`. Per
B: aggregate decode tok/s of both, the speedup, the ceiling and the speedup's share of it,
expert bytes read per generated token both ways, and the batch's union of experts per routed
(token, expert) pair. With --routing qwen3-like row r of a batch (and generation r
one after another) routes as its own text through the same model (bench/routing.py); with
--read-ahead each step's routes (every row's) are staged while the step before computes, as the
pre-router does."""

from __future__ import annotations

import json
import sys
import time

from edge0.bench.child import RESULT_PREFIX, prompts_for
from edge0.bench.report import _f, table_head


def parse_batches(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (an Edge0Error naming --concurrency)."""
    from edge0.errors import Edge0Error

    try:
        batches = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise Edge0Error(f"--concurrency {text!r}: not a list of batch sizes; use e.g. 1,2,4,8") from None
    if not batches or min(batches) < 1 or max(batches) > 64:
        raise Edge0Error(f"--concurrency {text!r}: give batch sizes from 1 to 64, e.g. 1,2,4,8")
    return batches


def measure(spec: dict, report=None) -> dict:
    """The child's measurement (one setting); see the module docstring. `report(rows)` is called
    after each B, so a process killed later (the memory cap) keeps the rows measured before."""
    import edge0
    from edge0.bench.env import storage_bytes_read
    from edge0.bench.speculative import forward_cost

    engine = edge0.load(spec["store"], prerouter=False, lora=False, **spec["load"])
    routes = None
    if spec["routing"] != "uniform":
        from edge0.bench.routing import use_synthetic_routing

        routes = use_synthetic_routing(engine, seed=0, lookahead=spec.get("read_ahead", False))
    batches, n = spec["batches"], spec["decode_tokens"]
    prompts = prompts_for(engine.encode, max(batches), spec["prompt_tokens"])
    # B-token steps are timed over as many steps as the batch decodes (after one untimed step):
    # the few steps after an idle moment ride a read throttle's burst allowance, which the batch's
    # steady state does not get
    steps = max(1, n - 1)
    # the true continuation of the first prompt, long enough for those steps at the widest B
    reference = engine.generate(prompts[0], max_tokens=max(batches) * (steps + 1), ignore_eos=True).tokens
    one_token = forward_cost(engine, prompts[0], reference, 1, max(n, 4 * max(batches)))
    rows = []
    for b in batches:
        serial_s = serial_bytes = 0.0
        serial_tokens = []
        disk0 = storage_bytes_read()
        for i, p in enumerate(prompts[:b]):
            if routes is not None:
                routes.first_text = i  # generation i routes as row i of the batch does
            s = engine.generate(p, max_tokens=n, ignore_eos=True)
            serial_s += (s.stats["generation_tokens"] - 1) / s.stats["decode_tps"]
            serial_bytes += s.stats["expert_bytes_read"] - s.stats["prefill_expert_bytes_read"]
            serial_tokens.append(s.tokens)
        if routes is not None:
            routes.first_text = 0
        disk1 = storage_bytes_read()
        batched = engine.generate_batch(prompts[:b], max_tokens=n, ignore_eos=True)
        disk2 = storage_bytes_read()
        st = batched[0].stats["batch"]
        one_sequence = forward_cost(engine, prompts[0], reference, b, steps) / one_token if b > 1 else 1.0
        cost = one_sequence
        if routes is not None and b > 1:
            # the B tokens route as the batch's B rows do (token j as row j's text), so the step
            # reads what a batch step reads: one sequence's B tokens share far more experts
            cost = forward_cost(engine, prompts[0], reference, b, steps, 1, routes.route_tokens_as_rows) / one_token
        # both count the steps after the first: alone, the step that feeds the prompt's last token
        # (and makes the first token) belongs to the prefill; a batch's first step does that for every row
        serial_tps = b * (n - 1) / serial_s
        batch_tps = b * (n - 1) / (st["decode_s"] - st["first_step_s"])
        speedup = batch_tps / serial_tps
        rows.append(
            {
                "batch": b,
                "serial_decode_tps": serial_tps,
                "batch_decode_tps": batch_tps,
                "per_stream_decode_tps": batch_tps / b,
                "speedup": speedup,
                "step_cost": cost,
                "step_cost_one_sequence": one_sequence,
                "ceiling": b / cost,
                "of_ceiling": speedup / (b / cost),
                "serial_bytes_per_token": serial_bytes / (b * n),
                "batch_bytes_per_token": (st["expert_bytes_read"] - st["prefill_expert_bytes_read"]) / (b * n),
                # prefills included: what reached storage past the page cache, both ways
                "serial_storage_bytes_per_token": None if disk0 is None else (disk1 - disk0) / (b * n),
                "batch_storage_bytes_per_token": None if disk0 is None else (disk2 - disk1) / (b * n),
                "union_per_routed": st["union_per_routed"],
                "tokens_identical": ([r.tokens for r in batched] == serial_tokens) if routes is None else None,
            }
        )
        if report is not None:
            report(rows)
    fallbacks = engine.stats()["totals"].get("fallbacks")
    paced = engine.store.io_stats()["paced"]  # the paced disk's reads, bytes and waits (--pace-reads)
    return {"status": "ok", "rows": rows, "one_token_step_s": one_token, "fallbacks": fallbacks, "paced": paced}


def _row_line(r: dict) -> str:
    return (
        f"{r['serial_decode_tps']:.2f} -> {r['batch_decode_tps']:.2f} tok/s ({r['speedup']:.2f}x, "
        f"ceiling {r['ceiling']:.2f}x), {r['serial_bytes_per_token'] / 1e6:.2f} -> "
        f"{r['batch_bytes_per_token'] / 1e6:.2f} MB read / token"
    )


def run_concurrency(args, model, batches: list[int]) -> dict:
    """Each setting in its own process (warm; capped; capped with --read-limit), then the servers
    side by side (bench/serving.py) unless --no-servers."""
    from edge0.bench.cgroup import MemoryCgroup, read_limited
    from edge0.bench.model import expert_budget, store_sizes
    from edge0.bench.runner import prewarm, run_child
    from edge0.units import parse_size

    sizes = store_sizes(model.store)
    budget = expert_budget(args.expert_cache, sizes)
    files = [str(f) for f in sorted(model.store.rglob("*.safetensors"))]
    parent, reason = MemoryCgroup.available()
    settings = [("warm", None, None, None)]  # (name, memory cap, read throttle, read pacing)
    skipped = {}
    cap = None
    if args.no_cap:
        skipped["capped"] = "--no-cap"
    elif parent is None:
        skipped["capped"] = reason
    else:
        if args.cap:
            cap = parse_size(args.cap, "--cap")
        else:
            base = run_child({"runtime": "baseline", "store": str(model.store)}, args.arm_timeout)
            cap = int(base.get("peak_rss_bytes", 0) + args.cap_fraction * sizes["store_bytes"])
        settings.append(("capped", cap, None, None))
        if args.read_limit is not None:
            settings.append(("capped+read-limit", cap, args.read_limit, None))
        if args.pace_reads is not None:
            settings.append(("capped+paced", cap, None, args.pace_reads))
    out = []
    for name, limit, rate, pace in settings:
        spec = {
            "store": str(model.store),
            "load": {"expert_cache": budget, "dtype": args.dtype, "pace_reads": pace},
            "batches": batches,
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "routing": args.routing,
            "read_ahead": args.read_ahead,
        }
        if limit is None:
            prewarm(files)
        else:
            spec["evict"] = files
        print(f"edge0 bench: --concurrency, {name} ...", flush=True, file=sys.stderr)
        cg = MemoryCgroup.create(parent, limit) if limit is not None else None
        try:
            with read_limited(model.store, rate) as lim:
                t0 = time.perf_counter()
                res = run_child(spec, args.arm_timeout, cg, lim, module=__name__)
                res["wall_s"] = time.perf_counter() - t0
                if lim is not None:
                    res["device_bytes_read"] = lim.bytes_read()
        finally:
            if cg is not None:
                res["cgroup"] = cg.report()
                cg.remove()
        if res.get("status") != "ok" and "partial" in res:  # the rows measured before it stopped
            res["rows"] = res.pop("partial")["rows"]
        res.update(setting=name, cap_bytes=limit, read_limit_bytes_per_s=rate, paced_bytes_per_s=pace)
        out.append(res)
        for r in res.get("rows", []):
            print(f"edge0 bench: {name}, B={r['batch']}: {_row_line(r)}", flush=True, file=sys.stderr)
        if res.get("status") != "ok":
            print(f"edge0 bench: {name}: {res.get('status')}: {res.get('reason')}", flush=True, file=sys.stderr)
    result = {
        "concurrency": out,
        "settings": {
            "batches": batches,
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "expert_cache": args.expert_cache,
            "expert_cache_bytes": budget,
            "routing": args.routing,
            "read_ahead": args.read_ahead,
            "pace_reads": args.pace_reads,
            "skipped": skipped,
            **sizes,
        },
    }
    if not args.no_servers:
        from edge0.bench.serving import serve_side_by_side

        if model.mlx is None:
            result["servers"] = {"skipped": model.mlx_missing_reason}
        else:
            # as many rows as the widest C (two for --long-prompt's pair), then the user's flags
            widest = max(batches + ([2] if args.long_prompt else []))
            flags = [f"--max-batch={widest}", *args.edge0_arg]
            result["servers"] = serve_side_by_side(
                model, batches, args.decode_tokens, args.prompt_tokens, args.long_prompt, flags
            )
    return result


def concurrency_markdown(result: dict) -> str:
    """The tables: per setting and B, then the servers' (when run)."""
    lines = table_head(
        "setting | B | one after another, tok/s | batched, tok/s | per stream | speedup | B-token step cost "
        "| ceiling | of ceiling | MB read / token, one after another | batched | union / routed | same tokens"
    )
    for s in result["concurrency"]:
        for r in s.get("rows", []):
            same = {True: "yes", False: "**no**", None: "-"}[r["tokens_identical"]]
            lines.append(
                f"| {s['setting']} | {r['batch']} | {_f(r['serial_decode_tps'])} | {_f(r['batch_decode_tps'])} "
                f"| {_f(r['per_stream_decode_tps'])} | {_f(r['speedup'], '{:.2f}x')} | {_f(r['step_cost'])} "
                f"| {_f(r['ceiling'], '{:.2f}x')} | {_f(r['of_ceiling'], '{:.2f}')} "
                f"| {_f(r['serial_bytes_per_token'] / 1e6)} | {_f(r['batch_bytes_per_token'] / 1e6)} "
                f"| {_f(r['union_per_routed'])} | {same} |"
            )
        if s.get("status") != "ok":  # after the rows it measured, if any
            lines.append(f"| {s['setting']} | {s.get('status')}: {s.get('reason')} |" + " |" * 11)
    skipped = result["settings"].get("skipped") or {}
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} |" + " |" * 11)
    if result["settings"].get("read_ahead"):
        lines.append("\nEach step's routes (every row's) staged while the step before computed (`--read-ahead`).")
    servers = result.get("servers")
    if servers and "rows" in servers:
        from edge0.bench.serving import servers_markdown

        lines += ["", servers_markdown(servers)]
        cache, experts = servers["edge0"].get("expert_cache_bytes"), result["settings"]["expert_bytes"]
        if cache is not None:
            lines.append(
                f"\nedge0 serve's expert cache: {cache / 1e6:.0f} MB for {experts / 1e6:.0f} MB of experts"
                + (" (every expert fits: resident-equivalent)." if cache >= experts else ".")
            )
    elif servers:
        lines += ["", f"Servers side by side: skipped ({servers['skipped']})."]
    return "\n".join(lines)


def main(argv=None) -> int:
    """One setting in its own process (`python -m edge0.bench.concurrency '<json spec>'`): the page
    cache emptied first when the spec says so, the result printed as one RESULT_PREFIX line."""
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    if spec.get("evict"):
        from edge0.store.pagecache import evict

        evict(spec["evict"])

    def report(rows):
        print(RESULT_PREFIX + json.dumps({"status": "partial", "rows": rows}), flush=True)

    out = measure(spec, report)
    from edge0.backend.core import peak_rss  # imported with mlx by now

    out["peak_rss_bytes"] = peak_rss()
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
