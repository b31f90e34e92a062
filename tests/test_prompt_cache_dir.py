"""The prompt-cache directory under hostile contents (issue 46): it touches only the names it writes,
refuses a folder of someone else's files, skips links, FIFOs and folders named like its files,
checks each file's KV against its checksum, restores at least one block, keeps namespaces apart,
and keeps conversations private (0700 folders, 0600 files)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
from pathlib import Path

import pytest

import edge0
from edge0.backend import kvcache as bkv
from edge0.errors import Edge0Error
from edge0.store.promptcache import DiskPromptCaches

IDENT = "ab" * 32
PROMPT = [(7 * i) % 200 + 10 for i in range(120)]
OTHER = [(5 * i) % 200 + 11 for i in range(120)]
BOUND = 1 << 30


@pytest.fixture(scope="module")
def caches(store_for):
    """token list -> a cache holding exactly those tokens, from the fixture model."""
    engine = edge0.load(store_for("qwen3_moe"))
    out = {}
    for tokens in (PROMPT, OTHER, PROMPT + [3] * 40):
        engine.generate(tokens, max_tokens=1, reuse_cache=True)
        assert engine.kv.newest.tokens == tokens
        out[tuple(tokens)] = bkv.copy_cache(engine.kv.newest.cache)
    return lambda tokens: bkv.copy_cache(out[tuple(tokens)])


def snapshot(root: Path) -> dict:
    """Every path under `root` (links not followed) -> its bytes, link target or kind."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[p] = ("link", os.readlink(p))
        elif p.is_file():
            out[p] = p.read_bytes()
        else:
            out[p] = "fifo" if stat.S_ISFIFO(p.lstat().st_mode) else "dir"
    return out


