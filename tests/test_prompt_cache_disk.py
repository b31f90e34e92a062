"""Prompt caches on disk (--prompt-cache-dir): a restarted engine or server reuses the KV cache of a
saved conversation it extends and gives the tokens of a fresh run; another identity does not reuse
it; the size bound removes the least recently used; damaged files (a checksum of the KV catches
one that still loads) and indexes are refused and counted, never fatal."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

import edge0
from edge0.errors import Edge0Error
from edge0.options import LoadOptions
from edge0.server.config import ServerConfig
from tests.fake_server import running_server
from tests.test_lora import random_adapter

PROMPT = [(7 * i) % 200 + 10 for i in range(300)]
NEW = [(3 * i) % 200 + 10 for i in range(40)]


@pytest.fixture(scope="module")
def store(store_for):
    return store_for("qwen3_moe")


def disk(engine) -> dict:
    return engine.stats()["prompt_cache"]


def test_a_restarted_engine_prefills_only_the_new_tokens(store, tmp_path):
    first = edge0.load(store, prompt_cache_dir=tmp_path)
    r1 = first.generate(PROMPT, max_tokens=8, reuse_cache=True, ignore_eos=True)
    held = len(PROMPT) + 7  # the last generated token was never fed
    assert (disk(first)["saved"], disk(first)["entries"], disk(first)["tokens"]) == (1, 1, held)
    assert not first.persist_prompt_cache()  # nothing new since the save
    follow = PROMPT + r1.tokens + NEW
    want = edge0.load(store).generate(follow, max_tokens=8, ignore_eos=True).tokens

    restarted = edge0.load(store, prompt_cache_dir=tmp_path)
    r2 = restarted.generate(follow, max_tokens=8, reuse_cache=True, ignore_eos=True)
    assert r2.stats["prefill_tokens"] == len(follow) - held and r2.tokens == want
    st = disk(restarted)
    assert (st["restored"], st["restored_tokens"], st["saved"]) == (1, held, 1)
    assert (st["replaced"], st["entries"]) == (1, 1)  # the longer conversation replaces the one it extends
    assert st["last_save_s"] > 0 and st["note"] == ""

    plain = edge0.load(store, prompt_cache_dir=tmp_path)  # without reuse_cache: nothing read or written
    assert plain.generate(follow, max_tokens=8).stats["prefill_tokens"] == len(follow)
    assert (disk(plain)["restored"], disk(plain)["saved"]) == (0, 0)


def test_a_conversation_whose_client_renders_the_replies_keeps_one_file(store, tmp_path):
    """Each turn's prompt holds the last one's, then the reply as the client renders it (not the
    tokens generated), then a new turn: each save replaces the last (issue 48: 12 files, none
    replaced), and a restarted engine resumes from the one left."""
    engine = edge0.load(store, prompt_cache_dir=tmp_path, prompt_cache_memory=0)
    prompt = PROMPT
    for turn in range(3):
        engine.generate(prompt, max_tokens=8, reuse_cache=True, ignore_eos=True)  # saved after it
        assert (disk(engine)["saved"], disk(engine)["entries"], disk(engine)["replaced"]) == (turn + 1, 1, turn)
        prompt = prompt + [5, 6, 7] + [(11 * i + turn) % 200 + 10 for i in range(60)]
    restarted = edge0.load(store, prompt_cache_dir=tmp_path)
    r = restarted.generate(prompt, max_tokens=1, reuse_cache=True)
    assert r.stats["prefill_tokens"] == 63 and disk(restarted)["restored"] == 1


def test_a_restarted_server_reuses_the_saved_conversation(store, tmp_path):
    """The server saves between requests (after the response) and a new server process reuses it."""
    messages = [{"role": "user", "content": "hello world, " * 20}]

    def chat(engine, base, messages):
        return httpx.post(
            base + "/v1/chat/completions",
            timeout=60,
            json={"model": engine.model_id, "messages": messages, "max_tokens": 6, "temperature": 0},
        ).json()

    engine = edge0.load(store, prompt_cache_dir=tmp_path)
    with running_server(engine, ServerConfig()) as base:
        first = chat(engine, base, messages)
        deadline = time.monotonic() + 10
        while httpx.get(base + "/v1/stats").json()["engine"]["prompt_cache"]["saved"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    follow = messages + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and more"},
    ]
    want = edge0.load(store).chat(follow, max_tokens=6).text
    restarted = edge0.load(store, prompt_cache_dir=tmp_path)
    with running_server(restarted, ServerConfig()) as base:
        second = chat(restarted, base, follow)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    assert second["choices"][0]["message"]["content"] == want


def test_another_identity_does_not_reuse(store, tmp_path):
    base = edge0.load(store, prompt_cache_dir=tmp_path / "pc", prerouter=False)
    r1 = base.generate(PROMPT, max_tokens=8, reuse_cache=True)
    follow = PROMPT + r1.tokens + NEW
    adapter = random_adapter(store, tmp_path / "lora.safetensors")[0]
    others = [
        edge0.load(store, prompt_cache_dir=tmp_path / "pc", prerouter=False, top_k=1),
        edge0.load(store, prompt_cache_dir=tmp_path / "pc", prerouter=False, lora=adapter),
    ]
    for other in others:
        assert other.generate(follow, max_tokens=4, reuse_cache=True).stats["prefill_tokens"] == len(follow)
        assert disk(other)["restored"] == 0
    identities = {e.identity() for e in [base, *others]}
    assert len(identities) == 3 and disk(others[-1])["entries"] == 3  # one directory, one bound, three models
    again = edge0.load(store, prompt_cache_dir=tmp_path / "pc", prerouter=False)
    assert again.identity() == base.identity()
    assert again.generate(follow, max_tokens=4, reuse_cache=True).stats["prefill_tokens"] < len(NEW) + 2


def test_the_size_bound_removes_the_least_recently_used(store, tmp_path):
    a, b, c = PROMPT, [t + 1 for t in PROMPT], [t + 2 for t in PROMPT]
    probe = edge0.load(store, prompt_cache_dir=tmp_path / "probe")
    probe.generate(a, max_tokens=8, reuse_cache=True)
    one = disk(probe)["bytes"]
    # no memory pool: every reuse below comes from the disk
    engine = edge0.load(
        store, prompt_cache_dir=tmp_path / "pc", prompt_cache_size=int(2.5 * one), prompt_cache_memory=0
    )
    for prompt in (a, b):
        engine.generate(prompt, max_tokens=8, reuse_cache=True)
    # a branch inside a's prompt (another conversation) restores a's cache from disk (a is the most
    # recently used now); saving it goes over the bound, so b, the least recently used, is removed
    branch = a[:200] + [t + 3 for t in NEW]
    r = engine.generate(branch, max_tokens=8, reuse_cache=True)
    assert r.stats["prefill_tokens"] == len(NEW) and disk(engine)["restored"] == 1
    assert (disk(engine)["evicted"], disk(engine)["replaced"], disk(engine)["entries"]) == (1, 0, 2)
    # a's next turn restores a's cache and its save replaces a's file; c then removes the branch
    extended = engine.generate(a + NEW, max_tokens=8, reuse_cache=True)
    assert extended.stats["prefill_tokens"] == len(NEW) and disk(engine)["restored"] == 2
    assert (disk(engine)["evicted"], disk(engine)["replaced"], disk(engine)["entries"]) == (1, 1, 2)
    engine.generate(c, max_tokens=8, reuse_cache=True)
    st = disk(engine)
    assert (st["saved"], st["evicted"], st["entries"]) == (5, 2, 2) and st["bytes"] <= 2.5 * one
    restarted = edge0.load(store, prompt_cache_dir=tmp_path / "pc")
    assert restarted.generate(b + NEW, max_tokens=2, reuse_cache=True).stats["prefill_tokens"] == len(b + NEW)
    assert restarted.generate(a + NEW + [5], max_tokens=2, reuse_cache=True).stats["prefill_tokens"] == 1

    tiny = edge0.load(store, prompt_cache_dir=tmp_path / "tiny", prompt_cache_size="1KB")
    tiny.generate(a, max_tokens=2, reuse_cache=True)
    st = disk(tiny)
    assert (st["saved"], st["too_large"], st["entries"]) == (0, 1, 0) and "--prompt-cache-size" in st["note"]


def test_a_damaged_file_or_index_is_refused_and_counted(store, tmp_path):
    first = edge0.load(store, prompt_cache_dir=tmp_path)
    follow = PROMPT + first.generate(PROMPT, max_tokens=8, reuse_cache=True).tokens + NEW
    want = edge0.load(store).generate(follow, max_tokens=6).tokens
    saved = next(tmp_path.glob("*/*.safetensors"))
    data = saved.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    saved.write_bytes(data[:header] + b"\xff" * (len(data) - header))  # NaN KV that still loads: the checksum fails
    second = edge0.load(store, prompt_cache_dir=tmp_path)
    r = second.generate(follow, max_tokens=6, reuse_cache=True)
    assert r.stats["prefill_tokens"] == len(follow) and r.tokens == want
    st = disk(second)
    assert (st["damaged"], st["restored"], st["saved"]) == (1, 0, 1) and saved.name in st["note"]
    assert not saved.exists()

    (tmp_path / "index.json").write_text('{"version": 1, "entries": [')  # damaged index
    junk = tmp_path / saved.parent.name / "junk.safetensors"  # not a name the cache writes: left as it is
    junk.write_bytes(b"\x00" * 64)
    third = edge0.load(store, prompt_cache_dir=tmp_path)
    st = disk(third)
    assert (st["index_rebuilt"], st["damaged"], st["skipped"], st["entries"]) == (1, 0, 1, 1) and "rebuilt" in st[
        "note"
    ]
    assert json.loads((tmp_path / "index.json").read_text())["version"] == 2 and junk.read_bytes() == b"\x00" * 64
    r = third.generate(follow + [9], max_tokens=6, reuse_cache=True)  # the file second saved is found again
    assert r.stats["prefill_tokens"] == 1 and disk(third)["restored"] == 1

    shutil.rmtree(tmp_path)  # the directory removed while serving: prefill, and saving fails, counted
    third.reset_cache()
    r = third.generate(follow, max_tokens=6, reuse_cache=True)
    assert r.stats["prefill_tokens"] == len(follow) and r.tokens == want
    assert disk(third)["failed"] == 2 and "failed" in disk(third)["note"]


def test_prompt_cache_option_errors(store, tmp_path):
    for kw, match in [
        ({"prompt_cache_size": "1GB"}, "--prompt-cache-size is read only with --prompt-cache-dir"),
        ({"prompt_cache_dir": "d", "prompt_cache_size": "lots"}, "--prompt-cache-size 'lots'"),
        ({"prompt_cache_dir": "d", "prompt_cache_size": 0}, "more than 0 bytes"),
    ]:
        with pytest.raises(Edge0Error, match=match):
            LoadOptions(**kw).validate()
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(Edge0Error, match="--prompt-cache-dir .*file.*writ"):
        edge0.load(store, prompt_cache_dir=tmp_path / "file")


class FailOnce:
    """The engine's prefiller, raising once (a forward on a restored cache that fails)."""

    def __init__(self, real):
        self.real, self.armed = real, True

    def __getattr__(self, name):
        return getattr(self.real, name)

    def feed(self, tokens, cache, stop=None, logits=False, **kw):
        if self.armed:
            self.armed = False
            raise RuntimeError("the forward failed")
        return self.real.feed(tokens, cache, stop, logits, **kw)

    def __call__(self, tokens, cache, stop=None, **kw):
        return self.feed(tokens, cache, stop, **kw)[0]


