"""One file per conversation in the prompt-cache directory (issue 48): a save that continues a stored
conversation (it holds that file's whole prompt: the reply as generated, or as the client renders
it, then a new turn) replaces its file once its own is in place; a save a stored file already holds
is not written; other conversations, branches inside a prompt and other namespaces keep their
files; caches that cannot be trimmed keep each file."""

from __future__ import annotations

import json

import pytest

import edge0
from edge0.backend import kvcache as bkv
from edge0.store.headers import read_header
from edge0.store.promptcache import DiskPromptCaches
from tests.test_prompt_cache_dir import BOUND, IDENT, cache_files

PROMPT = [(7 * i) % 200 + 10 for i in range(120)]
OTHER = [(5 * i) % 200 + 11 for i in range(120)]
BRANCH = PROMPT[:100] + [9] * 40  # another conversation with the same first 100 tokens (a subagent)
# strict growth: each save extends the one before
G1, G2 = PROMPT, PROMPT + [3] * 40
G3 = G2 + [4] * 30
# an agent's turns: prompt, the reply as generated; the next prompt renders that reply its own way
T1, END1 = PROMPT + [8] * 20, len(PROMPT)
T2, END2 = PROMPT + [3] * 25 + [4] * 30 + [8] * 10, len(PROMPT) + 55
T3, END3 = T2[:END2] + [5] * 12 + [6] * 20 + [8] * 10, END2 + 32


@pytest.fixture(scope="module")
def caches(store_for):
    """token list -> a cache holding exactly those tokens, from the fixture model."""
    engine = edge0.load(store_for("qwen3_moe"))
    out = {}
    for tokens in (G1, G2, G3, OTHER, BRANCH, T1, T2, T3):
        engine.generate(tokens, max_tokens=1, reuse_cache=True)
        assert engine.kv.newest.tokens == tokens
        out[tuple(tokens)] = bkv.copy_cache(engine.kv.newest.cache)
    return lambda tokens: bkv.copy_cache(out[tuple(tokens)])


def held_one(path) -> list[int]:
    """The tokens a cache file holds, from its own metadata."""
    return json.loads(bkv.prompt_cache_metadata(read_header(path).metadata)["tokens"])


def held(root) -> list[list[int]]:
    """The tokens of each cache file in `root`, sorted."""
    return sorted(held_one(p) for p in cache_files(root))


@pytest.mark.parametrize("ends", [(0, 0, 0), (len(G1), len(G2), len(G3) - 5)])
def test_a_conversation_saved_at_three_growing_lengths_keeps_one_file(caches, tmp_path, ends):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    for tokens, end in zip((G1, G2, G3), ends):
        assert disk.save(tokens, caches(tokens), prompt_end=end)
        assert held(tmp_path) == [tokens] and disk.stats()["entries"] == 1
    st = disk.stats()
    assert (st["saved"], st["replaced"], st["redundant"]) == (3, 2, 0)
    assert disk.restore(G3 + [1])[1] == len(G3)
    cache, n = disk.restore(PROMPT + [7, 1])  # the longest file, trimmed to the prefix shared
    assert n == len(PROMPT) and bkv.cache_offset(cache) == n
    assert DiskPromptCaches(tmp_path, IDENT, BOUND).restore(G3 + [1])[1] == len(G3)  # a restarted process


def test_the_next_turn_replaces_a_reply_the_client_rendered_its_own_way(caches, tmp_path):
    """The conversation that left 12 files (none replaced): each turn's prompt holds the last
    turn's prompt, then the reply as the client renders it, which differs from the tokens generated."""
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    for tokens, end in ((T1, END1), (T2, END2), (T3, END3)):
        assert disk.save(tokens, caches(tokens), prompt_end=end)
        assert held(tmp_path) == [tokens]
    assert (disk.stats()["replaced"], disk.stats()["entries"]) == (2, 1)
    restarted = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert restarted.restore(T3 + [1])[1] == len(T3)
    assert restarted.restore(T3[:END3] + [7, 7, 1])[1] == END3  # a retry of the last turn: its whole prompt
    # a file whose prompt end is unknown (an older edge0's) is replaced only by a save extending all of it
    other = tmp_path / "unknown"
    disk = DiskPromptCaches(other, IDENT, BOUND)
    assert disk.save(T1, caches(T1)) and disk.save(T2, caches(T2), prompt_end=END2)
    assert held(other) == sorted([T1, T2]) and disk.stats()["replaced"] == 0


def test_two_conversations_keep_two_files(caches, tmp_path):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(T1, caches(T1), prompt_end=END1) and disk.save(OTHER, caches(OTHER), prompt_end=len(OTHER))
    assert disk.save(BRANCH, caches(BRANCH), prompt_end=len(BRANCH))  # shares 100 of T1's 120 prompt tokens
    assert held(tmp_path) == sorted([T1, OTHER, BRANCH]) and disk.stats()["replaced"] == 0
    assert disk.save(T2, caches(T2), prompt_end=END2)  # T1's next turn: its file only
    assert held(tmp_path) == sorted([T2, OTHER, BRANCH]) and disk.stats()["replaced"] == 1
    assert disk.restore(OTHER + [1])[1] == len(OTHER) and disk.restore(BRANCH + [1])[1] == len(BRANCH)