def within(seconds: float, fn, fifos=()):
    """fn() in a thread; a call blocked on a FIFO past `seconds` fails the test (the FIFOs are then
    opened for writing, which releases it)."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for f in fifos:
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail(f"blocked for more than {seconds} s (on a FIFO)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def cache_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*.safetensors") if p.is_file() and not p.is_symlink())


def test_foreign_files_links_fifos_and_folders_are_never_touched(caches, tmp_path):
    root, outside = tmp_path / "pc", tmp_path / "outside"
    DiskPromptCaches(root, IDENT, BOUND)  # an empty folder: created, with its index
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"outside, keep me")
    (outside / ("c" * 32 + ".safetensors")).write_bytes(b"named like a cache, outside")
    for rel, data in [
        ("other-store/model.safetensors", b"another model's weights"),
        ("other-store/prerouter.safetensors", b"its heads"),
        ("snap/model-00001-of-00002.safetensors", b"a shard"),
        ("notes.txt", b"notes"),
        (f"{IDENT[:32]}/junk.safetensors", b"not a name the cache writes"),
        (f"{IDENT[:32]}/.hidden.tmp", b"nor this"),
    ]:
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_bytes(data)
    fifo = root / IDENT[:32] / ("f" * 32 + ".safetensors")
    os.mkfifo(fifo)
    (root / IDENT[:32] / ("d" * 32 + ".safetensors")).mkdir()  # a folder named like a cache file
    (root / IDENT[:32] / ("e" * 32 + ".safetensors")).symlink_to(outside / "keep.bin")
    (root / ("9" * 32)).symlink_to(outside)  # a link named like an identity folder
    index = json.loads((root / "index.json").read_text())
    entry = {"identity": IDENT, "namespace": "", "tokens": PROMPT, "bytes": 1, "used": 1.0}
    index["entries"][f"{IDENT[:32]}/{fifo.name}"] = entry  # an index naming the FIFO: never opened
    (root / "index.json").write_text(json.dumps(index))
    foreign = snapshot(root)
    before_outside = snapshot(outside)
    # A file of the cache's own naming that is not a cache: its own, damaged, so removed.
    ours = root / ("3" * 32) / ("4" * 32 + ".safetensors")
    ours.parent.mkdir()
    ours.write_bytes(os.urandom(4096))

    disk = within(30, lambda: DiskPromptCaches(root, IDENT, BOUND), [fifo])
    st = disk.stats()
    assert (st["skipped"], st["damaged"], st["entries"]) == (9, 1, 0) and not ours.exists()
    for tokens in (PROMPT, OTHER):
        assert within(30, lambda t=tokens: disk.save(t, caches(t)), [fifo])
    bound = disk.stats()["bytes"] * 3 // 4  # room for one
    restored, n = within(30, lambda: disk.restore(PROMPT + [1]), [fifo])
    assert n == len(PROMPT) and bkv.cache_offset(restored) == n
    small = within(30, lambda: DiskPromptCaches(root, IDENT, bound), [fifo])
    assert (small.stats()["entries"], small.stats()["evicted"]) == (1, 1)
    assert within(30, lambda: small.save(PROMPT + [3] * 40, caches(PROMPT + [3] * 40)), [fifo])

    after = snapshot(root)
    assert {p: after.get(p) for p in foreign if p.name != "index.json"} == {
        p: v for p, v in foreign.items() if p.name != "index.json"
    }  # every foreign entry byte-identical
    assert snapshot(outside) == before_outside


def test_a_link_where_a_save_would_write_is_left(caches, tmp_path):
    root, target = tmp_path / "pc", tmp_path / "precious.txt"
    disk = DiskPromptCaches(root, IDENT, BOUND)
    target.write_text("do not overwrite me")
    name = hashlib.sha256(json.dumps(["", PROMPT]).encode()).hexdigest()[:32]
    (root / IDENT[:32]).mkdir()
    for link in (f"{name}.safetensors", f".{name}.{os.getpid()}.tmp.safetensors"):
        (root / IDENT[:32] / link).symlink_to(target)
        assert not disk.save(PROMPT, caches(PROMPT)) and "not a regular file" in disk.stats()["note"]
        assert target.read_text() == "do not overwrite me" and (root / IDENT[:32] / link).is_symlink()
        (root / IDENT[:32] / link).unlink()
    assert disk.save(PROMPT, caches(PROMPT))


def test_a_symlinked_lock_is_refused_and_its_target_kept(tmp_path):
    root, target = tmp_path / "pc", tmp_path / "precious.txt"
    DiskPromptCaches(root, IDENT, BOUND)
    target.write_text("do not empty me")
    (root / ".lock").unlink()
    (root / ".lock").symlink_to(target)
    with pytest.raises(Edge0Error, match=r"--prompt-cache-dir .*\.lock.* not a regular file.*remove it"):
        DiskPromptCaches(root, IDENT, BOUND)
    assert target.read_text() == "do not empty me"


@pytest.mark.parametrize(
    "files",
    [
        {"other-store/model.safetensors": b"w", "other-store/prerouter.safetensors": b"h"},  # ~/models
        {"model-00001-of-00002.safetensors": b"s", "config.json": b"{}"},  # a Hugging Face snapshot
        {"index.json": b'{"weight_map": {}}'},  # someone else's index
        # names like the cache's own, but no .lock and no index of it: not the cache's either
        {f"{'0' * 32}/{'f' * 32}.safetensors": b"foreign data", f"{'0' * 32}/.{'f' * 32}.7.tmp.safetensors": b"x"},
    ],
)
def test_a_folder_of_other_files_without_an_index_is_refused(tmp_path, files):
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    before = snapshot(tmp_path)
    with pytest.raises(Edge0Error, match=f"--prompt-cache-dir {re.escape(str(tmp_path))} .*pass an empty directory or"):
        DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert snapshot(tmp_path) == before  # nothing written either (no .lock)


def test_folders_it_may_use(tmp_path):
    DiskPromptCaches(tmp_path / "new" / "pc", IDENT, BOUND)  # missing: created
    (tmp_path / "empty").mkdir()
    DiskPromptCaches(tmp_path / "empty", IDENT, BOUND)
    own = tmp_path / "own"  # only names the cache writes, its index lost
    (own / ("1" * 32)).mkdir(parents=True)
    (own / ".lock").touch()
    DiskPromptCaches(own, IDENT, BOUND)
    assert json.loads((own / "index.json").read_text())["version"] == DiskPromptCaches.VERSION


def test_an_index_of_version_1_deletes_nothing_it_did_not_write(caches, tmp_path):
    """A folder an older edge0 wrote: its files carry no checksum, so they are removed and counted
    damaged; everything else stays."""
    folder = tmp_path / IDENT[:32]
    folder.mkdir()
    old = folder / ("2" * 32 + ".safetensors")
    bkv.save_prompt_cache(str(old), caches(PROMPT), {"identity": IDENT, "tokens": json.dumps(PROMPT)})
    entry = {"identity": IDENT, "tokens": PROMPT, "bytes": old.stat().st_size, "used": 1.0}
    (tmp_path / "index.json").write_text(json.dumps({"version": 1, "entries": {f"{IDENT[:32]}/{old.name}": entry}}))
    (tmp_path / "other-store").mkdir()
    (tmp_path / "other-store" / "model.safetensors").write_bytes(b"weights")
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    st = disk.stats()
    assert (st["damaged"], st["index_rebuilt"], st["entries"]) == (1, 1, 0) and not old.exists()
    assert (tmp_path / "other-store" / "model.safetensors").read_bytes() == b"weights"
    assert disk.restore(PROMPT + [1]) == (None, 0)


@pytest.mark.parametrize("fill", ["nan", "random"])
def test_a_damaged_file_that_still_loads_is_refused(caches, tmp_path, fill):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(PROMPT, caches(PROMPT))
    (path,) = cache_files(tmp_path)
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little") if fill == "nan" else 0  # NaN: the header kept, so it loads
    path.write_bytes(data[:start] + (b"\xff" * len(data) if fill == "nan" else os.urandom(len(data)))[start:])
    assert disk.restore(PROMPT + [1]) == (None, 0)
    st = disk.stats()
    assert (st["damaged"], st["restored"], st["entries"]) == (1, 0, 0) and path.name in st["note"]
    assert not path.exists()


def test_a_restore_is_at_least_one_block(caches, tmp_path):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(PROMPT, caches(PROMPT))
    assert disk.restore(PROMPT[:63] + [999, 1]) == (None, 0)  # 63 tokens shared: prefilled
    cache, n = disk.restore(PROMPT[:64] + [999, 1])
    assert n == 64 and bkv.cache_offset(cache) == 64
    assert disk.restore(PROMPT + [1], longer_than=len(PROMPT)) == (None, 0)


def test_a_restore_whose_forward_failed_is_discarded(caches, tmp_path):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(PROMPT, caches(PROMPT)) and disk.save(OTHER, caches(OTHER))
    assert disk.restore(PROMPT + [1])[1] == len(PROMPT)
    receipt = disk.last_restore
    assert disk.discard(receipt, RuntimeError("NaN logits"))
    st = disk.stats()
    assert (st["damaged"], st["entries"]) == (1, 1) and "NaN logits" in st["note"]
    assert not disk.discard(receipt, RuntimeError("again"))  # gone already
    assert not disk.discard(None, RuntimeError("nothing restored"))
    assert disk.restore(PROMPT + [1]) == (None, 0) and disk.last_restore is None
    assert disk.restore(OTHER + [1])[1] == len(OTHER)
    receipt = disk.last_restore
    (path,) = cache_files(tmp_path)
    (path.parent / "rewritten").write_bytes(path.read_bytes())
    os.replace(path.parent / "rewritten", path)  # written again since (another process)
    assert not disk.discard(receipt, RuntimeError("late"))  # not the file it read: kept
    assert disk.restore(OTHER + [1])[1] == len(OTHER)


def test_namespaces_never_share(caches, tmp_path):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(PROMPT, caches(PROMPT), namespace="aa")
    assert disk.restore(PROMPT + [1]) == (None, 0)
    assert disk.restore(PROMPT + [1], namespace="bb") == (None, 0)
    assert disk.restore(PROMPT + [1], namespace="aa")[1] == len(PROMPT)
    assert disk.save(PROMPT, caches(PROMPT))  # the same tokens in the shared namespace: another file
    longer = PROMPT + [3] * 40
    assert disk.save(longer, caches(longer), namespace="bb")  # replaces neither of them
    assert (disk.stats()["entries"], disk.stats()["replaced"]) == (3, 0)
    assert disk.restore(longer + [1], namespace="aa")[1] == len(PROMPT)
    assert disk.save(longer, caches(longer), namespace="aa")  # replaces aa's shorter one only
    assert (disk.stats()["entries"], disk.stats()["replaced"]) == (3, 1)
    assert disk.restore(longer + [1])[1] == len(PROMPT)
    restarted = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert restarted.restore(longer + [1], namespace="cc") == (None, 0)
    assert restarted.restore(longer + [1], namespace="bb")[1] == len(longer)
    with pytest.raises(ValueError, match="namespace"):
        disk.restore(PROMPT + [1], namespace="../x")


def test_sizes_come_from_the_files_not_the_index(caches, tmp_path):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(PROMPT, caches(PROMPT)) and disk.save(OTHER, caches(OTHER))
    real = sum(p.stat().st_size for p in cache_files(tmp_path))
    index = json.loads((tmp_path / "index.json").read_text())
    for e in index["entries"].values():
        e["bytes"] = -(10**12)  # hand-edited: would let the folder grow without bound
    (tmp_path / "index.json").write_text(json.dumps(index))
    reopened = DiskPromptCaches(tmp_path, IDENT, real - 1)  # room for one of the two
    st = reopened.stats()
    assert (st["entries"], st["evicted"]) == (1, 1) and 0 < st["bytes"] < real


def test_folders_0700_and_files_0600_under_any_umask(caches, tmp_path):
    old = os.umask(0)
    try:
        root = tmp_path / "pc"
        disk = DiskPromptCaches(root, IDENT, BOUND)
        assert disk.save(PROMPT, caches(PROMPT))
        older = tmp_path / "older"  # as an older edge0 left it: world-readable
        older.mkdir(mode=0o755)
        (older / ".lock").touch(mode=0o644)
        (older / "index.json").write_text(json.dumps({"version": DiskPromptCaches.VERSION, "entries": {}}))
        os.chmod(older / "index.json", 0o644)
        shared = older / IDENT[:32]
        shared.mkdir(mode=0o755)
        (shared / "notes.txt").touch(mode=0o644)  # not the cache's: left as it is
        DiskPromptCaches(older, IDENT, BOUND)
    finally:
        os.umask(old)
    for top in (root, older):
        for p in [top, *top.rglob("*")]:
            want = 0o644 if p.name == "notes.txt" else 0o700 if p.is_dir() else 0o600
            assert stat.S_IMODE(p.stat().st_mode) == want, p


def test_a_file_it_cannot_read_now_is_left_not_removed(caches, tmp_path, monkeypatch):
    """An I/O error (EACCES, EMFILE, EIO) or memory error while restoring is not damage: counted
    failed, the file kept for a later request."""
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(PROMPT, caches(PROMPT))
    (path,) = cache_files(tmp_path)

    def unreadable(_path):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(bkv, "read_prompt_cache", unreadable)
    assert disk.restore(PROMPT + [1]) == (None, 0)
    st = disk.stats()
    assert (st["failed"], st["damaged"], st["entries"]) == (1, 0, 1) and path.exists()
    monkeypatch.undo()
    assert disk.restore(PROMPT + [1])[1] == len(PROMPT)


def test_a_folder_writable_by_others_or_theirs_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(Edge0Error, match="writable by other users; chmod 700"):
        DiskPromptCaches(shared, IDENT, BOUND)
    assert os.listdir(shared) == []


def test_a_damaged_index_that_is_not_a_file_or_too_deep_is_one_line(tmp_path):
    (tmp_path / "a" / "index.json").mkdir(parents=True)
    with pytest.raises(Edge0Error, match=r"index.json is not a regular file .*remove it"):
        DiskPromptCaches(tmp_path / "a", IDENT, BOUND)
    deep = tmp_path / "b"
    deep.mkdir()
    (deep / ".lock").touch()
    (deep / "index.json").write_text("[" * 200_000 + "]" * 200_000)
    disk = DiskPromptCaches(deep, IDENT, BOUND)  # its own, damaged: rebuilt
    assert disk.stats()["index_rebuilt"] == 1
