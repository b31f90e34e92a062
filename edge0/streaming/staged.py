"""Staged executor (decode): experts live in persistent slot tensors; each step rewrites only
the slots whose expert changed, and the layer maps routed ids to slots with a device `take`.

Two ways to use it:
- gate routing: the layer copies the route to the host (one sync), admits its experts into the
  slot set and runs on the slots; while its misses are read, its hits' pairs already compute
  (`_split`), so the read and that compute overlap;
- staged ahead (`stage` + `swap`, the double buffer the pre-router uses): the next step's experts
  are read on a background thread while the current step computes, written into the slots at the
  step boundary, and the layer then runs with no host sync at all. Routed experts that were not
  staged would hit the zero row; they are counted as `dropped` after the step.
Once a layer's slots hold every expert (`holds_every_expert`, `fill`), a token's call runs on
them so too, its hits counted from its route after the step.

Slots are rewritten in place (SlotSet.apply(in_place=True)), which relies on one invariant of
the engine: a step's graph is built only after the previous step was evaluated, so when a layer
rewrites its slots (at the boundary, or after its own route's sync) nothing launched reads them,
except its own hits' part, which reads only the hits' slots, and its `Early` part, whose experts
the call's plan keeps (`keep`); neither is rewritten. An `Early` output always enters the layer's
output (a `Served` part, empty if the route took none), so the step's evaluation waits for it.

Router scores (over all experts) reach the cache when its policy needs them (smoe) or substitution
is on; they travel with the route, so they add no host sync: the gate path copies them in the
sync it already does, the staged path gets the pre-router's scores with its predicted route.
Substitution (alpha > 0, lossy) swaps routed experts for cached ones (edge0.cache.substitute);
the substitute takes the routed expert's gate weight, through a per-step alias in the slot table.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from edge0.backend import core as B
from edge0.backend.moe import Early, Served
from edge0.cache import substitute
from edge0.streaming.early import EARLY_EXPERTS, after_route
from edge0.streaming.exact import ExactExecutor, raw_nbytes, to_device
from edge0.streaming.lookahead import Prediction
from edge0.streaming.overflow import call_split, decayed_use, seed_order, stage_split
from edge0.streaming.parts import CallRead, DeferredPart, ReadAhead, Staged, read_call, read_into_slots
from edge0.streaming.pool import SlotSet


class StagedExecutor(ExactExecutor):
    name = "staged"

    def __init__(
        self,
        store,
        layer,
        compute_dtype,
        stats,
        slots: SlotSet,
        reader: ThreadPoolExecutor,
        alpha: float = 0.0,
    ):
        super().__init__(store, layer, compute_dtype, stats)
        self.slots = slots
        self.reader = reader  # reads ahead (stage, read_ahead); a call's own misses are read on its thread
        self.alpha = alpha
        self.wants_scores = slots.cache.policy.needs_scores or alpha > 0
        self.step = 0
        self._trusted = False  # this step's route was staged ahead: no host sync
        self._pending: Staged | None = None  # the next step's stage, until its swap
        # a batch's staged union beyond the slots, read ahead of the call that takes it
        self._ahead: ReadAhead | None = None
        # the layer before's prediction of the next host route (streaming/lookahead.py)
        self.prediction = Prediction(self.slots, self.stats, self.expert_nbytes)
        self._dropped = []  # device scalars, read after the step by collect_after_step
        self._unsynced = []  # device routes of calls over a cache holding every expert, read likewise
        self._inflight: DeferredPart | None = None  # a call's deferred misses part (see _split), until it runs
        self._unplanned = None  # (ids, experts, scores, keep) of a call that hit every expert, until `done`
        # fn(layer), a stager's (on_route): called after a call that routed on the host, when this
        # step's slots are planned, so the next step's reads can start before the forward ends
        self._after_route = None
        # how often each expert was routed lately (rows of host-routed calls, decayed a call): who
        # keeps a slot when a call's union is wider than the slots (streaming/overflow.py)
        self.use = np.zeros(self.slots.num_experts)
        self.early = EARLY_EXPERTS  # predicted experts in the slots a token's call computes before its route

    def route_experts(self, ids: np.ndarray, scores) -> tuple[list[int], dict[int, int]]:
        """One token's route (host ids [K], scores [E]) -> (the experts to use, {routed:
        substitute}); no substitution at alpha 0."""
        if not self.alpha:
            return np.unique(ids).tolist(), {}
        new, n = substitute(np.reshape(scores, -1), np.reshape(ids, -1), self.slots.cache.cached, self.alpha)
        self.stats.substitutions += n
        alias = {int(a): int(b) for a, b in zip(np.reshape(ids, -1), new) if a != b}
        return np.unique(new).tolist(), alias

    # -- the double buffer -------------------------------------------------------------------
    def stage(self, ids, scores=None) -> None:
        """Start reading the experts of the *next* step (host ids of one token's route [K], or of a
        batch's rows [B, K]; router scores [E] when `wants_scores`) in the background. A batch's
        union beyond the slots stages what its step's own overflow will keep (`stage_split`); the
        rest is read ahead too, for the step only. A batch's step routes on the host and counts
        its hits and misses there; here only the reads count (at the swap)."""
        self._finish_inflight()
        ids = np.asarray(ids)
        if ids.ndim == 1:
            experts, alias = self.route_experts(ids, scores)
        else:  # the step's own host route substitutes, if at all
            experts, beyond = stage_split(ids, self.slots.slot_of, self.use, self.slots.n_slots)
            alias = {}
            if beyond:  # read ahead too, for the step's overflow
                self._read([])  # a read ahead not taken yet: counted, then replaced
                self._ahead = ReadAhead.start(self.reader, self.store, self.layer, beyond)
                self.stats.beyond_ahead += len(beyond)
        hits, loaded, evicted, slots = self.slots.plan(self.step + 1, experts, scores)
        if ids.ndim == 1:
            self.stats.hits += len(hits)
            self.stats.misses += len(loaded)
            self.stats.bytes_used += len(experts) * self.expert_nbytes
            self.stats.distinct_experts.update(experts)
        future = self.reader.submit(self.store.read, self.layer, loaded) if loaded else None
        self._pending = Staged(evicted, loaded, slots, future, alias, ids.ndim == 1)

    def distrust(self) -> None:
        """The next call routes on the host after a swap (a row joined the batch since the stage, unpredicted)."""
        self._trusted = False

    def on_route(self, fn) -> None:
        """Call `fn(layer)` after each host-routed call from now on (a stager staging this layer's
        next step as soon as it has routed); None stops it."""
        self._after_route = fn

    def takes_predictions(self) -> bool:
        """Whether this layer's next call routes on the host (a staged route needs no prediction)."""
        return not self._trusted and self._pending is None and not self.holds_every_expert()

    def routes_on_host(self) -> bool:
        return self.takes_predictions()  # one token's call; a staged route (trusted) needs no sync

    # how well the layer before's predictions agreed lately, and whether one was scored yet (Lookahead reads them)
    recall = property(lambda self: self.prediction.recall, lambda self, v: setattr(self.prediction, "recall", v))
    scored = property(lambda self: self.prediction.scored)

    def read_ahead(self, ids, read: bool = True) -> None:
        """The layer before's prediction of this layer's next route (host ids [.., K], best first),
        scored when that call routes; with `read`, the predicted experts not in the slots are
        admitted now and a reader thread writes them into their slots while the layer before
        computes (nothing launched reads this layer's slots until its call, which waits for them).
        The call finds those it routes cached; the rest are counted as wasted."""
        self._plan_pending()  # a call whose `done` never came: its bookkeeping first
        self.prediction.predict(ids)
        if read and self._ahead is None and self.prediction.slotted is None and self.takes_predictions():
            self.prediction.read(self.reader, self.store, self.layer)

    def swap(self) -> None:
        """Step boundary (the previous step is evaluated, so nothing in flight reads the slots):
        wait for the staged reads and write them into their slots in place. Nothing staged (the
        last step of the sequences before it staged nothing): the step routes on the host."""
        self._finish_inflight()
        if self._pending is None:
            self._trusted = False
            return
        staged, self._pending = self._pending, None
        raw = None
        if staged.read is not None:
            t0 = time.perf_counter()
            raw = staged.read.result()
            self.stats.stall_s += time.perf_counter() - t0
            self.stats.loads += len(staged.loaded)
            self.stats.bytes_read += raw_nbytes(raw)
            self.stats.slot_rewrites += len(staged.loaded)
        self.stats.slot_scatters += self.slots.apply(
            staged.evicted, staged.loaded, staged.slots, raw, staged.alias, in_place=True
        )
        # a batch's stage is the union of its rows: the step routes on the host, even if one row is left
        self._trusted = staged.one_row

    def settle(self) -> None:
        """Finish a pending stage (so cache membership and slot contents agree) and return to
        gate mode; called when a generation ends."""
        self._finish_inflight()
        if self._pending is not None:
            self.swap()
        self._read([])  # a read ahead beyond the slots its step never took: counted as read
        self.prediction.took([])  # a prediction no call routed: wasted
        self.prediction.ids = None  # not the next generation's
        self._trusted = False

    def _read(self, want) -> dict | None:
        """Store bytes of experts `want` (in that order; None if none): from the read ahead
        where it has them, the others read now."""
        t0 = time.perf_counter()
        raw = self._counted(want, read_call(self.store, self.layer, want, self._take_ahead()))
        self.stats.stall_s += time.perf_counter() - t0
        return raw

    def _take_ahead(self) -> ReadAhead | None:
        """The read ahead, for the call that takes it (once: the next call reads for itself)."""
        ahead, self._ahead = self._ahead, None
        return ahead

    def _counted(self, want, got: CallRead) -> dict | None:
        """A call's read as the store bytes of `want` (in that order; None if none), counted."""
        got.count(self.stats, want)
        return got.bytes_of(want)

    def resize(self, n_slots: int) -> None:
        """Between generations (nothing staged): `n_slots` slots, the policy choosing who stays."""
        self._finish_inflight()
        if self._pending is not None or self._ahead is not None:
            raise RuntimeError(f"layer {self.layer}: a staged step is pending; settle() it before resizing")
        self.slots.resize(n_slots)
        self._trusted = False

    def holds_every_expert(self) -> bool:
        """Every expert of the layer is in its slots (as many slots as experts, all loaded): a
        token's route maps onto them on the device, with no host sync and nothing to read.
        Substitution and score-aware policies still route on the host."""
        return not self.wants_scores and len(self.slots.slot_of) == self.slots.num_experts

    def fill(self, params, routes) -> None:
        """A whole layer's experts (`params`, computed, in id order) a prefill read, and its last
        call's route (host ids [.., K]): the experts `seed_order` picks take their slots from them."""
        want = seed_order(routes, self.slots.n_slots, self.slots.num_experts, self.slots.slot_of)
        if self._pending is not None or not want:
            return
        self._finish_inflight()  # nothing in flight writes the slots; the step before was evaluated
        loaded, evicted, slots = self.slots.admit(want)
        s = self.stats
        s.slot_scatters += self.slots.copy_rows(slots, params, loaded)
        self.slots.apply(evicted, loaded, slots, None)
        s.slot_rewrites, s.seeded = s.slot_rewrites + len(loaded), s.seeded + len(loaded)

    def _on_slots(self, indices) -> list:
        """A token's call mapped onto the slots on the device, no host sync: its route was staged (a
        routed expert not staged hits the zero row, counted as dropped), or every expert is cached."""
        self.step += 1
        local = self.slots.local(indices)
        if self._trusted:
            self._dropped.append((local == self.slots.zero).sum())
        else:
            self._unsynced.append(indices)
        self._trusted = False
        return [(self.slots.params, local)]

    def take_after_step(self) -> tuple[list, list]:
        """This step's device counters of routed experts that were not staged, and the routes of its
        calls over a cache holding every expert (see collect_after_step)."""
        out = self._dropped, self._unsynced
        self._dropped, self._unsynced = [], []
        return out

    def count_routes(self, routes: list) -> None:
        """Hits of calls routed on the device over a cache holding every expert (no recency: nothing evicts)."""
        for ids in routes:
            experts = np.unique(ids).tolist()
            self._count(experts, experts, [], 0)

    # -- the layer call ------------------------------------------------------------------------
    def host_route(self, indices, scores):
        """Route and router scores to the host in one sync."""
        self._synced(indices)
        B.eval(indices, scores)
        return B.to_numpy(indices), B.to_numpy(scores)

    def __call__(self, indices, scores=None):
        self._finish_inflight()
        if self._pending is not None:  # between a stage and its swap: a prefill's one token (a sequence
            return super().__call__(indices, scores)  # joining a batch), not a step: the slots wait for the swap
        self.stats.calls += 1
        multi = indices.size > indices.shape[-1]  # several tokens: a verify, or a batch of sequences
        if not multi and (self._trusted or self.holds_every_expert()):
            return self._on_slots(indices)
        # a multi-token step routes on the host even after a swap: what was staged is in the slots (hits)
        self._trusted = False
        if not (multi or self.wants_scores or self.alpha):
            early = self.prediction.early(indices.shape[-1], self.early)
            if early:
                return self._early_call(indices, early)
        ids, scores = self.host_route(indices, scores) if self.wants_scores else (self.host_ids(indices), None)
        if not multi and not self.alpha:
            return self._token_call(indices, ids, scores)
        early = self._account(ids)
        if multi and scores is not None:  # the cache policy sees one score row per call: the tokens' mean
            scores = np.reshape(scores, (-1, scores.shape[-1])).mean(axis=0)
        split = call_split(ids, self.slots.slot_of, self.use, self.slots.n_slots)
        if split is not None:  # e.g. a verify's union of experts wider than the cache
            return self._overflow(ids, *split, scores, early)
        experts, alias = self.route_experts(ids, scores)
        hits, loaded, evicted, slots = self.slots.plan(self.step, experts, scores)
        self._count(experts, hits, loaded, early)
        if hits and loaded and not alias:
            return self._split(ids, loaded, lambda: (evicted, loaded, slots))
        if loaded and not alias:
            return self._read_later(indices, loaded, lambda: (evicted, loaded, slots))
        s = self.stats
        # this layer's slots are read by no launched computation: the route's sync evaluated
        # everything before it, and the previous step was evaluated whole
        try:
            raw = self._read(loaded)
        except BaseException:
            self.slots.forget(evicted, loaded)
            raise
        s.slot_scatters += self.slots.apply(evicted, loaded, slots, raw, alias, in_place=True)
        s.slot_rewrites += len(loaded)
        parts = [(self.slots.params, self.slots.local(indices))]
        self._routed()
        return parts

    def _account(self, ids: np.ndarray, keep=()) -> int:
        """A host-routed call's bookkeeping before its plan: its prediction scored and taken
        (`Prediction.took`, whose count it returns; `keep` stay cached), the use counts and the step."""
        self.prediction.score(ids)
        early = self.prediction.took(ids, keep)
        self.use = decayed_use(self.use, ids)
        self.step += 1
        return early

    def _count(self, experts: list, hits: list, loaded: list, early: int) -> None:
        s = self.stats
        s.hits += len(hits) - early
        s.misses += len(loaded) + early
        s.bytes_used += len(experts) * self.expert_nbytes
        s.distinct_experts.update(experts)

    def _token_call(self, indices, ids: np.ndarray, scores) -> list:
        """One token's host-routed call without substitution. Its hits' part is returned at once,
        from the slots as they are: the plan never rewrites a routed expert's slot, so the layer's
        compute starts right after the route's sync. The bookkeeping and the plan (`_plan_token`)
        wait until that compute runs: in the deferred misses part, which then reads the misses, or
        at `done` when every expert hit."""
        experts = set(ids.reshape(-1).tolist())
        misses = sorted(experts - self.slots.slot_of.keys())
        if not misses:
            self._unplanned = (ids, sorted(experts), scores, ())
            return [(self.slots.params, self.slots.local(indices))]
        plan = lambda: self._plan_token(ids, sorted(experts), scores)  # noqa: E731
        if len(misses) == len(experts):
            return self._read_later(indices, misses, plan)
        return self._split(ids, misses, plan)

    def _early_call(self, indices, early: list[int]) -> list:
        """A token's call whose predicted experts `early` compute while its route is copied to the
        host: an `Early` part over their slots, then the route's sync and the rest (`_after_early`).
        The route gets its own evaluation first, so its sync waits for it alone."""
        B.async_eval(indices)
        rows = B.array(self.slots.table_host[early])
        return [Early(self.slots.params, rows), lambda: self._after_early(indices, early)]

    def _after_early(self, indices, early: list[int]) -> list:
        """After an `Early` part: the pairs routed to its experts take their outputs (`Served`), the
        other hits compute from their slots, and the misses are read as in `_split`. The early
        experts keep their slots through this call's plan (their compute may still read them)."""
        ids = self.host_ids(indices)
        flat = ids.reshape(-1)
        order = flat.tolist()
        served, at, hits, misses = after_route(order, early, self.slots.slot_of)
        experts = sorted(set(order))
        s = self.stats
        s.early_experts += len(early)
        s.early_unused += len(set(early) - set(order))
        # always a Served part: the output then waits for the Early compute (see the module's doc)
        parts = [Served(np.array(served, dtype=np.int64), np.array(at, dtype=np.int64))]
        if hits:
            parts.append((self.slots.params, B.array(self.slots.table_host[flat[hits]]), np.array(hits)))
        if not misses:
            self._unplanned = (ids, experts, None, early)
            return parts
        s.overlapped += bool(parts)
        return [*parts, self._misses_part(ids, misses, lambda: self._plan_token(ids, experts, None, early))]

    def _plan_token(self, ids: np.ndarray, experts: list, scores, keep=()) -> tuple[list, list, list]:
        """A token's call's bookkeeping and plan (see `_token_call`; `experts`: its distinct
        routed experts, sorted; `keep`: experts whose slots stay): (evicted, loaded, slots)."""
        early = self._account(ids, keep)
        hits, loaded, evicted, slots = self.slots.plan(self.step, experts, scores, keep)
        self._count(experts, hits, loaded, early)
        return evicted, loaded, slots

    def _plan_pending(self) -> None:
        """The plan of a token's call whose experts all hit, once its compute runs (`done`)."""
        if self._unplanned is not None:
            ids, experts, scores, keep = self._unplanned
            self._unplanned = None
            self._plan_token(ids, experts, scores, keep)
            self._routed()

    def done(self, y) -> None:
        super().done(y)
        self._plan_pending()

    def _routed(self) -> None:
        if self._after_route is not None:
            self._after_route(self.layer)

    def _overflow(self, ids: np.ndarray, hits: list, admit: list, rest: list, scores, early: int):
        """More distinct experts than slots: the cached ones (`hits`, `early` of them read ahead)
        stay, the misses `admit` take a slot and `rest` are read for this call only (`call_split`);
        all are read once and every (token, k) pair is computed once, in the part of its expert's
        source (`_split`)."""
        _, loaded, evicted, slots = self.slots.plan(self.step, hits + admit, scores)
        s = self.stats
        s.fallbacks += 1
        s.hits += len(hits) - early
        s.misses += len(admit) + len(rest) + early
        s.bytes_used += (len(hits) + len(admit) + len(rest)) * self.expert_nbytes
        s.distinct_experts.update(hits + admit + rest)
        return self._split(ids, list(loaded) + rest, lambda: (evicted, loaded, slots))

    def _split(self, ids: np.ndarray, misses: list, plan) -> list:
        """A host-routed call with misses (`misses`: the plan's `loaded`, which take its slots, then
        any read for this call only): the call returns the hits' pairs as a part over the slots,
        then the deferred misses part (`_misses_part`), so the hits compute while the misses are
        read (a read and the compute it waits for no longer add up). The launched hits part reads
        only the hits' slots, which this call does not rewrite."""
        # sets, not np.isin: K pairs, and this runs between the route's sync and the hits' launch
        flat, missing = ids.reshape(-1), set(misses)
        misses_part = self._misses_part(ids, misses, plan)
        kept = np.array([i for i, e in enumerate(flat.tolist()) if e not in missing], dtype=np.int64)
        if not len(kept):
            return [misses_part]
        self.stats.overlapped += 1
        return [(self.slots.params, B.array(self.slots.table_host[flat[kept]]), kept), misses_part]

    def _misses_part(self, ids: np.ndarray, misses: list, plan) -> DeferredPart:
        """The deferred part (`_deferred`) of a call's pairs routed to `misses`: computed from their
        slots once written there, or, when some misses are read for this call only, from the bytes
        read."""
        flat, missing = ids.reshape(-1), set(misses)
        pairs = np.array([i for i, e in enumerate(flat.tolist()) if e in missing], dtype=np.int64)

        def pairs_part(raw, loaded):
            if len(misses) == len(loaded):  # every miss took a slot (now written): no second copy
                return self.slots.params, B.array(self.slots.table_host[flat[pairs]]), pairs
            at = {e: i for i, e in enumerate(misses)}
            rows = B.array(np.array([at[int(e)] for e in flat[pairs]], dtype=np.uint32))
            return to_device(raw, len(misses), self.dtype), rows, pairs

        return self._deferred(misses, plan, pairs_part)

    def _read_later(self, indices, misses: list, plan) -> list:
        """A host-routed call whose experts all miss (each takes a slot): one deferred part
        (`_deferred`) that runs on the slots once its misses are written there; the next layer's
        read-ahead (streaming/lookahead.py) is issued just before this read
        (LayerDispatch._after_launch)."""
        return [self._deferred(misses, plan, lambda raw, loaded: (self.slots.params, self.slots.local(indices)))]

    def _deferred(self, misses: list, plan, part_of) -> DeferredPart:
        """A host-routed call's misses: returns its deferred part, which makes the call's `plan`
        (evicted, loaded, slots), reads the misses (once the parts before it were launched, so the
        read overlaps their compute, and no other thread contends with the launch), writes `loaded`
        (the first of `misses`) into their slots in place and returns `part_of(the bytes read,
        loaded)` (`_land`)."""
        ahead = self._take_ahead()
        self._inflight = DeferredPart(
            misses, plan, lambda: read_call(self.store, self.layer, misses, ahead), ahead is None, part_of, self._land
        )
        return self._inflight

    def _land(self, part: DeferredPart, route: bool) -> tuple:
        """A deferred part's first call: the call planned, its bytes written and its part made; if
        the read failed, the cache forgets the misses it admitted."""
        self._inflight = None
        evicted, loaded, slots = part.plan()
        n = len(loaded)
        if part.misses[:n] != list(loaded):
            raise RuntimeError(f"layer {self.layer}: the plan loads {loaded}, the read has {part.misses}")
        s = self.stats
        t0 = time.perf_counter()
        try:
            if part.direct and n == len(part.misses):  # each miss takes a slot: read straight into it
                nbytes, raw = read_into_slots(self.store, self.slots, self.layer, loaded, slots)
                s.loads, s.bytes_read = s.loads + n, s.bytes_read + nbytes
                slot_raw = raw  # None: written in place; else bytes without a host view, scattered by apply
            else:
                raw = self._counted(part.misses, part.read())
                slot_raw = {k: (b[:n], d, shape) for k, (b, d, shape) in raw.items()} if n else None
        except BaseException:
            self.slots.forget(evicted, loaded)
            raise
        s.slot_scatters += self.slots.apply(evicted, loaded, slots, slot_raw, in_place=True)
        s.slot_rewrites += n
        made = part.part_of(raw, loaded)
        s.stall_s += time.perf_counter() - t0
        if route:
            self._routed()
        return made

    def _finish_inflight(self) -> None:
        """Before anything touches the slots: the read ahead landed (`Prediction.land`), and a call's
        deferred misses part its caller never took (an error while building the layer) read and
        written, so the slots hold what the cache says they hold (the next step is not staged
        from here: it routes on the host)."""
        self._plan_pending()
        self.prediction.land()
        if self._inflight is not None:
            self._inflight(route=False)


def follow_routes(executors, fn) -> None:
    """`on_route(fn)` on each of the staged `executors` (None stops it)."""
    for ex in executors:
        ex.on_route(fn)
