"""KV caches of finished conversations on disk (DiskPromptCaches), so a restarted process reuses a
matching prefix; an LRU bound over the directory, shared between processes under a file lock."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path

from edge0.backend import kvcache as bkv
from edge0.errors import Edge0Error
from edge0.store.ownfiles import check_owner, file_version, make_private, unlink_regular
from edge0.store.promptcache_index import PromptCacheIndex
from edge0.store.promptcache_names import (
    MIN_TOKENS,
    _check_namespace,
    _continues,
)


class DiskPromptCaches(PromptCacheIndex):
    """KV caches of finished conversations on disk, so a restarted process reuses a matching
    prefix: mlx-lm `save_prompt_cache` files DIR/<identity>/<hash of namespace and tokens>.safetensors
    (their metadata holds the identity, namespace, tokens and a sha256 of the KV arrays) and
    DIR/index.json (every file's identity, namespace, tokens and last use; sizes are read from the
    files, never from the index). Beyond `max_bytes`, all identities together, the least recently
    used files are removed. The identity covers everything the KV depends on (Engine.identity); a
    namespace (an opaque hex digest, "" the shared one) keeps clients' conversations apart.

    The cache reads, replaces and removes only regular files of the names it writes (above), never
    through a link; other entries (other names, links, FIFOs, folders named like its files) are left
    as they are and counted `skipped`. It refuses to start in a non-empty DIR that holds other names
    and no index of its own (a models folder, a store, a snapshot). A file of its own naming is
    its own: one that does not load, lacks the checksum or fails it is damaged (removed, counted and
    noted, never fatal). An index of another version (1: written by an older edge0, whose files
    carry no checksum, so they are removed as damaged) or a damaged one is rebuilt from the files'
    metadata. Folders are 0700 and files 0600: the index holds every conversation's tokens; a DIR or
    folder of another user's, or writable by others, is refused (a link or a cache file planted
    there could redirect a write or answer a prompt). A file it cannot read now (an I/O or memory
    error) is counted `failed` and kept; only a file whose contents are wrong is damaged.

    Processes sharing DIR take DIR/.lock for every index update and file write. Files are written
    to a temporary name and renamed."""

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
            "redundant": 0,
            "too_large": 0,
            "damaged": 0,
            "index_rebuilt": 0,
            "untrimmable": 0,
            "failed": 0,
            "incomplete": 0,  # across ranks: another rank had no share of the file restored here
            "skipped": 0,  # entries of DIR that are not the cache's, at the last look (a gauge)
        }
        self.note = ""  # the last refusal or failure
        self.last_save_s: float | None = None
        self.bytes = self.entries = 0
        # what the last restore() read, (name, file_version), for discard() if a forward on it fails
        self.last_restore: tuple | None = None
        self.last_tokens: list[int] | None = None  # the tokens of the file the last restore() read
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._check_own()
            make_private(self.root, os.stat(self.root), 0o700)
            with self._locked() as index:
                self._adopt_orphans(index)
                self._evict(index)
                self._write(index)
        except OSError as e:
            where = e.filename or root
            raise Edge0Error(
                f"--prompt-cache-dir {root}: {where}: {e.strerror or e}; pass a directory this process can write"
            ) from None
        if not self.note and self.counts["skipped"]:
            self.note = f"{self.counts['skipped']} entries in {self.root} are not this cache's; left as they are"

    # -- restore and save --------------------------------------------------------------------------
    def restore(self, tokens: list[int], longer_than: int = 0, namespace: str = ""):
        """(cache, n): a stored cache of this identity and `namespace` sharing the longest prefix
        n > `longer_than`, and at least MIN_TOKENS, with `tokens` (all but the last token, which
        must be fed), trimmed to n; or (None, 0)."""
        _check_namespace(namespace)
        self.last_restore = self.last_tokens = None
        try:
            found = self._restore(tokens, longer_than, namespace)
        except OSError as e:  # DIR removed or unreadable while serving: prefill instead
            self.counts["failed"] += 1
            self.note = f"reading {self.root} failed: {e}"
            return None, 0
        if found[0] is not None:
            self.counts["restored"] += 1
            self.counts["restored_tokens"] += found[1]
        return found

    def _restore(self, tokens: list[int], longer_than: int, namespace: str):
        with self._locked() as index:
            best, n = None, max(longer_than, MIN_TOKENS - 1)
            for name, entry in index.items():
                if entry["identity"] == self.identity and entry["namespace"] == namespace:
                    k = bkv.common_prefix_len(entry["tokens"], tokens[:-1])
                    if k > n:
                        best, n = name, k
            if best is None:
                return None, 0
            return self._load(index, best, n)

    def restore_entry(self, namespace: str, tokens: list[int], n: int) -> tuple[list | None, str]:
        """(the stored cache of this identity and `namespace` holding exactly `tokens`, trimmed to
        its first `n` tokens, "ok"), or (None, "missing": no such file, or a damaged one now
        removed; "declined": it could not be read or trimmed now): a pipeline rank's share of the
        file rank 0 restored."""
        _check_namespace(namespace)
        digest = hashlib.sha256(json.dumps([namespace, tokens]).encode()).hexdigest()[:32]
        name = f"{self.dir.name}/{digest}.safetensors"
        try:
            with self._locked() as index:
                entry = index.get(name)
                if entry is None or (entry["identity"], entry["namespace"], entry["tokens"]) != (
                    self.identity,
                    namespace,
                    tokens,
                ):
                    return None, "missing"
                damaged = self.counts["damaged"]
                cache, got = self._load(index, name, n)
        except OSError as e:
            self.counts["failed"] += 1
            self.note = f"reading {self.root} failed: {e}"
            return None, "declined"
        if cache is None:
            return None, "missing" if self.counts["damaged"] > damaged else "declined"
        self.counts["restored"] += 1
        self.counts["restored_tokens"] += got
        return cache, "ok"

    def _load(self, index: dict, best: str, n: int):
        """(the cache of file `best`, trimmed to `n` tokens, n), or (None, 0) (under the lock)."""
        entry, path = index[best], self.root / best
        st = os.lstat(path)
        try:
            cache, meta = bkv.read_prompt_cache(str(path))
            if (meta.get("identity"), meta.get("namespace")) != (self.identity, entry["namespace"]) or json.loads(
                meta.get("tokens", "null")
            ) != entry["tokens"]:
                raise ValueError("its metadata does not match the index")
            if meta.get("checksum") != bkv.prompt_cache_digest(cache):  # before trimming: the file's arrays
                raise ValueError("its KV data does not match its checksum")
        except (OSError, MemoryError) as e:  # reading failed, not the file: it stays for a later request
            self.counts["failed"] += 1
            self.note = f"reading {path} failed: {e}; prefilled instead"
            return None, 0
        except Exception as e:  # noqa: BLE001 - whatever a damaged file raises, it is refused
            index.pop(best)
            self._refuse(best, e)
            self._write(index)
            return None, 0
        held = len(entry["tokens"])
        if n < held and not (bkv.can_trim_prompt_cache(cache) and bkv.trim_prompt_cache(cache, held - n) == held - n):
            self.counts["untrimmable"] += 1
            self.note = f"{path}: its cache cannot be trimmed to the {n} tokens shared; prefilled instead"
            return None, 0
        entry["used"] = time.time()
        self._write(index)
        self.last_restore, self.last_tokens = (best, file_version(st)), entry["tokens"]
        return cache, n

    def discard(self, receipt, error, why: str = "damaged") -> bool:
        """A forward on a restored cache raised `error`: its file (`receipt`, the restore's
        `last_restore`), if still the one read, is removed and counted damaged (or `why`: across
        ranks, `incomplete` when another rank had no share of it), so no later request restores
        it. Returns whether a file was removed."""
        if receipt is None:
            return False
        name, read = receipt
        try:
            with self._locked() as index:
                st = self._stat(name)
                if st is None or file_version(st) != read:  # removed, or written again, since
                    return False
                index.pop(name, None)
                if why == "damaged":
                    self._refuse(name, f"a forward on its restored cache failed: {error}")
                else:
                    self._unlink(name)
                    self.counts[why] += 1
                    self.note = f"{self.root / name}: {error}; removed"
                self._write(index)
        except OSError as e:
            self.counts["failed"] += 1
            self.note = f"discarding {self.root / name} failed: {e}"
            return False
        return True

    def save(self, tokens: list[int], cache, namespace: str = "", prompt_end: int = 0) -> bool:
        """Store `cache` (holding exactly `tokens`, the first `prompt_end` of them the prompt of the
        request that filled it; 0: unknown) in `namespace`, so that a conversation keeps one file: a
        cache that can be trimmed replaces the stored caches of this identity and namespace whose
        conversation it continues (it holds their whole prompt, `_continues`), removed only once its
        own file is in place and indexed (`replaced`); and it is not written at all when a stored
        one holds all of `tokens` (`redundant`: that file, trimmed, serves what this one would; its
        last use is renewed). Then the least recently used beyond the size bound go. Returns whether
        `tokens` are on disk."""
        _check_namespace(namespace)
        prompt_end = prompt_end if 0 < prompt_end <= len(tokens) else 0
        size = bkv.prompt_cache_nbytes(cache)
        if size > self.max_bytes:
            self.counts["too_large"] += 1
            self.note = f"a {size}-byte KV cache is larger than --prompt-cache-size ({self.max_bytes} bytes); not saved"
            return False
        digest = hashlib.sha256(json.dumps([namespace, tokens]).encode()).hexdigest()[:32]
        name = f"{self.dir.name}/{digest}.safetensors"
        path = self.root / name
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
        t0, placed, trimmable = time.perf_counter(), False, bkv.can_trim_prompt_cache(cache)
        try:
            with self._locked() as index:
                ours = [k for k, e in index.items() if e["identity"] == self.identity and e["namespace"] == namespace]
                holding = [
                    k
                    for k in ours
                    if index[k]["tokens"][: len(tokens)] == tokens
                    and (trimmable or len(index[k]["tokens"]) == len(tokens))
                ]
                if holding:
                    index[holding[0]]["used"] = time.time()
                    self._write(index)
                    self.counts["redundant"] += 1
                    return True
                self._make_dir()
                for p in (path, tmp):  # a link, FIFO or folder there is not the cache's: never written through
                    if os.path.lexists(p) and not stat.S_ISREG(os.lstat(p).st_mode):
                        raise OSError(f"{p} is not a regular file; left as it is")
                unlink_regular(tmp)  # a temporary of a dead process of the same pid
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
                meta = {
                    "identity": self.identity,
                    "namespace": namespace,
                    "tokens": json.dumps(tokens),
                    "prompt_end": json.dumps(prompt_end),
                    "checksum": bkv.prompt_cache_digest(cache),
                }
                bkv.save_prompt_cache(str(tmp), cache, meta)
                os.chmod(tmp, 0o600)
                os.replace(tmp, path)
                placed = True
                # its conversation's older files leave the index now and the directory once it is written
                replaced = [k for k in ours if k != name and trimmable and _continues(tokens, index[k])]
                older = {k: index.pop(k) for k in replaced}
                index[name] = {
                    "identity": self.identity,
                    "namespace": namespace,
                    "tokens": tokens,
                    "prompt_end": prompt_end,
                    "bytes": os.lstat(path).st_size,
                    "used": time.time(),
                }
                total = self._evict(index, keep=name)
                stored = total <= self.max_bytes  # else the file alone (header included) is over the bound
                if not stored:
                    self.note = f"{path}: {total} bytes, more than --prompt-cache-size ({self.max_bytes}); removed"
                    self._remove(index, name, "too_large")
                    index.update(older)  # its conversation keeps the files it has
                    replaced = []
                self._write(index)
                placed = False
                for other in replaced:
                    self._unlink(other)
                    self.counts["replaced"] += 1
        except Exception as e:  # noqa: BLE001 - a full disk, DIR removed, a cache mlx-lm cannot save: keep serving
            unlink_regular(tmp)
            if placed:  # renamed into place, but the index could not be written: it would be held unbounded
                self._unlink(name)
            self.counts["failed"] += 1
            self.note = f"saving {path} failed: {e}"
            return False
        self.counts["saved"] += stored
        self.last_save_s = time.perf_counter() - t0
        return stored

    def _make_dir(self) -> None:
        """This identity's folder, made 0700 if missing; a link or a file in its place is refused."""
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(self.dir)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{self.dir} is not a folder (a link?); left as it is")
        check_owner(self.dir, st)
        make_private(self.dir, st, 0o700)

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
