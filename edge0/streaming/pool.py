"""The expert pool: one byte budget for cached experts, split into per-layer slot sets.

Each MoE layer gets the same number of slots (budget / bytes of one expert in every layer). A
SlotSet keeps persistent device tensors [n_slots + 1, ...] for each expert tensor (the last row
is all zeros), an expert -> slot table on the device, and an ExpertCache whose policy decides
which expert a new one replaces. Only slots whose expert changed are rewritten.
"""

from __future__ import annotations

import numpy as np

from edge0.backend import core as B
from edge0.cache import ExpertCache, make_policy
from edge0.errors import Edge0Error
from edge0.store.reader import ExpertStore
from edge0.streaming.exact import to_device
from edge0.units import format_size


def slots_per_layer(store: ExpertStore, budget: int, k: int) -> int:
    """Slots each MoE layer gets from `budget`; an error if one step's route cannot fit."""
    per_slot_all_layers = sum(store.expert_nbytes(l) for l in store.layers)
    n = budget // per_slot_all_layers
    if n < k:
        need = k * per_slot_all_layers
        raise Edge0Error(
            f"--expert-cache {format_size(budget)} is too small: a decode step needs {k} experts in each of "
            f"{len(store.layers)} MoE layers ({format_size(need)}); use --expert-cache {format_size(need)} or more"
        )
    return min(n, min(int(info["num_experts"]) for info in store.layers.values()))


def host_exact(st_dtype: str, target: np.dtype) -> bool:
    """Whether `host_rows` can make `target` values of a store dtype's bytes."""
    name = B.ST_DTYPES[st_dtype]
    return name == target.name or (target.name == "float32" and name in ("float16", "bfloat16"))