@pytest.mark.parametrize("batch", [False, True])
def test_a_restored_cache_whose_forward_fails_is_removed_and_counted(store, tmp_path, batch):
    from edge0.engine.request import Request

    first = edge0.load(store, prompt_cache_dir=tmp_path)
    follow = PROMPT + first.generate(PROMPT, max_tokens=8, reuse_cache=True, ignore_eos=True).tokens + NEW
    saved = next(tmp_path.glob("*/*.safetensors"))
    cold = edge0.load(store)
    want = cold.generate(follow, max_tokens=6, ignore_eos=True).tokens
    unrelated = [3] + NEW + PROMPT[:30]
    want_unrelated = cold.generate(unrelated, max_tokens=6, ignore_eos=True).tokens

    restarted = edge0.load(store, prompt_cache_dir=tmp_path)
    restarted.prefiller = FailOnce(restarted.prefiller)
    if batch:
        with restarted.batching() as b:
            seq = b.join(Request(restarted.encode(follow), 6, reuse=True, ignore_eos=True))
            assert seq.held > 0  # restored from disk
            failures = [step for _, step in b.advance() if isinstance(step, Exception)]
        assert [str(f) for f in failures] == ["the forward failed"]
    else:
        with pytest.raises(RuntimeError, match="the forward failed"):
            restarted.generate(follow, max_tokens=6, reuse_cache=True, ignore_eos=True)
    st = disk(restarted)
    assert (st["restored"], st["damaged"], st["entries"]) == (1, 1, 0) and "the forward failed" in st["note"]
    assert not saved.exists()
    r = restarted.generate(follow, max_tokens=6, reuse_cache=True, ignore_eos=True)  # cold, as a fresh server
    assert r.stats["prefill_tokens"] == len(follow) and r.tokens == want
    r = restarted.generate(unrelated, max_tokens=6, reuse_cache=True, ignore_eos=True)
    assert r.stats["prefill_tokens"] == len(unrelated) and r.tokens == want_unrelated


