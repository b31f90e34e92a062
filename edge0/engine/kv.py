"""The reusable KV cache: keep the longest common token prefix with an earlier call and prefill
only the rest (mlx-lm's prompt-cache helpers do the trimming). The cache of the request in flight
is the working cache; with a pool (kvpool.KVPool), the caches of other conversations stay in memory
beside it, and with a disk tier (edge0.store.promptcache.DiskPromptCaches), finished and evicted
caches go to disk for a later request or a restarted process.

Every cache belongs to a namespace (a request's cache_salt, its API key; "" by default): a request
reuses only caches of its own namespace, so clients that do not share one never learn from
cached-token counts, or the time a reused prefix saves, what another one sent."""

from __future__ import annotations

from edge0.backend import kvcache as bkv
from edge0.engine.kvpool import BLOCK, KVPool
from edge0.errors import Edge0Error
from edge0.store.promptcache import DiskPromptCaches
from edge0.streaming.budget import pool_reason
from edge0.units import format_size


class PromptCache:
    """The model's KV cache and the tokens it holds."""

    def __init__(self, model, kv_bits: int | None = None, kv_group_size: int = 64):
        """`kv_bits`: quantize the attention caches to 4 or 8 bits (None: float)."""
        self.model, self.kv_bits, self.kv_group_size = model, kv_bits, kv_group_size
        self.cache = None
        self.tokens: list[int] = []
        self.namespace = ""  # the working cache's
        self.receipt = None  # the disk file the working cache was restored from, until a forward on it succeeds
        self.dirty = False  # set while the KV cache may be ahead of `tokens` (a step in flight)
        self.disk: DiskPromptCaches | None = None
        self.pool: KVPool | None = None
        self.persistable = False  # the last generation asked for reuse (only those are saved)
        self.on_disk: list[int] = []  # a prefix of `tokens` already on disk (saved or restored)
        self.prompt_end = 0  # where the prompt of the request that filled the working cache ended
        self.snapshot = None  # (tokens, cache copy) at the end of that prompt, for caches that cannot be trimmed
        self.evicted: list = []  # pool entries pushed out of memory, for the disk tier between requests
        # one sequence's KV at the context the memory budget was sized for (set at load); each
        # sequence of a batch beyond the first takes this much from the pool's bound while it runs
        self.context_bytes = 0

    def reset(self) -> None:
        self.cache, self.tokens, self.dirty, self.on_disk, self.persistable = None, [], False, [], False
        self.prompt_end, self.snapshot, self.namespace, self.receipt = 0, None, "", None

    def fresh(self) -> None:
        """An empty cache that nothing reuses (a teacher-forced pass)."""
        self.reset()
        self.cache = self.make()

    def make(self) -> list:
        """A new, empty cache for the model."""
        return bkv.make_cache(self.model, self.kv_bits, self.kv_group_size)

    def use_disk(self, disk: DiskPromptCaches) -> None:
        """Save finished caches to `disk` and restore matching prefixes from it."""
        self.disk = disk

    def use_pool(self, max_bytes: int) -> None:
        """Keep the caches of other conversations in memory, at most `max_bytes` (0: none)."""
        self.pool = KVPool(max_bytes) if max_bytes > 0 else None

    def _park(self) -> None:
        """The working cache (and its end-of-prompt snapshot) into the pool, for its conversation's
        next request; what the pool's bound pushes out waits for the disk tier."""
        if self.pool is not None and self.cache is not None and not self.dirty and self.persistable and self.tokens:
            ns = self.namespace
            if self.snapshot is not None:
                self.evicted += self.pool.put(*self.snapshot, prompt_end=len(self.snapshot[0]), namespace=ns)
            on_disk = self.on_disk == self.tokens
            self.evicted += self.pool.put(self.tokens, self.cache, self.prompt_end, on_disk, namespace=ns)
        self.reset()

    def mark_prompt_end(self) -> None:
        """The working cache holds the whole prompt now: a cache that cannot be trimmed back keeps a
        copy of itself here, where the conversation's next request (its prompt, the reply as the
        client renders it, a new turn) will branch off."""
        self.prompt_end = len(self.tokens)
        if self.pool is not None and self.persistable and not bkv.can_trim_prompt_cache(self.cache):
            self.snapshot = (list(self.tokens), bkv.copy_cache(self.cache))

    def begin(self) -> None:
        """A forward that extends the cache is in flight: until `advance`, the cache may hold
        tokens that `tokens` does not, so nothing reuses it."""
        self.dirty = True

    def advance(self, fed: list[int]) -> None:
        """The forward that `begin` announced is done: the cache now also holds `fed`."""
        self.tokens += list(fed)
        self.dirty = False

    def keep(self, fed: list[int]) -> bool:
        """The forward that `begin` announced was cancelled after feeding `fed` completely (and
        maybe part of what followed): the cache is trimmed back to hold `tokens + fed`, so a retry
        of the request resumes there. Recurrent state cannot be trimmed: then the cache is dropped.
        Returns whether it was kept."""
        if self.cache is None or not bkv.trim_to(self.cache, len(self.tokens) + len(fed)):
            self.reset()
            return False
        self.advance(fed)
        return True

    def prepare(self, tokens: list[int], reuse: bool, namespace: str = "") -> int:
        """Make the working cache hold a prefix of `tokens` (all but the last token at most, which
        must be fed to get logits): the longest that the working cache, a pooled cache or a cache
        on disk shares with them. Returns that prefix's length.

        The working cache is continued in place when the request extends it, or branches off it
        after its last prompt (the conversation's next turn: the client's rendering of the reply
        differs from the tokens generated). A request that branches off earlier is another
        conversation: with a pool, the working cache joins it whole and the request gets a trimmed
        copy (kvpool.KVPool.take); without one, it is trimmed. Only caches of `namespace` are
        reused, and the working cache then belongs to it."""
        if not reuse:
            self._park()
            self.cache, self.persistable = self.make(), False
            return 0
        q = tokens[:-1]
        ours = self.cache is not None and not self.dirty and self.namespace == namespace
        held = bkv.common_prefix_len(self.tokens, q) if ours else 0
        if held < len(self.tokens) and not (held and bkv.can_trim_prompt_cache(self.cache)):
            held = 0  # it cannot be cut back to the shared prefix
        entry, n = self.pool.best(q, namespace) if self.pool is not None else (None, 0)
        snap = self.snapshot if self.namespace == namespace else None
        if not held and snap is not None and len(snap[0]) > n and q[: len(snap[0])] == snap[0]:
            # the conversation's next turn on a cache that cannot be cut back: from its prompt's end
            self.snapshot = None
            self._park()
            self.cache, self.tokens, self.persistable, self.namespace = snap[1], list(snap[0]), True, namespace
            self.pool.count("hits")
            return len(self.tokens)
        longest = max(held, n)
        restored, r = (
            self.disk.restore(tokens, longer_than=longest, namespace=namespace)
            if self.disk and longest < len(q)
            else (None, 0)
        )
        if restored is not None:
            self._park()
            self.cache, self.tokens, self.on_disk, self.persistable = restored, q[:r], q[:r], True
            self.namespace, self.receipt = namespace, self.disk.last_restore
            return r
        if held and held >= n:
            # the prompt's last token is fed by the first step: up to there, the same conversation
            other = held < len(self.tokens) and held < self.prompt_end - 1
            if other and self.pool is not None and len(self.tokens) >= BLOCK:
                cache = bkv.copy_cache(self.cache)  # the working cache stays whole for its own conversation
                bkv.trim_to(cache, held)
                self._park()
                self.pool.count("copies")
                self.cache, self.tokens, self.on_disk, self.namespace = cache, q[:held], [], namespace
            elif held < len(self.tokens):
                bkv.trim_to(self.cache, held)
                self.tokens, self.on_disk = self.tokens[:held], self.on_disk[:held]
            if self.pool is not None:
                self.pool.count("hits")
            self.persistable, self.prompt_end, self.snapshot = True, 0, None
            return held
        taken = self.pool.take(entry, n) if entry is not None else None  # before parking, which may evict it
        self._park()
        self.namespace = namespace
        if taken is None:
            if self.pool is not None:
                self.pool.count("misses")
            self.cache, self.persistable = self.make(), True
            return 0
        self.cache, self.tokens, self.persistable = taken, q[:n], True
        self.on_disk = list(self.tokens) if entry.on_disk else []
        return n

    def checkout(self, tokens: list[int], namespace: str = "") -> tuple[list, int, object]:
        """A cache for one sequence of a batch, holding the longest prefix of `tokens` found in
        `namespace` (as `prepare` finds it: the working cache, the pool, the disk tier); the
        sequence owns it until `checkin`. Returns (the cache, the tokens it holds, the disk file it
        came from or None: for `failed`)."""
        held = self.prepare(tokens, True, namespace)
        cache, receipt = self.cache, self.receipt
        self.reset()  # the cache is the sequence's now: nothing else continues or parks it
        return cache, held, receipt

    def take(self) -> list | None:
        """The working cache leaves to become a batch sequence's own (batch.py: the lone sequence
        when another joins); its end-of-prompt snapshot, if any, joins the pool."""
        cache = self.cache
        if self.snapshot is not None and self.pool is not None:
            tokens, copy = self.snapshot
            self.evicted += self.pool.put(tokens, copy, prompt_end=len(tokens), namespace=self.namespace)
        self.reset()
        return cache

    def failed(self, error, receipt=None) -> None:
        """A forward raised `error`: on a batch sequence's own cache, restored from disk as
        `receipt`, or (None) on the working cache, which is dropped. A cache restored from disk is
        suspect: its file is removed and counted damaged (DiskPromptCaches.discard)."""
        if receipt is None:
            receipt = self.receipt
            self.reset()
        if receipt is not None and self.disk is not None:
            self.disk.discard(receipt, error)

    def checkin(self, tokens: list[int], cache: list, prompt_end: int, namespace: str = "") -> None:
        """A finished sequence's `cache` (holding exactly `tokens`, a prompt of `prompt_end` tokens
        and the reply fed after it, in `namespace`) becomes the working cache; the one before
        joins the pool."""
        self._park()
        self.cache, self.tokens, self.persistable, self.prompt_end = cache, list(tokens), True, prompt_end
        self.namespace = namespace

    def needs_prompt_copy(self, cache) -> bool:
        """Whether a sequence whose whole prompt is in `cache` should keep a copy of it there: the
        cache cannot be trimmed back and a pool keeps other conversations (as mark_prompt_end)."""
        return self.pool is not None and not bkv.can_trim_prompt_cache(cache)

    def keep_prompt(self, tokens: list[int], cache, namespace: str = "") -> None:
        """A copy of a batch sequence's cache holding exactly its prompt `tokens` joins the pool
        (in `namespace`), where the conversation's next request branches off (needs_prompt_copy)."""
        self.evicted += self.pool.put(tokens, cache, prompt_end=len(tokens), namespace=namespace)

    def sync(self, offset: int) -> None:
        """A follower stage: hold exactly `offset` tokens, as rank 0's cache does before a forward
        (a new cache at 0; trimmed where rank 0 trimmed, as its KV reuse does)."""
        held = bkv.cache_offset(self.cache) if self.cache is not None else 0
        if offset == 0:
            self.cache = self.make()
        elif held > offset and bkv.can_trim_prompt_cache(self.cache):
            bkv.trim_prompt_cache(self.cache, held - offset)
        elif held != offset:
            raise Edge0Error(
                f"this stage's KV cache holds {held} tokens, rank 0's {offset}: the ranks are out of step; "
                "restart every rank"
            )

    def persist(self) -> bool:
        """Save the cache to disk when a directory is set, the last generation asked for reuse, and
        it holds tokens that are not on disk yet (and the pool's evicted caches). Returns whether it
        saved the working cache."""
        evicted, self.evicted = self.evicted, []
        for entry in evicted if self.disk is not None else ():
            if not entry.on_disk:
                self.disk.save(entry.tokens, entry.cache, namespace=entry.namespace, prompt_end=entry.prompt_end)
        if self.disk is None or not self.persistable or self.cache is None or self.dirty or not self.tokens:
            return False
        if self.tokens == self.on_disk[: len(self.tokens)]:
            return False
        if not self.disk.save(self.tokens, self.cache, namespace=self.namespace, prompt_end=self.prompt_end):
            return False
        self.on_disk = list(self.tokens)
        return True

    def flush(self) -> int:
        """Before the process ends: the working cache and the pooled ones not on disk yet go to the
        disk tier (the most recently used first, as its bound keeps those). Returns how many."""
        if self.disk is None:
            return 0
        saved = int(self.persist())
        pooled = sorted(self.pool.entries(), key=lambda e: e.used) if self.pool is not None else []
        for entry in [e for e in self.evicted if not e.on_disk] + pooled:
            if not entry.on_disk and self.disk.save(entry.tokens, entry.cache, entry.namespace, entry.prompt_end):
                entry.on_disk, saved = True, saved + 1
        self.evicted = []
        return saved

    def describe(self) -> str:
        """The tiers that keep conversations' KV caches, for the engine's describe line."""
        pool = self.pool
        memory = (
            f"memory {format_size(pool.configured_bytes)} ({pool_reason(pool.sized_for)})"
            if pool is not None
            else "the last only"
        )
        disk = f"disk {self.disk.root} up to {format_size(self.disk.max_bytes)}" if self.disk else "no disk"
        return f"prompt caches: {memory}, {disk}"

    def stats(self) -> dict:
        """The tokens the working cache holds, its directory's statistics (`dir` None without one)
        and the memory pool's (`memory`, None without one)."""
        return {
            "tokens": len(self.tokens),
            **(self.disk.stats() if self.disk else {"dir": None}),
            "memory": self.pool.stats() if self.pool is not None else None,
        }
