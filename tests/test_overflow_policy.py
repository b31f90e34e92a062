"""The staged executor's overflow policy (edge0/streaming/overflow.py) on hand-set routes and use
counts: which experts keep the slots when a multi-token call or a batch's stage routes more
distinct experts than a layer has slots."""

from __future__ import annotations

import numpy as np
import pytest

from edge0.streaming.overflow import admission_order, call_split, decayed_use, overflow_split, split_cached, stage_split


def test_an_overflowing_verify_admits_the_experts_most_of_its_tokens_route_then_the_latest_tokens():
    # T = 3 tokens, K = 2: expert 2 is routed by two tokens; then the last token's, then earlier ones'
    assert admission_order(np.array([[[1, 2], [3, 2], [4, 5]]], dtype=np.uint32)) == [2, 4, 5, 3, 1]
    assert admission_order(np.array([[7, 8], [8, 7], [9, 7]])) == [7, 8, 9]


def test_use_decays_once_a_call_and_counts_each_routed_pair():
    use = np.array([1.0, 0.0, 2.0, 0.0])
    after = decayed_use(use, np.array([[0, 2], [2, 3]]))  # expert 2 routed by both tokens
    assert after == pytest.approx([1.9, 0.0, 3.8, 1.0])
    assert use.tolist() == [1.0, 0.0, 2.0, 0.0]  # the caller's counts are not changed in place


def test_split_cached_keeps_each_sides_order():
    assert split_cached([5, 1, 7, 2], {1: 0, 2: 3}) == ([1, 2], [5, 7])
    assert split_cached([], {1: 0}) == ([], [])


def test_an_overflows_misses_take_a_slot_only_from_a_less_used_cached_expert():
    """Hand-set use: a call routes 5, 6, 1 and 7 while 1-4 are cached in 4 slots, so its misses
    compete with 2, 3 and 4 for three slots, by recent use (ties keep the cached expert)."""
    cached, order = {1: 0, 2: 1, 3: 2, 4: 3}, [5, 6, 1, 7]
    use = np.array([0, 1, 9, 5, 0.1, 3, 0.5, 8])  # by expert: 7 passes 3, 5 passes only 4
    assert overflow_split(order, cached, use, 4) == ([1], [7], [5, 6])
    use[[4, 5, 7]] = [2, 1, 2]  # 7 ties with 4, the least used cached one: nothing is admitted
    assert overflow_split(order, cached, use, 4) == ([1], [], [5, 6, 7])
    # an empty slot goes to the best miss, however little used
    assert overflow_split(order, {1: 0, 2: 1, 3: 2}, use, 4) == ([1], [7], [5, 6])


def test_misses_of_equal_use_take_the_slots_in_admission_order():
    use = np.zeros(8)
    assert overflow_split([6, 2, 5], {}, use, 2) == ([], [6, 2], [5])
    assert overflow_split([5, 2, 6], {}, use, 2) == ([], [5, 2], [6])


def test_a_call_overflows_only_when_its_union_outgrows_the_slots():
    """Two rows route 1, 2 and 3, 1: three experts. In three slots they fit; in two, 1 (cached)
    stays and 3 (the later row's) passes the little-used cached 9 for the other slot."""
    ids = np.array([[[1, 2]], [[3, 1]]])  # B = 2 rows x T = 1 x K = 2
    use = np.zeros(10)
    use[[1, 2, 3, 9]] = [2, 1, 1, 0.5]
    assert call_split(ids, {1: 0, 9: 1}, use, 3) is None
    assert call_split(ids, {1: 0, 9: 1}, use, 2) == ([1], [3], [2])
    use[9] = 1  # a tie keeps the cached expert
    assert call_split(ids, {1: 0, 9: 1}, use, 2) == ([1], [], [3, 2])


def test_a_batch_stage_within_the_slots_stages_its_whole_union():
    rows = np.array([[3, 1], [1, 0]])
    assert stage_split(rows, {9: 0}, np.zeros(10), 4) == ([0, 1, 3], [])


def test_a_batch_stage_beyond_the_slots_ranks_by_the_use_its_step_will_count():
    """Two slots hold 0 and 9 (9 used lately); the rows route 1 twice and 2, 3 once. With the
    step's own counts, 1 passes the unused 0 and takes its slot; 2 and 3 are read for the step."""
    use = np.zeros(10)
    use[9] = 5.0
    rows = np.array([[1, 2], [3, 1]])
    assert stage_split(rows, {0: 0, 9: 1}, use, 2) == ([1], [2, 3])
    # the counts before the step alone would keep 0 (ties keep the cached expert) and admit nothing
    assert overflow_split(admission_order(rows), {0: 0, 9: 1}, use, 2) == ([], [], [1, 3, 2])
