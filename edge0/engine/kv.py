"""The reusable KV cache: keep the longest common token prefix with the previous call and prefill
only the rest (mlx-lm's prompt-cache helpers do the trimming); optionally, finished caches on disk
for a restarted process (edge0.store.promptcache.DiskPromptCaches)."""

from __future__ import annotations

from edge0.backend import kvcache as bkv
from edge0.errors import Edge0Error
from edge0.store.promptcache import DiskPromptCaches


class PromptCache:
    """The model's KV cache and the tokens it holds."""

    def __init__(self, model, kv_bits: int | None = None, kv_group_size: int = 64):
        """`kv_bits`: quantize the attention caches to 4 or 8 bits (None: float)."""
        self.model, self.kv_bits, self.kv_group_size = model, kv_bits, kv_group_size
        self.cache = None
        self.tokens: list[int] = []
        self.dirty = False  # set while the KV cache may be ahead of `tokens` (a step in flight)
        self.disk: DiskPromptCaches | None = None
        self.persistable = False  # the last generation asked for reuse (only those are saved)
        self.on_disk: list[int] = []  # a prefix of `tokens` already on disk (saved or restored)

    def reset(self) -> None:
        self.cache, self.tokens, self.dirty, self.on_disk, self.persistable = None, [], False, [], False

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

    def prepare(self, tokens: list[int], reuse: bool) -> int:
        """Make the cache hold a prefix of `tokens` (all but the last token at most, which must be
        fed to get logits): the longer of what the cache in memory shares with them and what a
        cache on disk does. Returns that prefix's length."""
        held, usable = 0, False
        if reuse and self.cache is not None and not self.dirty:
            held = bkv.common_prefix_len(self.tokens, tokens[:-1])
            usable = held == len(self.tokens) or (held > 0 and bkv.can_trim_prompt_cache(self.cache))
        held = held if usable else 0
        if reuse and self.disk is not None and held < len(tokens) - 1:  # the disk could hold more
            cache, n = self.disk.restore(tokens, longer_than=held)
            if cache is not None:
                self.cache, self.tokens, self.on_disk, self.persistable = cache, tokens[:n], tokens[:n], True
                return n
        if usable:
            if held < len(self.tokens):
                bkv.trim_prompt_cache(self.cache, len(self.tokens) - held)
                self.tokens, self.on_disk = self.tokens[:held], self.on_disk[:held]
            self.persistable = True
            return held
        self.reset()
        self.cache, self.persistable = self.make(), reuse
        return 0

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
        it holds tokens that are not on disk yet. Returns whether it saved."""
        if self.disk is None or not self.persistable or self.cache is None or self.dirty or not self.tokens:
            return False
        if self.tokens == self.on_disk[: len(self.tokens)]:
            return False
        if not self.disk.save(self.tokens, self.cache):
            return False
        self.on_disk = list(self.tokens)
        return True

    def stats(self) -> dict:
        """The tokens the cache holds, and its directory's statistics (`dir` None without one)."""
        return {"tokens": len(self.tokens), **(self.disk.stats() if self.disk else {"dir": None})}
