"""The prompt caches: conversations' KV caches kept for a later request that shares a prefix, so it
prefills only the rest (mlx-lm's prompt-cache helpers do the trimming). Two tiers: memory (a
kvpool.KVPool, whose newest entry is the last request's cache, outside its bound) and disk
(edge0.store.promptcache.DiskPromptCaches, for evicted caches and a restarted process). A sequence
`checkout`s the longest prefix either tier holds and `checkin`s its cache when it ends; the memory
watcher asks the pool to `evict`; a batch `lend`s part of the pool's bound while it runs.

Every cache belongs to a namespace (a request's cache_salt, its API key; "" by default): a request
reuses only caches of its own namespace, so clients that do not share one never learn from
cached-token counts, or the time a reused prefix saves, what another one sent."""

from __future__ import annotations

from edge0.backend import kvcache as bkv
from edge0.engine.kvpool import Entry, KVPool
from edge0.store.promptcache import DiskPromptCaches
from edge0.streaming.budget import pool_reason
from edge0.units import format_size


class PromptCache:
    """The prompt caches of one model (module docstring)."""

    def __init__(self, model, kv_bits: int | None = None, kv_group_size: int = 64):
        """`kv_bits`: quantize the attention caches to 4 or 8 bits (None: float)."""
        self.model, self.kv_bits, self.kv_group_size = model, kv_bits, kv_group_size
        self.pool = KVPool(0)  # 0: the newest entry only ("the last only")
        self.disk: DiskPromptCaches | None = None
        self.evicted: list[Entry] = []  # pushed out of memory, for the disk tier between requests
        # one sequence's KV at the context the memory budget was sized for (set at load); each
        # sequence of a batch beyond the first takes this much from the pool's bound while it runs
        self.context_bytes = 0
        # a pipeline's rank 0: its Pipeline, which has the other ranks save and restore their shares
        # of each file of the disk tier (restore_shares, saved); None in one process
        self.ranks = None
        self._ceiling = 0  # the pool's bound: as configured, or lower under memory pressure (evict)
        self._lent = 0  # bytes of the bound a running batch holds (lend)

    def make(self) -> list:
        """A new, empty cache for the model."""
        return bkv.make_cache(self.model, self.kv_bits, self.kv_group_size)

    def use_disk(self, disk: DiskPromptCaches) -> None:
        """Save evicted and finished caches to `disk` and restore matching prefixes from it."""
        self.disk = disk

    def use_pool(self, max_bytes: int, sized_for: str = "") -> None:
        """Keep the caches of other conversations in memory, at most `max_bytes` beside the newest
        (0: the newest only); `sized_for` says what a default bound was sized for."""
        self.pool.configured_bytes, self.pool.sized_for = max_bytes, sized_for
        self.restore_bound()

    @property
    def keeps_others(self) -> bool:
        return self.pool.configured_bytes > 0

    @property
    def newest(self) -> Entry | None:
        """The cache the last request checked in (None: none yet, or dropped)."""
        return self.pool.newest

    # -- the two verbs -------------------------------------------------------------------------
    def checkout(self, tokens: list[int], namespace: str = "", reuse: bool = True) -> tuple[list, int, object]:
        """A cache for a sequence of prompt `tokens` to write into, holding the longest prefix of
        them (but the last token, which must be fed to get logits) that a tier holds in
        `namespace`: the pool's entry itself or a trimmed copy (KVPool.take), or a cache restored
        from disk when that holds more. Without `reuse`, a new cache. The sequence owns it until
        `checkin`. Returns (the cache, the tokens it holds, the disk file it came from or None,
        for `failed` until a forward on it succeeds)."""
        if not reuse:
            return self.make(), 0, None
        q = tokens[:-1]
        entry, n = self.pool.best(q, namespace)
        if self.disk is not None and n < len(q):
            restored, r = self.disk.restore(tokens, longer_than=n, namespace=namespace)
            if restored is not None and self._shared(restored, namespace, r):
                return restored, r, self.disk.last_restore
        if entry is None:
            self.pool.count("misses")
            return self.make(), 0, None
        return self.pool.take(entry, n), n, None

    def _shared(self, restored, namespace: str, n: int) -> bool:
        """Across ranks: whether every other rank restored its share of the file just restored
        (a rank without one makes this file useless: it is removed, counted `incomplete`)."""
        if self.ranks is None:
            return True
        answers = self.ranks.restore_shares(restored, namespace, self.disk.last_tokens, n)
        missing = [a for a in answers if a.endswith("missing")]
        if missing:
            self.disk.discard(
                self.disk.last_restore, f"{missing[0].rsplit(':', 1)[0]} has no share of it", "incomplete"
            )
        return all(a.endswith("ok") for a in answers)

    def _save(self, entry) -> bool:
        """`entry` to the disk tier (across ranks, every rank saves its share)."""
        if self.ranks is not None:
            self.ranks.saved(entry.cache, entry.tokens, entry.namespace, entry.prompt_end)
        return self.disk.save(entry.tokens, entry.cache, namespace=entry.namespace, prompt_end=entry.prompt_end)

    def checkin(self, tokens: list[int], cache: list, prompt_end: int, namespace: str = "") -> None:
        """A sequence's `cache` (holding exactly `tokens`, a prompt of `prompt_end` tokens and what
        was fed after it, in `namespace`) becomes the newest entry; the one before goes under the
        bound, which may push the least recently used out (to the disk tier)."""
        self._evicted(self.pool.put(tokens, cache, prompt_end, namespace=namespace, newest=True))

    def needs_prompt_copy(self, cache) -> bool:
        """Whether a sequence whose whole prompt is in `cache` should keep a copy of it: the cache
        cannot be trimmed back and the pool keeps other conversations. The conversation's next
        request (its prompt, the reply as the client renders it, a new turn) branches off there."""
        return self.keeps_others and not bkv.can_trim_prompt_cache(cache)

    def keep_prompt(self, tokens: list[int], cache, namespace: str = "") -> None:
        """A copy of a sequence's cache holding exactly its prompt `tokens` joins the pool (in
        `namespace`), where its conversation's next request branches off (needs_prompt_copy)."""
        self._evicted(self.pool.put(tokens, cache, prompt_end=len(tokens), namespace=namespace))

    def failed(self, error, receipt) -> None:
        """A forward raised `error` on a cache restored from disk as `receipt`: the file is suspect,
        so it is removed and counted damaged (DiskPromptCaches.discard)."""
        if receipt is not None and self.disk is not None:
            self.disk.discard(receipt, error)

    def drop_newest(self) -> None:
        """The newest entry goes (nothing reuses it; it is not saved)."""
        if self.pool.newest is not None:
            self.pool.remove(self.pool.newest)

    # -- the memory bound ----------------------------------------------------------------------
    def evict(self, nbytes: int) -> int:
        """Memory pressure: the least recently used conversations leave memory (to the disk tier)
        until `nbytes` are freed or none is left, and the bound stays that much lower until
        `restore_bound`. Returns the bytes freed."""
        before = self.pool.bytes
        self._ceiling = max(0, before - nbytes)
        self._bound()
        return before - self.pool.bytes

    def restore_bound(self) -> None:
        """Memory is back: the bound as configured."""
        self._ceiling = self.pool.configured_bytes
        self._bound()

    def lend(self, nbytes: int) -> None:
        """A running batch holds `nbytes` of KV beyond one context: the bound is that much lower
        until it lends 0."""
        self._lent = nbytes
        self._bound()

    def _bound(self) -> None:
        bound = max(0, self._ceiling - self._lent)
        if bound < self.pool.max_bytes:
            self._evicted(self.pool.shrink(bound))
        self.pool.max_bytes = bound

    def _evicted(self, entries: list[Entry]) -> None:
        if self.disk is not None:
            self.evicted += entries

    # -- the disk tier -------------------------------------------------------------------------
    def persist(self) -> bool:
        """Between requests: the evicted caches not on disk yet go there, and the newest when it
        holds tokens that are not (a disk tier set). Returns whether it saved the newest."""
        evicted, self.evicted = self.evicted, []
        for entry in evicted if self.disk is not None else ():
            if not entry.on_disk:
                self._save(entry)
        e = self.pool.newest
        if self.disk is None or e is None or e.on_disk:
            return False
        if not self._save(e):
            return False
        e.on_disk = True
        return True

    def flush(self) -> int:
        """Before the process ends: every cache in memory not on disk yet goes to the disk tier (the
        most recently used first, as its bound keeps those). Returns how many were saved."""
        if self.disk is None:
            return 0
        saved = int(self.persist())
        for entry in sorted(self.pool.entries(), key=lambda e: e.used):
            if not entry.on_disk and self._save(entry):
                entry.on_disk, saved = True, saved + 1
        return saved

    def describe(self) -> str:
        """The tiers that keep conversations' KV caches, for the engine's describe line."""
        pool = self.pool
        memory = (
            f"memory {format_size(pool.configured_bytes)} ({pool_reason(pool.sized_for)})"
            if self.keeps_others
            else "the last only"
        )
        disk = f"disk {self.disk.root} up to {format_size(self.disk.max_bytes)}" if self.disk else "no disk"
        return f"prompt caches: {memory}, {disk}"

    def stats(self) -> dict:
        """The tokens the newest cache holds, the disk tier's statistics (`dir` None without one)
        and the memory pool's (`memory`, None when it keeps the newest only)."""
        return {
            "tokens": len(self.newest.tokens) if self.newest is not None else 0,
            **(self.disk.stats() if self.disk else {"dir": None}),
            "memory": self.pool.stats() if self.keeps_others else None,
        }
