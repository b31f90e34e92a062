"""The prompt-cache directory's own files and its index (DiskPromptCaches' base,
store/promptcache.py): DIR/index.json under DIR/.lock, rebuilt from the files' metadata when
missing, damaged or of another version; orphans adopted; the LRU bound; damaged files removed.
Only regular files of the names the cache writes are read, replaced or removed, never through
a link."""

from __future__ import annotations

import fcntl
import json
import os
import stat
from contextlib import contextmanager

from edge0.backend import kvcache as bkv
from edge0.errors import Edge0Error
from edge0.store.headers import read_header
from edge0.store.ownfiles import check_owner, make_private, read_regular, unlink_regular
from edge0.store.promptcache_names import _ENTRY, _FILE, _FILE_TMP, _FOLDER, _INDEX_TMP, _before_index, _entry_ok


class PromptCacheIndex:
    """DIR's index and files; the subclass sets `root`, `max_bytes`, `counts`, `note`, `bytes`
    and `entries`."""

    INDEX = "index.json"
    VERSION = 2

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
