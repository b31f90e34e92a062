"""KV caches of finished conversations on disk (DiskPromptCaches), so a restarted process reuses a
matching prefix; an LRU bound over the directory, shared between processes under a file lock."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import time
from contextlib import contextmanager
from pathlib import Path

from edge0.backend import kvcache as bkv
from edge0.errors import Edge0Error
from edge0.store.headers import read_header
from edge0.store.ownfiles import check_owner, file_version, make_private, read_regular, unlink_regular
from edge0.store.promptcache_names import (
    _ENTRY,
    _FILE,
    _FILE_TMP,
    _FOLDER,
    _INDEX_TMP,
    MIN_TOKENS,
    _before_index,
    _check_namespace,
    _continues,
    _entry_ok,
)


class DiskPromptCaches:
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

    INDEX = "index.json"
    VERSION = 2

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

    def _check_own(self) -> None:
        """Refuse a DIR holding names the cache does not write and no index of its own (someone
        else's folder, where it must write nothing), and a DIR/.lock that is a link or no file."""
        check_owner(self.root, os.lstat(self.root))
        for name in (".lock", self.INDEX):
            path = self.root / name
            if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
                raise Edge0Error(f"--prompt-cache-dir {self.root}: {path} is not a regular file (a link?); remove it")
        names = os.listdir(self.root)
        # its .lock (made at every start) vouches for a damaged index of its own, rebuilt below
        if names and ".lock" not in names and not self._own_index():
            other = sorted(n for n in names if not _before_index(n))
            if other:
                shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
                raise Edge0Error(
                    f"--prompt-cache-dir {self.root} holds files this prompt cache did not write "
                    f"({shown}) and no index of its own; pass an empty directory or one this server created"
                )

    def _own_index(self) -> bool:
        """Whether DIR/index.json is an index this cache wrote (of any version)."""
        try:
            data = json.loads(read_regular(self.root / self.INDEX))
        except (OSError, ValueError, RecursionError):
            return False
        return isinstance(data, dict) and isinstance(data.get("version"), int) and isinstance(data.get("entries"), dict)

    # -- the index -------------------------------------------------------------------------------
    @contextmanager
    def _locked(self):
        """The index, read under DIR/.lock (held until the block ends), which is opened without
        truncating it and never through a link."""
        lock = self.root / ".lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{lock} is not a regular file; remove it")
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield self._read()
        finally:
            os.close(fd)

    def _read(self) -> dict:
        """The index, each entry's `bytes` from its file (an entry whose file is gone or is not a
        regular file is dropped); rebuilt from the files when missing, damaged or of another version."""
        path = self.root / self.INDEX
        try:
            data = json.loads(read_regular(path))
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("unexpected contents")
            if data.get("version") != self.VERSION:
                self.counts["index_rebuilt"] += 1
                entries = self._scan(f"{path} is of version {data.get('version')}, not {self.VERSION}")
                self._write(entries)
                return entries
            entries = data["entries"]
            if not all(_ENTRY.fullmatch(name) and _entry_ok(e) for name, e in entries.items()):
                raise ValueError("unexpected contents")
        except FileNotFoundError:
            return self._scan("")
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
            self.counts["index_rebuilt"] += 1
            entries = self._scan(f"{path} was damaged ({e})")
            self._write(entries)
            return entries
        for name in list(entries):
            st = self._stat(name)
            if st is None:
                del entries[name]
            else:
                entries[name]["bytes"] = st.st_size
        return entries

    def _stat(self, name: str) -> os.stat_result | None:
        """Cache file `name`'s stat if it is a regular file in a real folder of DIR (no link followed)."""
        try:
            folder, st = os.lstat(self.root / name.split("/")[0]), os.lstat(self.root / name)
        except OSError:
            return None
        return st if stat.S_ISDIR(folder.st_mode) and stat.S_ISREG(st.st_mode) else None

    def _survey(self) -> dict:
        """DIR's cache files, name -> stat: regular files of the names save() writes, in real folders
        of the names it makes. On the way: removes the temporaries of a process that died mid-write
        (files are written only under the lock, which the caller holds), makes what the cache owns
        private, and counts the other entries `skipped`, leaving them as they are."""
        files, skipped = {}, 0
        with os.scandir(self.root) as top:
            for d in top:
                st = d.stat(follow_symlinks=False)
                regular = stat.S_ISREG(st.st_mode)
                if regular and d.name in (".lock", self.INDEX):
                    make_private(d.path, st, 0o600)
                elif regular and _INDEX_TMP.fullmatch(d.name):
                    os.unlink(d.path)
                elif stat.S_ISDIR(st.st_mode) and _FOLDER.fullmatch(d.name):
                    make_private(d.path, st, 0o700)
                    with os.scandir(d.path) as folder:
                        for f in folder:
                            fst = f.stat(follow_symlinks=False)
                            if stat.S_ISREG(fst.st_mode) and _FILE.fullmatch(f.name):
                                make_private(f.path, fst, 0o600)
                                files[f"{d.name}/{f.name}"] = fst
                            elif stat.S_ISREG(fst.st_mode) and _FILE_TMP.fullmatch(f.name):
                                os.unlink(f.path)
                            else:
                                skipped += 1
                else:
                    skipped += 1
        self.counts["skipped"] = skipped
        return files

    def _entry(self, name: str, st: os.stat_result) -> dict | None:
        """An index entry from cache file `name`'s own metadata; None, and the file removed, if it is
        damaged (unreadable, or without the identity, namespace, tokens or checksum save() writes)."""
        try:
            meta = bkv.prompt_cache_metadata(read_header(self.root / name).metadata)
            entry = {
                "identity": meta.get("identity"),
                "namespace": meta.get("namespace"),
                "tokens": json.loads(meta.get("tokens", "null")),
                "prompt_end": json.loads(meta.get("prompt_end", "0")),  # 0: unknown (an older edge0's file)
                "bytes": st.st_size,
                "used": st.st_mtime,
            }
            if not _entry_ok(entry) or not isinstance(meta.get("checksum"), str):
                raise ValueError("no identity, namespace, tokens, prompt end or checksum in its metadata")
        except OSError as e:  # unreadable now (another user's file, EMFILE): not damage, left as it is
            self.counts["failed"] += 1
            self.note = f"reading {self.root / name} failed: {e}; left as it is"
            return None
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            self._refuse(name, e)
            return None
        return entry

    def _scan(self, why: str) -> dict:
        """The index rebuilt from the cache files' own metadata (damaged ones removed); `why` noted."""
        entries = {}
        for name, st in sorted(self._survey().items()):
            entry = self._entry(name, st)
            if entry is not None:
                entries[name] = entry
        if why or entries:
            why = why or f"{self.root / self.INDEX} was missing"
            self.note = f"{why}; rebuilt: {len(entries)} cache files indexed from their metadata"
        return entries

    def _adopt_orphans(self, index: dict) -> None:
        """Index the cache files the index lacks (a process stopped between renaming a file into
        place and writing the index), so that the bound holds after a crash."""
        files = self._survey()
        orphans = {name: self._entry(name, files[name]) for name in sorted(files.keys() - index.keys())}
        orphans = {name: e for name, e in orphans.items() if e is not None}
        if orphans:
            index.update(orphans)
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
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
            with os.fdopen(fd, "w") as fh:
                os.fchmod(fd, 0o600)  # a temporary left with other modes keeps them through O_CREAT
                fh.write(json.dumps({"version": self.VERSION, "entries": entries}))
            os.replace(tmp, self.root / self.INDEX)
        except OSError:  # a full disk: the index stays as it was, without a temporary beside it
            unlink_regular(tmp)
            raise
        self.bytes, self.entries = sum(e["bytes"] for e in entries.values()), len(entries)

    def _refuse(self, name: str, error) -> None:
        """A damaged cache file (of the names the cache writes): counted, noted and removed."""
        self.counts["damaged"] += 1
        self.note = f"{self.root / name}: damaged ({error}); removed"
        self._unlink(name)

    def _unlink(self, name: str) -> None:
        if self._stat(name) is not None:
            (self.root / name).unlink(missing_ok=True)

    def _remove(self, index: dict, name: str, why: str) -> None:
        self._unlink(name)
        index.pop(name)
        self.counts[why] += 1

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
