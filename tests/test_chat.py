"""`edge0 chat` driven through piped stdin, in-process with the fake engine (and once with the real one)."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

import edge0
from edge0.cli import chat
from tests.fake_engine import FakeEngine

STATS = re.compile(r"prefill (\d+) of (\d+) prompt tokens")


@pytest.fixture
def fake(monkeypatch):
    """A FakeEngine that edge0.load() returns; `fake.loaded` records the load arguments."""
    engine = FakeEngine()
    engine.loaded = []

    def load(path=None, **options):
        engine.loaded.append((path, options))
        return engine

    monkeypatch.setattr(edge0, "load", load)
    return engine


def run_chat(monkeypatch, capsys, stdin: str, *argv: str):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert chat.main(list(argv)) == 0
    return capsys.readouterr()


def test_two_turns_second_prefill_covers_only_new_tokens(monkeypatch, capsys, fake):
    out = run_chat(monkeypatch, capsys, "hello there\nsecond question\n", "--max-tokens", "64")
    assert out.out.splitlines() == ["Echo: hello there", "Echo: second question"]  # no prompt noise
    first, second = fake.calls
    assert first.kwargs["reuse_cache"] and second.kwargs["reuse_cache"]
    history = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "Echo: hello there"},
        {"role": "user", "content": "second question"},
    ]
    assert second.prompt == fake.chat_prompt(history)  # the whole history goes in ...
    reply = fake.tokenizer.encode("Echo: hello there")
    cached = len(first.prompt) + len(reply)
    assert second.prompt[:cached] == first.prompt + reply
    assert second.prefill_tokens == len(second.prompt) - cached  # ... and only the new turn is prefilled
    lines = [ln for ln in out.err.splitlines() if "tok/s" in ln]  # after the start-up line
    assert len(lines) == 2 and all("tok/s" in ln and "peak memory 3.00 GiB" in ln and "hit 75.0%" in ln for ln in lines)
    assert [tuple(map(int, STATS.search(ln).groups())) for ln in lines] == [
        (len(first.prompt), len(first.prompt)),
        (second.prefill_tokens, len(second.prompt)),
    ]


def test_commands_reset_stats_exit(monkeypatch, capsys, fake):
    out = run_chat(monkeypatch, capsys, "hi\n\n/stats\n/reset\nhi\n/bogus\n/exit\nnever sent\n")
    assert len(fake.calls) == 2  # nothing after /exit
    assert fake.calls[1].prompt == fake.calls[0].prompt  # /reset forgot the first turn ...
    assert fake.calls[1].prefill_tokens == len(fake.calls[1].prompt)  # ... and dropped the KV cache
    assert "turns: 1" in out.out and "generations: 1" in out.out and "last reply: [" in out.out
    assert "[conversation reset]" in out.err and "unknown command /bogus" in out.err


def test_ctrl_c_stops_the_reply_and_keeps_the_session(monkeypatch, capsys, fake):
    fake.interrupt_at = 5
    out = run_chat(monkeypatch, capsys, "count 100\nhello\n", "--system", "Be brief.")
    assert "[interrupted]" in out.err
    assert out.out.splitlines() == ["0 1 2", "Echo: hello"]
    first, second = fake.calls
    assert second.finish_reason == "stop"
    history = fake.tokenizer.decode(second.prompt)
    assert "count 100" in history and "0 1 2" in history  # the partial reply stays in the history
    assert second.prefill_tokens == len(second.prompt)  # but the KV cache was dropped, to be safe
    assert "Be brief." in fake.tokenizer.decode(first.prompt)


def test_flags_reach_the_engine(monkeypatch, capsys, fake):
    run_chat(
        monkeypatch,
        capsys,
        "hi\n",
        "--model",
        "store",
        "--expert-cache",
        "2GB",
        "--no-prerouter",
        "--lora",
        "a.safetensors",
        "--top-k",
        "4",
        "--dtype",
        "float32",
        "--temp",
        "0.7",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--max-tokens",
        "7",
    )
    path, options = fake.loaded[0]
    assert path == "store"
    assert options["expert_cache"] == "2GB" and options["prerouter"] is False and options["lora"] == "a.safetensors"
    assert options["top_k"] == 4 and options["dtype"] == "float32"
    assert {k: fake.calls[0].kwargs[k] for k in ("temperature", "top_p", "seed", "max_tokens")} == {
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "max_tokens": 7,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-tokens", "0"],
        ["--temp", "hot"],
        ["--top-p", "2"],
        ["--frobnicate"],
        ["--lora", "a.safetensors", "--no-lora"],
    ],
)
def test_usage_errors_are_one_line_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        chat.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("edge0 chat: error:")


def test_usage_error_from_the_command_line():
    p = subprocess.run(
        [sys.executable, "-m", "edge0", "chat", "--top-k", "many"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr


def test_two_turns_on_the_bundled_model(monkeypatch, capsys):
    engine = edge0.load(None)
    monkeypatch.setattr(edge0, "load", lambda path=None, **options: engine)
    out = run_chat(monkeypatch, capsys, "Hello!\nTell me more.\n", "--max-tokens", "8")
    stats = [tuple(map(int, STATS.search(ln).groups())) for ln in out.err.splitlines() if STATS.search(ln)]
    assert len(stats) == 2
    (prefill1, prompt1), (prefill2, prompt2) = stats
    assert prefill1 == prompt1 and prefill2 <= prompt2 - prompt1  # the first turn is not prefilled again
    assert "LoRA lora.safetensors" in out.err  # the bundled recovery adapter is served by default
