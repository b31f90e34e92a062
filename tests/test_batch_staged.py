"""The staged executor in a batch (edge0/streaming/staged.py): a stage of every row's routes whose
union outgrows the slots, a row left alone after such a stage, and a prefill token between a
stage and its swap; each (row, k) must compute with exactly its routed expert's weights."""

from __future__ import annotations

import numpy as np

import edge0


def staged_layer(store_for):
    """An engine whose staged executors have 2 slots a layer (K = 2), and its first layer's executor."""
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False, expert_cache="31KB", decode_executor="staged")
    layer, ex = sorted(engine.streaming.staged().items())[0]
    assert (ex.slots.n_slots, engine.k) == (2, 2)
    return engine, layer, ex


def each_pair_computes_its_expert(engine, layer, ex, rows: np.ndarray) -> bool:
    """A call of `ex` on routes `rows` [B, K] (one token each): is every (row, k) computed by exactly
    one part, with exactly its routed expert's weights (from the slots, a read ahead or a read now)?"""
    from edge0.backend import core as B
    from edge0.streaming.exact import to_device

    owner = {}  # flat (row, k) -> (params, row in them)
    for part in ex(B.array(rows[:, None, :].astype(np.uint32))):
        params, local, *pairs = part() if callable(part) else part
        local = B.to_numpy(local).reshape(-1)
        for i, p in enumerate(pairs[0] if pairs else range(rows.size)):
            if pairs or local[i] != ex.slots.zero:  # a whole part's zero row: another part's pair
                assert int(p) not in owner
                owner[int(p)] = (params, int(local[i]))
    assert sorted(owner) == list(range(rows.size))
    for p, e in enumerate(rows.reshape(-1)):
        params, row = owner[p]
        want = to_device(engine.store.read(layer, [int(e)]), 1, engine.compute_dtype)
        for proj, parts in want.items():
            for part, a in parts.items():
                if not np.array_equal(B.to_numpy(params[proj][part][row]), B.to_numpy(a[0])):
                    return False
    return True


def test_a_staged_union_beyond_the_slots_is_read_ahead_and_each_row_computes_its_own_experts(store_for):
    """A batch's staged routes (the pre-router's, for every row) whose union outgrows the slots:
    the cached experts stay, misses fill the slots, the rest is read ahead too; the step's call
    then maps every (row, k) to exactly its routed expert's weights, from slots or the read ahead."""
    engine, layer, ex = staged_layer(store_for)
    rows = np.array([[0, 1], [2, 3], [4, 5]])  # B = 3 rows x K = 2: six experts for two slots
    ex.stage(rows)
    ex.swap()
    assert each_pair_computes_its_expert(engine, layer, ex, rows)
    s = ex.stats
    assert s.beyond_ahead == s.beyond_ahead_used == 4  # all of the rest came from the read ahead
    assert s.loads == 6  # each expert of the union read once


def test_a_row_left_alone_after_a_batch_stage_routes_on_the_host(store_for):
    """The stage was two rows' union (the last row's experts in the slots, the first's read ahead
    beyond them); the other row left, so the step has one row: it must not trust the slots."""
    engine, layer, ex = staged_layer(store_for)
    ex.stage(np.array([[0, 1], [2, 3]]))
    ex.swap()
    assert each_pair_computes_its_expert(engine, layer, ex, np.array([[0, 1]]))
    assert ex.stats.dropped == 0 and ex.stats.beyond_ahead_used == 2


def test_a_prefill_token_between_a_stage_and_its_swap_leaves_the_slots_alone(store_for):
    """A sequence joining a batch may prefill a one-token span (chunk by chunk) after a step staged
    the next one: that call reads its own experts, and the staged slots are what the step gets."""
    engine, layer, ex = staged_layer(store_for)
    rows = np.array([[0, 1], [2, 3]])
    ex.stage(rows)  # experts 2 and 3 planned into the slots, written at the swap
    assert each_pair_computes_its_expert(engine, layer, ex, np.array([[2, 4]]))
    ex.swap()
    assert each_pair_computes_its_expert(engine, layer, ex, rows)


def test_a_batch_overflow_keeps_the_experts_its_rows_routed_lately(store_for):
    """Two steps of one row route experts 0 and 1 into the two slots; a batch step of four new
    experts, each routed once, reads them for that step only and leaves 0 and 1 cached (filling
    the slots with two of them would evict the experts the last steps used most)."""
    engine, layer, ex = staged_layer(store_for)
    for _ in range(2):
        assert each_pair_computes_its_expert(engine, layer, ex, np.array([[0, 1]]))
    rows = np.array([[2, 3], [4, 5]])
    assert each_pair_computes_its_expert(engine, layer, ex, rows)
    assert sorted(ex.slots.slot_of) == [0, 1]
    assert ex.stats.loads == 6 and ex.stats.fallbacks == 1  # 0 and 1 once, then the four for the step


def test_a_calls_read_takes_the_read_aheads_rows_and_reads_only_the_rest():
    """A read ahead of 7 and 3 (a batch's union beyond the slots), a call of 3 and 5: 5 alone is
    read now, the bytes come back in the call's order, and 3 counts as used."""
    from concurrent.futures import Future

    from edge0.streaming.parts import ReadAhead, read_call
    from edge0.streaming.stats import LayerStats

    class Store:
        def read(self, layer, ids):
            self.asked = [int(e) for e in ids]
            return {"w": (np.array([[e, e] for e in ids], dtype=np.uint8), "U8", (2,))}

    store, ahead = Store(), Future()
    ahead.set_result({"w": (np.array([[7, 7], [3, 3]], dtype=np.uint8), "U8", (2,))})
    got = read_call(store, 0, [3, 5], ReadAhead(np.array([7, 3]), ahead))
    assert store.asked == [5]
    assert got.bytes_of([3, 5])["w"][0].tolist() == [[3, 3], [5, 5]]
    stats = LayerStats()
    got.count(stats, [3, 5])
    assert (stats.loads, stats.bytes_read, stats.beyond_ahead_used) == (3, 6, 1)
    assert (stats.lookahead_used, stats.lookahead_wasted_bytes) == (0, 0)