def test_a_server_on_a_cache_dir_beside_other_files_touches_none_of_them(store, tmp_path):
    """The prompt-cache dir holds its own index beside another model's store, a Hugging Face shard,
    a FIFO and a folder named like a cache file: after a server starts there, answers requests and
    stops (saving every conversation), each of them is as it was and the cache still works."""
    import os

    root = tmp_path / "caches"
    edge0.load(store, prompt_cache_dir=root)  # the dir, its .lock and its index
    foreign = {
        root / "other-store" / "model.safetensors": b"weights of another model",
        root / "other-store" / "prerouter.safetensors": b"heads",
        root / "model-00001-of-00002.safetensors": b"a shard",
    }
    for path, data in foreign.items():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
    os.mkfifo(root / "fifo.safetensors")
    named_like = root / ("a" * 32) / ("b" * 32 + ".safetensors")  # a folder where a cache file could be
    named_like.mkdir(parents=True)
    engine = edge0.load(store, prompt_cache_dir=root)
    with running_server(engine, ServerConfig()) as base:
        for text in ("hello world, " * 30, "another conversation " * 30):
            r = httpx.post(
                base + "/v1/chat/completions",
                timeout=60,
                json={"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4},
            )
            assert r.status_code == 200
    assert engine.flush_prompt_caches() >= 0
    assert {p: p.read_bytes() for p in foreign} == foreign
    assert (root / "fifo.safetensors").is_fifo() and named_like.is_dir()
    assert disk(engine)["saved"] >= 1 and disk(engine)["skipped"] >= 3