def host_rows(buf: np.ndarray, st_dtype: str, target: np.dtype) -> np.ndarray | None:
    """Store bytes [n, nbytes] as `target` values on the host where that is exact (the same
    dtype, or float16/bfloat16 widened to float32, as the device's astype does); else None."""
    name = B.ST_DTYPES[st_dtype]
    if not host_exact(st_dtype, target):
        return None
    if name == target.name:
        return buf.view(target)
    if name == "float16":
        return buf.view(np.float16).astype(np.float32)
    return (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # bfloat16: a float32's top half


class SlotSet:
    """Persistent slot tensors, the expert -> slot table, and cache membership for one layer."""

    def __init__(
        self,
        store: ExpertStore,
        layer: int,
        n_slots: int,
        compute_dtype: str,
        policy: str = "lru",
        policy_options: dict | None = None,
    ):
        info = store.layers[layer]
        self.store, self.layer, self.dtype = store, layer, compute_dtype
        self.num_experts = int(info["num_experts"])
        self.n_slots = n_slots
        self.zero = n_slots  # index of the all-zero row
        zeros = {
            name: (np.zeros((n_slots + 1, t["expert_nbytes"]), np.uint8), t["dtype"], tuple(t["shape"][1:]))
            for name, t in info["tensors"].items()
        }
        self.params = to_device(zeros, n_slots + 1, compute_dtype)
        # evaluated here: MLX runs a lazy array only on the thread that built it, and the server
        # decodes on its engine thread (a float16 scale cast to float32 was left lazy: a 500)
        B.eval(self.params)
        # host views of the slot tensors, for in-place writes; made here, where nothing computes:
        # making one later waits for everything queued on the device before it (a sync a layer)
        self.views = self._host_views()
        self.table_host = np.full(self.num_experts, self.zero, dtype=np.uint32)
        self.table = B.array(self.table_host)
        self.cache = ExpertCache(make_policy(policy, n_slots, self.num_experts, **(policy_options or {})))
        self.aliased = False  # the device table maps substituted experts for the current step
        self.slot_of: dict[int, int] = {}
        self.free = list(range(n_slots - 1, -1, -1))

    def assign(self, loaded: list[int], evicted: list[int]) -> list[int]:
        """Bookkeeping only: free the evicted experts' slots and give slots to the loaded ones.
        Device tensors change only in `apply`, so a step in flight still sees the old set."""
        for e in evicted:
            self.free.append(self.slot_of.pop(e))
        slots = [self.free.pop() for _ in loaded]
        self.slot_of.update(zip(loaded, slots))
        return slots

    def plan(self, step: int, experts, scores=None, keep=()):
        """Admit `experts` into the cache, evicting none of `keep`. Returns (hits, loaded, evicted,
        slots for loaded)."""
        hits, loaded, evicted = self.cache.access(step, experts, scores, keep)
        return hits, loaded, evicted, self.assign(loaded, evicted)

    def admit(self, experts) -> tuple[list[int], list[int], list[int]]:
        """Bookkeeping only: admit `experts` read ahead of their route (ExpertCache.admit).
        Returns (loaded, evicted, slots for loaded)."""
        loaded, evicted = self.cache.admit(experts)
        return loaded, evicted, self.assign(loaded, evicted)

    def write(self, slots: list[int], raw: dict) -> bool:
        """Copy the store's bytes `raw` of len(slots) experts into their `slots` of the slot tensors'
        host views, on any thread: the rows must be read by no launched
        computation. False, writing nothing, when a tensor has no exact host view (the caller
        then scatters with `apply`)."""
        rows = []
        for name, (buf, st_dtype, shape) in raw.items():
            view = self._view(name)
            got = host_rows(buf, st_dtype, view.dtype) if view is not None else None
            if got is None:
                return False
            rows.append((view, got.reshape(len(slots), *shape)))
        for view, got in rows:
            view[slots] = got
        return True

    def direct_rows(self, slots: list[int]) -> dict[str, list[np.ndarray]]:
        """The rows `slots` of each slot tensor whose store bytes are its values (the same dtype),
        as flat byte arrays a read fills in place (ExpertStore.read's `into`: no second copy);
        {} unless every tensor has a host view `write` can fill."""
        info = self.store.layers[self.layer]["tensors"]
        rows = {}
        for name, t in info.items():
            view = self._view(name)
            if view is None or not host_exact(t["dtype"], view.dtype):
                return {}
            if B.ST_DTYPES[t["dtype"]] == view.dtype.name:
                rows[name] = [view[s].reshape(-1).view(np.uint8) for s in slots]
        return rows

    def apply(
        self,
        evicted: list[int],
        loaded: list[int],
        slots: list[int],
        raw: dict | None,
        alias: dict[int, int] | None = None,
        in_place: bool = False,
    ) -> int:
        """Device update: rewrite only the changed slots (from `raw`, the store's bytes of
        `loaded`; None: already written by `write`) and the expert -> slot table. `alias` {routed:
        substitute} points routed experts at their substitutes' slots for this step only (the
        next apply drops it). `in_place`: the caller guarantees that no launched computation
        reads these slots, so rows are copied straight into the slot tensors' memory; otherwise
        (or where a tensor has no host view) a device scatter makes new slot tensors. Returns the
        number of tensors scattered."""
        scattered = 0
        if loaded and raw is not None and in_place:
            if self.write(slots, raw):
                raw = None
        if loaded and raw is not None:
            idx = B.array(np.array(slots, dtype=np.uint32))
            for name, (buf, st_dtype, shape) in raw.items():
                proj, part = name.rsplit(".", 1)
                self.params[proj][part][idx] = to_device({name: (buf, st_dtype, shape)}, len(loaded), self.dtype)[proj][
                    part
                ]
                self.views[proj][part] = None  # a new array now: any old view is stale
                scattered += 1
        self.table_host[evicted] = self.zero
        self.table_host[loaded] = slots
        if loaded or evicted or alias or self.aliased:
            table = self.table_host
            if alias:
                table = table.copy()
                table[list(alias)] = self.table_host[list(alias.values())]
            self.table = B.array(table)
        self.aliased = bool(alias)
        return scattered

    def copy_rows(self, slots: list[int], params: dict, rows: list[int]) -> int:
        """Write rows `rows` of computed expert tensors `params` (to_device's layout: a prefill's
        whole layer) into `slots`, while no launched computation reads them: through the host
        views, or by a device scatter where a tensor has none. The table is `apply`'s. Returns the
        number of tensors scattered."""
        rows_at, slots_at, scattered = B.array(np.array(rows, np.uint32)), B.array(np.array(slots, np.uint32)), 0
        for proj, parts in params.items():
            for part, a in parts.items():
                got = B.take(a, rows_at, axis=0)
                if self.views[proj][part] is not None:
                    self.views[proj][part][slots] = B.to_numpy(got)
                else:
                    self.params[proj][part][slots_at] = got
                    scattered += 1
        return scattered

    def _view(self, name: str) -> np.ndarray | None:
        """The host view of the slot tensor of a store tensor name ("gate_proj.scales"), or None."""
        proj, part = name.rsplit(".", 1)
        return self.views[proj][part]

    def _host_views(self) -> dict:
        """A host view of each slot tensor (None where it has none, see B.writable_view). Making one
        writes a probe into its tensor's first element: only while nothing reads the slots."""
        return {p: {k: B.writable_view(a) for k, a in parts.items()} for p, parts in self.params.items()}

    def forget(self, evicted: list[int], loaded: list[int]) -> None:
        """Undo the bookkeeping of a `plan` whose read failed: `loaded` leave the cache and free
        their slots, and `evicted` point at the zero row (their slots may be given out again)."""
        gone = [e for e in loaded if e in self.slot_of]
        for e in gone:
            self.cache.cached.discard(e)
            self.cache.policy.on_evict(e)
        self.assign([], gone)
        self.apply(list(evicted), [], [], None)

    def drop(self, experts: list[int]) -> None:
        """`experts` leave the cache (those in it): their slots are freed and the table points them
        at the zero row."""
        self.forget(experts, experts)

    def resize(self, n_slots: int, keep: list[int] | None = None) -> None:
        """Hold `n_slots` slots from now on, keeping the experts `keep` (default: those the cache
        policy keeps; at most `n_slots`). Their rows are gathered into new slot tensors and the old
        ones dropped, so a shrink really frees memory. Only while nothing reads the slots."""
        self.cache.resize(n_slots)
        keep = sorted(self.cache.cached) if keep is None else keep
        stay = {e: self.slot_of[e] for e in keep if self.slot_of[e] < n_slots}
        free = sorted(set(range(n_slots)) - set(stay.values()), reverse=True)  # pop() takes the lowest
        slot_of = {**stay, **{e: free.pop() for e in keep if e not in stay}}
        rows = np.full(n_slots + 1, self.zero, dtype=np.uint32)  # unused slots and the last row: zeros
        for e, s in slot_of.items():
            rows[s] = self.slot_of[e]
        idx = B.array(rows)
        self.params = {p: {k: B.take(a, idx, axis=0) for k, a in parts.items()} for p, parts in self.params.items()}
        B.eval(self.params)
        self.views = self._host_views()  # the old ones pin the old tensors
        self.n_slots, self.zero, self.slot_of, self.free = n_slots, n_slots, slot_of, free
        self.table_host = np.full(self.num_experts, self.zero, dtype=np.uint32)
        self.table_host[list(slot_of)] = list(slot_of.values())
        self.table, self.aliased = B.array(self.table_host), False

    def local(self, indices):
        """Route indices -> slot indices, on the device (no host sync)."""
        return B.take(self.table, indices)