def test_namespaces_never_replace_each_others_files(caches, tmp_path):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(T1, caches(T1), namespace="aa", prompt_end=END1)
    assert disk.save(T2, caches(T2), namespace="bb", prompt_end=END2)  # continues aa's: another namespace
    assert disk.save(G1, caches(G1), namespace="cc")  # aa's file holds these tokens: not for cc
    assert disk.save(G3, caches(G3))  # nor for the shared namespace, which replaces none of them
    st = disk.stats()
    assert (st["entries"], st["replaced"], st["redundant"]) == (4, 0, 0)
    assert disk.save(T2, caches(T2), namespace="aa", prompt_end=END2)  # aa's own next turn
    assert (disk.stats()["entries"], disk.stats()["replaced"]) == (4, 1)
    assert held(tmp_path) == sorted([G1, T2, T2, G3])
    for ns, tokens in (("aa", T2), ("bb", T2), ("cc", G1), ("", G3)):
        assert disk.restore(tokens + [1], namespace=ns)[1] == len(tokens)


def test_a_save_a_stored_file_holds_is_not_written_and_renews_it(caches, tmp_path):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(G3, caches(G3)) and disk.save(OTHER, caches(OTHER))
    (g3,) = [p for p in cache_files(tmp_path) if held_one(p) == G3]
    before = g3.stat().st_mtime_ns
    assert disk.save(G2, caches(G2), prompt_end=len(PROMPT))  # on disk already, within G3's file
    assert disk.save(G3, caches(G3))  # the same tokens again
    st = disk.stats()
    assert (st["saved"], st["redundant"], st["entries"]) == (2, 2, 2) and g3.stat().st_mtime_ns == before
    # its last use was renewed: a bound for one file keeps it, not OTHER (saved after it)
    one = DiskPromptCaches(tmp_path, IDENT, g3.stat().st_size + 1)
    assert held(tmp_path) == [G3] and one.stats()["evicted"] == 1


def test_caches_that_cannot_be_trimmed_keep_each_file(caches, tmp_path, monkeypatch):
    """A cache of recurrent state is reused only where it ends: the shorter file serves requests
    the longer cannot, so it stays; only the same tokens again are not written."""
    monkeypatch.setattr(bkv, "can_trim_prompt_cache", lambda cache: False)
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(G1, caches(G1)) and disk.save(G2, caches(G2)) and disk.save(T1, caches(T1), prompt_end=END1)
    assert disk.save(T2, caches(T2), prompt_end=END2) and disk.save(G1, caches(G1))
    st = disk.stats()
    assert held(tmp_path) == sorted([G1, G2, T1, T2])
    assert (st["saved"], st["replaced"], st["redundant"]) == (4, 0, 1)


def test_the_older_file_stays_until_the_new_one_is_indexed(caches, tmp_path, monkeypatch):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(T1, caches(T1), prompt_end=END1)
    write = disk._write

    def full(entries):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "_write", full)
    assert not disk.save(T2, caches(T2), prompt_end=END2)
    st = disk.stats()
    assert (st["failed"], st["replaced"]) == (1, 0) and "No space left" in st["note"]
    assert held(tmp_path) == [T1] and not list(tmp_path.glob("*/.*.tmp.*"))  # the new file gone, the old kept
    monkeypatch.setattr(disk, "_write", write)
    assert disk.restore(T1 + [1])[1] == len(T1)


def test_the_prompt_end_is_in_the_files_and_checked_in_the_index(caches, tmp_path):
    disk = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert disk.save(T1, caches(T1), prompt_end=END1)
    (tmp_path / "index.json").unlink()  # the index lost: rebuilt from the files' metadata, prompt end included
    rebuilt = DiskPromptCaches(tmp_path, IDENT, BOUND)
    assert rebuilt.save(T2, caches(T2), prompt_end=END2) and held(tmp_path) == [T2]
    assert rebuilt.stats()["replaced"] == 1
    index = json.loads((tmp_path / "index.json").read_text())
    (name,) = index["entries"]
    assert index["entries"][name]["prompt_end"] == END2
    for bad in (-1, "7", True, 1.5):  # an index naming another prompt end is damaged: rebuilt from the files
        index["entries"][name]["prompt_end"] = bad
        (tmp_path / "index.json").write_text(json.dumps(index))
        again = DiskPromptCaches(tmp_path, IDENT, BOUND)
        assert again.stats()["index_rebuilt"] == 1 and again.restore(T2 + [1])[1] == len(T2)
    # a prompt end past the tokens (or none) is stored as unknown: only a save extending all of them replaces it
    assert again.save(OTHER, caches(OTHER), prompt_end=len(OTHER) + 5)
    entries = json.loads((tmp_path / "index.json").read_text())["entries"].values()
    assert sorted((e["tokens"], e["prompt_end"]) for e in entries) == sorted([(T2, END2), (OTHER, 0)])
