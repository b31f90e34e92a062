"""Every prompt cache of rank 0, mirrored on the other ranks for their layers.

Rank 0 owns the prompt caches: the lone sequence's, each waiting sequence's own, a batch's merged
rows, the pool's entries of other conversations. Its caches for the other stages' layers are
placeholders (SkipLayers feed them one-wide keys), so every operation on them is cheap there;
the other ranks hold the real thing for their layers. Rank 0's `Journal` hears of each cache made
and each change one goes through outside a forward (backend/kvcache.py: copy, trim, merge, join,
filter, extract) and of each cache dropped (a weak reference), names each cache with a number,
and hands the ops to the next message; each other rank's `Replica` makes the same change to its
own cache of that number, in the same order, before it acts on the message. A forward names the
cache it runs on. So batching, a pool of many conversations and end-of-prompt snapshots of
recurrent state work across ranks as in one process, with no rule of thumb about token counts.

A speculative verify's rewind is mirrored too: rank 0 notes the rewind point it takes before
the verify's forward (each other rank takes its own then, of its own layers' states) and the
rewind after it; where some rank's layers cannot be cut back (recurrent state), every rank goes
back to before the forward and the kept tokens are fed again, as one process of the whole model
does (`Pipeline.traits["replays"]`, `Stepper.replays`).

The disk tier (`--prompt-cache-dir`) is mirrored by request: each rank keeps its own layers' share
of every saved conversation in its own directory (its identity names its stage). When rank 0
saves one, every other rank saves its share of that cache too ("save", each deciding as its own
tier does); when rank 0 restores one, it asks the others to restore their share of the same file
at the same length in one round trip (`Pipeline.restore_shares`), and uses it only if every rank
did. A rank that lacks its share makes rank 0 drop its file (counted `incomplete`); one that
could not read or cut it back now makes rank 0 prefill instead.
"""

from __future__ import annotations

import weakref
from collections import deque

from edge0.backend import kvcache as bkv
from edge0.errors import Edge0Error


class Journal:
    """Rank 0: names its prompt caches and queues, in order, what the other ranks must do to
    theirs (`take()` hands the queue to the next message)."""

    def __init__(self):
        self.ops: deque = deque()
        self.last = 0  # the last name given

    def __call__(self, op: str, out, *args) -> None:
        if op == "make":
            self.ops.append(("make", self._name(out)))
        elif op == "read":  # a cache restored from disk: the others restore theirs (restore_shares)
            self._name(out)
        elif op == "copy":
            self.ops.append(("copy", self._name(out), self.name(args[0])))
        elif op == "trim":
            self.ops.append(("trim", self.name(out), int(args[0]), bool(args[1])))
        elif op == "merge":
            self.ops.append(("merge", self._name(out), [self.name(c) for c in args[0]]))
        elif op == "join":
            self.ops.append(("join", self.name(args[0]), self.name(args[1])))
        elif op == "filter":
            self.ops.append(("filter", self.name(out), [int(r) for r in args[0]]))
        elif op == "extract":
            self.ops.append(("extract", self._name(out), self.name(args[0]), int(args[1])))
        elif op == "point":
            self.ops.append(("point", self.name(out), bool(args[0])))
        elif op == "rewind":
            self.ops.append(("rewind", self.name(out), int(args[0]), int(args[1]), bool(args[2])))
        elif op == "drop_tails":
            self.ops.append(("drop_tails", self.name(out), [int(d) for d in args[0]]))
        else:
            raise Edge0Error(f"across ranks: prompt-cache op {op!r} has no mirror")

    def _name(self, cache) -> int:
        self.last += 1
        cache.mirror = self.last
        weakref.finalize(cache, self._dropped, self.last)
        return self.last

    def _dropped(self, name: int) -> None:  # may run in any thread, when the GC frees the cache
        self.ops.append(("drop", name))

    @staticmethod
    def name(cache) -> int:
        """The number the other ranks know `cache` by."""
        name = getattr(cache, "mirror", None)
        if name is None:
            raise Edge0Error(
                "across ranks: a prompt cache made before the ranks were joined, or outside the "
                "prompt-cache ops the other ranks mirror, was used; restart every rank"
            )
        return name

    def saved(self, cache, tokens: list[int], namespace: str, prompt_end: int) -> None:
        """Rank 0 saves `cache` to its disk tier: the others save their share of it."""
        self.ops.append(("save", self.name(cache), list(tokens), namespace, int(prompt_end)))

    def take(self) -> list:
        """The ops queued so far, oldest first (each taken once)."""
        out = []
        while self.ops:
            out.append(self.ops.popleft())
        return out


