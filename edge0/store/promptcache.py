"""KV caches of finished conversations on disk (DiskPromptCaches), so a restarted process reuses a
matching prefix; an LRU bound over the directory, shared between processes under a file lock."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

from edge0.backend import kvcache as bkv
from edge0.errors import Edge0Error
from edge0.store.headers import read_header

# An entry's name: DIR/<identity prefix>/<token hash>.safetensors, as save() writes it.
_ENTRY = re.compile(r"[0-9a-f]{32}/[0-9a-f]{32}\.safetensors")


def _tokens_ok(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


class DiskPromptCaches:
    """KV caches of finished conversations on disk, so a restarted process reuses a matching
    prefix: mlx-lm `save_prompt_cache` files DIR/<identity>/<token hash>.safetensors (their
    metadata holds the identity and the tokens) and DIR/index.json (every file's identity, tokens,
    size and last use). Beyond `max_bytes`, all identities together, the least recently used files
    are removed. The identity covers everything the KV depends on (Engine.identity).

    Processes sharing DIR take DIR/.lock for every index update and file write. Files are written
    to a temporary name and renamed; a damaged file or index is refused, counted and noted
    (`stats()`), never fatal: a damaged index is rebuilt from the files' metadata."""

    INDEX = "index.json"
    VERSION = 1

    def __init__(self, root, identity: str, max_bytes: int):
        self.root = Path(root).expanduser()
        self.identity, self.max_bytes = identity, max_bytes
        self.dir = self.root / identity[:32]
        self.counts = {
            "saved": 0,
            "restored": 0,
            "restored_tokens": 0,
            "evicted": 0,
            "replaced": 0,
            "too_large": 0,
            "damaged": 0,
            "index_rebuilt": 0,
            "untrimmable": 0,
            "failed": 0,
        }
        self.note = ""  # the last refusal or failure
        self.last_save_s: float | None = None
        self.bytes = self.entries = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with self._locked() as index:
                # Files are written only under the lock, so temporaries found holding it are
                # left by a process that died mid-write.
                for tmp in [*self.root.glob("*/.*.tmp*"), *self.root.glob(f".{self.INDEX}.*.tmp")]:
                    tmp.unlink(missing_ok=True)
                self._adopt_orphans(index)
                self._write(index)
        except OSError as e:
            raise Edge0Error(
                f"--prompt-cache-dir {root}: {e.strerror or e}; pass a directory this process can write"
            ) from None

    # -- the index -------------------------------------------------------------------------------
    @contextmanager
    def _locked(self):
        """The index, read under DIR/.lock (held until the block ends)."""
        with open(self.root / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield self._read()

    def _read(self) -> dict:
        path = self.root / self.INDEX
        try:
            data = json.loads(path.read_text())
            entries = data["entries"]
            if (
                data.get("version") != self.VERSION
                or not isinstance(entries, dict)
                or not all(_ENTRY.fullmatch(name) for name in entries)  # names it writes: none leaves DIR
                or not all(
                    isinstance(e, dict)
                    and isinstance(e.get("identity"), str)
                    and _tokens_ok(e.get("tokens"))
                    and isinstance(e.get("bytes"), int)
                    and isinstance(e.get("used"), (int, float))
                    for e in entries.values()
                )
            ):
                raise ValueError("unexpected contents")
            return entries
        except FileNotFoundError:
            return self._scan("")
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.counts["index_rebuilt"] += 1
            entries = self._scan(f"{path} was damaged ({e}); rebuilt from the files")
            self._write(entries)
            return entries

    def _scan(self, why: str) -> dict:
        """The index rebuilt from the cache files' own metadata; unreadable files are removed."""
        entries = {}
        for f in sorted(self.root.glob("*/*.safetensors")):
            if f.name.startswith("."):
                continue
            try:
                meta = bkv.prompt_cache_metadata(read_header(f).metadata)
                tokens = json.loads(meta["tokens"])
                if not isinstance(meta.get("identity"), str) or not _tokens_ok(tokens):
                    raise ValueError("no identity or tokens in its metadata")
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._refuse(f, e)
                continue
            st = f.stat()
            entries[f"{f.parent.name}/{f.name}"] = {
                "identity": meta["identity"],
                "tokens": tokens,
                "bytes": st.st_size,
                "used": st.st_mtime,
            }
        if why or entries:
            self.note = why or f"{self.root / self.INDEX} was missing; rebuilt from {len(entries)} files"
        return entries

    def _adopt_orphans(self, index: dict) -> None:
        """Index the cache files the index lacks (a process stopped between renaming a file into
        place and writing the index), then evict beyond the bound, so that it holds after a crash."""
        names = {f"{f.parent.name}/{f.name}" for f in self.root.glob("*/*.safetensors") if not f.name.startswith(".")}
        if not names - index.keys():
            return
        found = self._scan("")
        orphans = {name: found[name] for name in names - index.keys() if name in found}
        index.update(orphans)
        self._evict(index)
        self.note = f"{len(orphans)} cache files were missing from {self.root / self.INDEX}; indexed"

    def _evict(self, index: dict, keep: str | None = None) -> int:
        """Remove the least recently used entries (never `keep`) until the index fits the bound;
        the bytes left."""
        total = sum(e["bytes"] for e in index.values())
        for old in sorted(index, key=lambda k: index[k]["used"]):
            if total <= self.max_bytes:
                break
            if old != keep:
                total -= index[old]["bytes"]
                self._remove(index, old, "evicted")
        return total

    def _write(self, entries: dict) -> None:
        tmp = self.root / f".{self.INDEX}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps({"version": self.VERSION, "entries": entries}))
            os.replace(tmp, self.root / self.INDEX)
        except OSError:  # a full disk: the index stays as it was, without a temporary beside it
            tmp.unlink(missing_ok=True)
            raise
        self.bytes, self.entries = sum(e["bytes"] for e in entries.values()), len(entries)

    def _refuse(self, path: Path, error) -> None:
        """A damaged cache file: counted, noted and removed."""
        self.counts["damaged"] += 1
        self.note = f"{path}: damaged ({error}); removed"
        path.unlink(missing_ok=True)

    # -- restore and save --------------------------------------------------------------------------
    def restore(self, tokens: list[int], longer_than: int = 0):
        """(cache, n): a stored cache of this identity sharing the longest prefix n >
        `longer_than` with `tokens` (all but the last token, which must be fed), trimmed to n;
        or (None, 0)."""
        try:
            found = self._restore(tokens, longer_than)
        except OSError as e:  # DIR removed or unreadable while serving: prefill instead
            self.counts["failed"] += 1
            self.note = f"reading {self.root} failed: {e}"
            return None, 0
        if found[0] is not None:
            self.counts["restored"] += 1
            self.counts["restored_tokens"] += found[1]
        return found

    def _restore(self, tokens: list[int], longer_than: int):
        with self._locked() as index:
            best, n = None, longer_than
            for name, entry in index.items():
                if entry["identity"] == self.identity:
                    k = bkv.common_prefix_len(entry["tokens"], tokens[:-1])
                    if k > n:
                        best, n = name, k
            if best is None:
                return None, 0
            entry, path = index[best], self.root / best
            try:
                cache, meta = bkv.read_prompt_cache(str(path))
                if meta.get("identity") != self.identity or json.loads(meta.get("tokens", "null")) != entry["tokens"]:
                    raise ValueError("its metadata does not match the index")
            except Exception as e:  # noqa: BLE001 - whatever a damaged file raises, it is refused
                self._refuse(path, e)
                index.pop(best)
                self._write(index)
                return None, 0
            held = len(entry["tokens"])
            if n < held and not (
                bkv.can_trim_prompt_cache(cache) and bkv.trim_prompt_cache(cache, held - n) == held - n
            ):
                self.counts["untrimmable"] += 1
                self.note = f"{path}: its cache cannot be trimmed to the {n} tokens shared; prefilled instead"
                return None, 0
            entry["used"] = time.time()
            self._write(index)
        return cache, n

    def save(self, tokens: list[int], cache) -> bool:
        """Store `cache` (holding exactly `tokens`), drop the stored caches of this identity it
        extends (it can be trimmed to them), then the least recently used beyond the size bound.
        Returns whether it was stored."""
        size = bkv.prompt_cache_nbytes(cache)
        if size > self.max_bytes:
            self.counts["too_large"] += 1
            self.note = f"a {size}-byte KV cache is larger than --prompt-cache-size ({self.max_bytes} bytes); not saved"
            return False
        name = f"{self.dir.name}/{hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:32]}.safetensors"
        path = self.root / name
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
        t0, placed = time.perf_counter(), False
        try:
            with self._locked() as index:
                bkv.save_prompt_cache(str(tmp), cache, {"identity": self.identity, "tokens": json.dumps(tokens)})
                os.replace(tmp, path)
                placed = True
                index[name] = {
                    "identity": self.identity,
                    "tokens": tokens,
                    "bytes": path.stat().st_size,
                    "used": time.time(),
                }
                if bkv.can_trim_prompt_cache(cache):
                    for other, e in list(index.items()):
                        if (
                            other != name
                            and e["identity"] == self.identity
                            and len(e["tokens"]) < len(tokens)
                            and tokens[: len(e["tokens"])] == e["tokens"]
                        ):
                            self._remove(index, other, "replaced")
                total = self._evict(index, keep=name)
                stored = total <= self.max_bytes  # else the file alone (header included) is over the bound
                if not stored:
                    self.note = f"{path}: {total} bytes, more than --prompt-cache-size ({self.max_bytes}); removed"
                    self._remove(index, name, "too_large")
                self._write(index)
        except Exception as e:  # noqa: BLE001 - a full disk, DIR removed, a cache mlx-lm cannot save: keep serving
            tmp.unlink(missing_ok=True)
            if placed:  # renamed into place, but the index could not be written: it would be held unbounded
                path.unlink(missing_ok=True)
            self.counts["failed"] += 1
            self.note = f"saving {path} failed: {e}"
            return False
        self.counts["saved"] += stored
        self.last_save_s = time.perf_counter() - t0
        return stored

    def _remove(self, index: dict, name: str, why: str) -> None:
        (self.root / name).unlink(missing_ok=True)
        index.pop(name)
        self.counts[why] += 1

    def stats(self) -> dict:
        """Where, how much, and what happened: counts, the last save's seconds and the last note."""
        return {
            "dir": str(self.root),
            "identity": self.identity[:32],
            "max_bytes": self.max_bytes,
            "bytes": self.bytes,
            "entries": self.entries,
            **self.counts,
            "last_save_s": self.last_save_s,
            "note": self.note,
        }
