"""The reusable KV cache: keep the longest common token prefix with the previous call and prefill
only the rest (mlx-lm's prompt-cache helpers do the trimming); optionally, finished caches on disk
for a restarted process."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

from edge0.backend import nn as bnn
from edge0.errors import Edge0Error


class PromptCache:
    """The model's KV cache and the tokens it holds."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.tokens: list[int] = []
        self.dirty = False  # set while the KV cache may be ahead of `tokens` (a step in flight)
        self.disk: DiskPromptCaches | None = None

    def reset(self) -> None:
        self.cache, self.tokens, self.dirty = None, [], False

    def prepare(self, tokens: list[int], reuse: bool) -> int:
        """Make the cache hold a prefix of `tokens` (all but the last token at most, which must be
        fed to get logits); returns that prefix's length."""
        if reuse and self.cache is not None and not self.dirty:
            common = bnn.common_prefix_len(self.tokens, tokens[:-1])
            drop = len(self.tokens) - common
            if drop == 0:
                return common
            if common > 0 and bnn.can_trim_prompt_cache(self.cache):
                bnn.trim_prompt_cache(self.cache, drop)
                self.tokens = self.tokens[:common]
                return common
        if reuse and self.disk is not None:
            cache, n = self.disk.restore(tokens)
            if cache is not None:
                self.cache, self.tokens = cache, tokens[:n]
                return n
        self.cache = bnn.make_prompt_cache(self.model)
        self.tokens = []
        return 0

    def sync(self, offset: int) -> None:
        """A follower stage: hold exactly `offset` tokens, as rank 0's cache does before a forward
        (a new cache at 0; trimmed where rank 0 trimmed, as its KV reuse does)."""
        held = bnn.cache_offset(self.cache) if self.cache is not None else 0
        if offset == 0:
            self.cache = bnn.make_prompt_cache(self.model)
        elif held > offset and bnn.can_trim_prompt_cache(self.cache):
            bnn.trim_prompt_cache(self.cache, held - offset)
        elif held != offset:
            raise Edge0Error(f"this stage's KV cache holds {held} tokens, rank 0's {offset}: the ranks are out of step; "
                             "restart every rank")

    def persist(self) -> None:
        """Save the cache to disk (when a directory is set), for a later process."""
        if self.disk is not None and self.cache is not None and not self.dirty and self.tokens:
            self.disk.save(list(self.tokens), self.cache)


class DiskPromptCaches:
    """KV caches of finished conversations on disk, so a restarted process reuses a matching
    prefix: mlx-lm's `save_prompt_cache` files under DIR/<engine identity>/, an index of the
    tokens each holds, the least recently used removed beyond `max_bytes`. The identity covers
    everything the KV depends on (store, serving K, pre-router heads, adapter)."""

    INDEX = "index.json"

    def __init__(self, root, identity: str, max_bytes: int):
        self.dir = Path(root).expanduser() / identity[:24]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.saved = self.restored = self.evicted = 0

    @contextmanager
    def _locked(self):
        """Processes sharing DIR update the index one at a time."""
        with open(self.dir / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield self._read()

    def _read(self) -> dict:
        try:
            return json.loads((self.dir / self.INDEX).read_text())
        except (OSError, ValueError):
            return {}  # none yet, or damaged: entries without an index are rewritten on save

    def _write(self, index: dict) -> None:
        tmp = self.dir / f".{self.INDEX}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(index))
        os.replace(tmp, self.dir / self.INDEX)

    def restore(self, tokens: list[int]):
        """(cache, n): the stored cache sharing the longest prefix n > 0 with `tokens` (all but
        the last token, which must be fed), trimmed to n; or (None, 0)."""
        with self._locked() as index:
            best, n = None, 0
            for name, entry in index.items():
                k = bnn.common_prefix_len(entry["tokens"], tokens[:-1])
                if k > n and (self.dir / name).is_file():
                    best, n = name, k
            if best is None:
                return None, 0
            cache = bnn.load_prompt_cache(str(self.dir / best))
            held = len(index[best]["tokens"])
            if n < held and not (bnn.can_trim_prompt_cache(cache) and bnn.trim_prompt_cache(cache, held - n) == held - n):
                return None, 0
            index[best]["used"] = time.time()
            self._write(index)
        self.restored += 1
        return cache, n

    def save(self, tokens: list[int], cache) -> None:
        """Store `cache` (holding exactly `tokens`), then remove the least recently used entries
        beyond the size bound."""
        name = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:32] + ".safetensors"
        with self._locked() as index:
            if name not in index or not (self.dir / name).is_file():
                tmp = self.dir / f".{name}.{os.getpid()}.tmp.safetensors"
                bnn.save_prompt_cache(str(tmp), cache)
                os.replace(tmp, self.dir / name)
                self.saved += 1
            index[name] = {"tokens": tokens, "bytes": (self.dir / name).stat().st_size, "used": time.time()}
            total = sum(e["bytes"] for e in index.values())
            for old in sorted(index, key=lambda k: index[k]["used"]):
                if total <= self.max_bytes or old == name:
                    continue
                (self.dir / old).unlink(missing_ok=True)
                total -= index.pop(old)["bytes"]
                self.evicted += 1
            self._write(index)

    def stats(self) -> dict:
        return {"dir": str(self.dir), "max_bytes": self.max_bytes, "saved": self.saved, "restored": self.restored,
                "evicted": self.evicted}