class Replica:
    """Another rank: its caches by rank 0's names, changed as rank 0's ops say (`apply`)."""

    def __init__(self, kv, rank: int):
        self.kv, self.rank = kv, rank  # this stage's PromptCache: its `make` and its disk tier
        self.caches: dict[int, list] = {}
        # the rewind point of the verify in flight (one at a time): (cache name, point)
        self.point: tuple[int, list | None] | None = None

    def get(self, name: int) -> list:
        try:
            return self.caches[name]
        except KeyError:
            raise Edge0Error(
                f"this rank holds no prompt cache {name}: the ranks are out of step; restart every rank"
            ) from None

    def apply(self, ops: list) -> None:
        """Make rank 0's changes to this rank's caches, in order."""
        for op, *args in ops:
            if op == "make":
                self.caches[args[0]] = self.kv.make()
            elif op == "copy":
                self.caches[args[0]] = bkv.copy_cache(self.get(args[1]))
            elif op == "trim":
                name, n, done = args
                if bkv.trim_to(self.get(name), n) != done:
                    raise Edge0Error(
                        f"prompt cache {name} could {'not ' if done else ''}be cut back to {n} tokens here and "
                        f"{'' if done else 'not '}on rank 0: the ranks are out of step; restart every rank"
                    )
            elif op == "merge":
                self.caches[args[0]] = bkv.merge_caches([self.get(n) for n in args[1]])
            elif op == "join":
                merged, cache = args
                bkv.join_rows(self.get(merged), self.get(cache))
            elif op == "filter":
                bkv.filter_cache(self.get(args[0]), args[1])
            elif op == "extract":
                self.caches[args[0]] = bkv.extract_row(self.get(args[1]), args[2])
            elif op == "point":  # before a verify's forward: this rank's own point (rank 0's says whether)
                name, replay = args
                self.point = (name, bkv.rewind_point(self.get(name), replay=replay))
                if self.point[1] is not None and not replay:
                    raise Edge0Error(
                        f"prompt cache {name} cannot be cut back on this rank, but rank 0 rewinds it by cutting: the "
                        "ranks are out of step; restart every rank"
                    )
            elif op == "rewind":
                name, drop, fed, replay = args
                point = self.point[1] if self.point is not None and self.point[0] == name else None
                self.point = None
                if replay and point is None:
                    raise Edge0Error(f"prompt cache {name}: a rewind without its point; restart every rank")
                bkv.rewind(self.get(name), drop, fed, point)
            elif op == "drop_tails":
                bkv.drop_row_tails(self.get(args[0]), args[1])
            elif op == "save":  # this rank's tier decides as rank 0's did: redundant, too large, failed
                name, tokens, namespace, prompt_end = args
                if self.kv.disk is not None:
                    self.kv.disk.save(tokens, self.get(name), namespace, prompt_end)
            elif op == "drop":
                self.caches.pop(args[0], None)
                if self.point is not None and self.point[0] == args[0]:
                    self.point = None
            else:
                raise Edge0Error(f"unknown prompt-cache op {op!r} from rank 0; restart every rank")

    def nbytes(self) -> int:
        """Bytes of the KV this rank holds for rank 0's prompt caches (its share of each)."""
        return sum(bkv.prompt_cache_nbytes(c) for c in self.caches.values())

    def restore(self, name: int, namespace: str, tokens: list[int], n: int) -> str:
        """Rank 0 restored the file of `tokens` in `namespace`, cut to `n` tokens, as cache `name`:
        this rank's share of it as the same cache; returns "rank R: ok", "... missing" or
        "... declined" (DiskPromptCaches.restore_entry)."""
        cache, status = (None, "missing") if self.kv.disk is None else self.kv.disk.restore_entry(namespace, tokens, n)
        if cache is not None:
            self.caches[name] = cache
        return f"rank {self.rank}: {status}"


def held_tokens(cache) -> int:
    """Tokens a one-row prompt cache holds (cache_offset), or -1 where it does not say (a batch's
    rows each hold their own count; a stage of only linear-attention or SSM layers counts none)."""
    if not bkv.counts_tokens(cache):
        return -1
    try:
        return bkv.cache_offset(cache)
    except (TypeError, ValueError):
        return -1
