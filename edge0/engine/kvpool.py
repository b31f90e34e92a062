"""KV caches of several conversations in memory. An agent session is many conversations (a main
thread, side requests, subagents) whose requests interleave; each next request of one repeats
everything before it. The pool keeps the caches of finished requests, bounded in bytes; a request
takes the one sharing its longest prefix: the cache itself when the request extends all of it, a
trimmed copy when it branches off inside it (the original stays for its own conversation). The
least recently used go first beyond the bound (to the disk tier, if the engine has one). The
newest entry, the cache the last request checked in, stays outside the bound (the memory budget
reserves one context for it) until the next one comes: it is what mlx-lm keeps as "the prompt
cache", found whatever the length it shares with a request.

Lookup walks the request's tokens in blocks of BLOCK: each block's prefix hash maps to the entries
holding that prefix, so finding the longest shared prefix costs a dict lookup per block, not a
comparison with every cached conversation; entries shorter than a block sit under the namespace's
root key. The hashes start from the entry's namespace (a request's cache_salt, its API key):
requests of different namespaces never find each other's caches.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from edge0.backend import kvcache as bkv

BLOCK = 64  # tokens per lookup block; a shared prefix shorter than one block is found in the newest entry only


@dataclass
class Entry:
    """A cached conversation: `tokens` the cache holds, `prompt_end` where its last request's
    prompt ended (a branch after it is that conversation's next turn, not another conversation)."""

    tokens: list[int]
    cache: list
    nbytes: int
    prompt_end: int
    trimmable: bool
    used: float = field(default_factory=time.monotonic)
    keys: list[int] = field(default_factory=list)  # its block-prefix hashes in the index
    eid: int = -1
    on_disk: bool = False  # the disk tier holds these tokens already
    namespace: str = ""  # only requests of the same namespace find it
    floor: int = 0  # a trimmable cache's fewest tokens (a chunked attention cache's kept chunk: trim_floor)


def _root(namespace: str) -> int:
    """The index key of `namespace`'s entries shorter than a block."""
    return hash(("short", namespace))


def _block_hashes(tokens: list[int], namespace: str = ""):
    """The hash of each whole block's prefix in `namespace`: tokens[:BLOCK], tokens[:2 BLOCK], ..."""
    h = hash(namespace)
    for i in range(BLOCK, len(tokens) + 1, BLOCK):
        h = hash((h, tuple(tokens[i - BLOCK : i])))
        yield h


class KVPool:
    """Caches of finished requests, at most `max_bytes` together (module docstring)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = self.configured_bytes = max_bytes
        self.sized_for = ""  # what a default bound was sized for (engine/load.py), for the describe line
        self._entries: dict[int, Entry] = {}
        self._index: dict[int, set[int]] = {}  # block-prefix hash -> ids of the entries holding it
        self._ids = itertools.count()
        self.bytes = 0  # of the entries under the bound (all but the newest)
        self.newest: Entry | None = None  # the last one put with newest=True, outside the bound
        self.counts = {"hits": 0, "misses": 0, "copies": 0, "evicted": 0, "evicted_bytes": 0, "too_large": 0}

    def __len__(self) -> int:
        return len(self._entries) - (self.newest is not None)

    # -- in and out ------------------------------------------------------------------------------
    def put(
        self, tokens: list[int], cache, prompt_end: int, on_disk: bool = False, namespace: str = "", newest=False
    ) -> list[Entry]:
        """Keep `cache` (holding exactly `tokens`) in `namespace`, as the newest entry or under the
        bound. Entries it makes redundant (a trimmable cache holds their tokens and more) go; then
        the least recently used beyond the bound. Returns the entries evicted by the bound, oldest
        first (for the disk tier)."""
        nbytes, trimmable = bkv.prompt_cache_nbytes(cache), bkv.can_trim_prompt_cache(cache)
        entry = Entry(list(tokens), cache, nbytes, prompt_end, trimmable, on_disk=on_disk, namespace=namespace)
        entry.floor = bkv.trim_floor(cache) if trimmable else 0
        if entry.trimmable:
            for other in self._holding(tokens, namespace):
                held = entry.floor <= len(other.tokens) <= len(tokens)  # the new cache can be cut back to it
                if held and tokens[: len(other.tokens)] == other.tokens:
                    self._drop(other)
        entry.eid = next(self._ids)
        entry.keys = list(_block_hashes(entry.tokens, namespace)) or [_root(namespace)]
        for h in entry.keys:
            self._index.setdefault(h, set()).add(entry.eid)
        self._entries[entry.eid] = entry
        if newest:
            entry, self.newest = self.newest, entry  # the one before joins the bounded entries
            if entry is None:
                return []
        if entry.nbytes > self.max_bytes:  # it alone is over the bound: it goes, the others stay
            self.counts["too_large"] += 1
            self.bytes += entry.nbytes
            self._drop(entry)
            return [entry]
        self.bytes += entry.nbytes
        return self.shrink(self.max_bytes)

    def best(self, tokens: list[int], namespace: str = "") -> tuple[Entry | None, int]:
        """The entry of `namespace` sharing the longest usable prefix with `tokens` and that
        prefix's length: a trimmable cache at any point, another only where its tokens end (it
        cannot be cut back)."""
        candidates, depth = set(self._index.get(_root(namespace), ())), 0
        for h in _block_hashes(tokens, namespace):
            found = self._index.get(h)
            if not found:
                break
            candidates, depth = found, depth + BLOCK
        at = {eid: depth for eid in candidates}
        if self.newest is not None:
            at.setdefault(self.newest.eid, 0)
        best, n = None, 0
        for eid, d in at.items():
            e = self._entries[eid]
            if e.namespace != namespace:  # a hash collision must never cross namespaces
                continue
            k = d + bkv.common_prefix_len(e.tokens[d:], tokens[d:])
            if k < len(e.tokens) and (not e.trimmable or k < e.floor):
                continue
            if k > n or (k == n and best is not None and e.used > best.used):
                best, n = e, k
        return best, n

    def take(self, entry: Entry, n: int):
        """The cache of `entry` holding its first `n` tokens, for a request to write into: the
        entry itself (out of the pool) when `n` covers it, the request continues its conversation
        (it shares the prompt, whose last token its first step feeds; the tail is that turn's own
        reply), or the bound could not keep it anyway; else a trimmed copy, and the entry stays."""
        self.counts["hits"] += 1
        entry.used = time.monotonic()
        own = n >= entry.prompt_end - 1 or entry.nbytes > self.max_bytes or len(entry.tokens) < BLOCK
        if n == len(entry.tokens) or (entry.trimmable and own):
            self._drop(entry)
            if n < len(entry.tokens):
                bkv.trim_to(entry.cache, n)
            return entry.cache
        self.counts["copies"] += 1
        cache = bkv.copy_cache(entry.cache)
        bkv.trim_to(cache, n)
        return cache

    def count(self, what: str) -> None:
        """A lookup that no tier answered (misses)."""
        self.counts[what] += 1

    def shrink(self, max_bytes: int) -> list[Entry]:
        """A new bound (memory pressure): the least recently used go until it holds. Returns them."""
        self.max_bytes = max_bytes
        evicted = []
        for old in sorted(self.entries(), key=lambda e: e.used):
            if self.bytes <= self.max_bytes:
                break
            self._drop(old)
            self.counts["evicted"] += 1
            self.counts["evicted_bytes"] += old.nbytes
            evicted.append(old)
        return evicted

    def entries(self) -> list[Entry]:
        """The entries under the bound (not the newest)."""
        return [e for e in self._entries.values() if e is not self.newest]

    def remove(self, entry: Entry) -> None:
        """`entry` goes (nothing reuses it, nothing saves it)."""
        self._drop(entry)

    def clear(self) -> None:
        """Every entry goes, the newest too."""
        for e in list(self._entries.values()):
            self._drop(e)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _holding(self, tokens: list[int], namespace: str) -> list[Entry]:
        """Entries of `namespace` that share at least the first block with `tokens`."""
        first = next(_block_hashes(tokens, namespace), None)
        found = [self._entries[i] for i in self._index.get(first, ())] if first is not None else []
        return [e for e in found if e.namespace == namespace]

    def _drop(self, entry: Entry) -> None:
        for h in entry.keys:
            ids = self._index.get(h)
            if ids is not None:
                ids.discard(entry.eid)
                if not ids:
                    del self._index[h]
        del self._entries[entry.eid]
        if entry is self.newest:
            self.newest = None
        else:
            self.bytes -= entry.nbytes

    def stats(self) -> dict:
        return {"entries": len(self), "bytes": self.bytes, "max_bytes": self.max_bytes, **self.counts}
