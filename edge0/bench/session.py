"""An agent session replayed against a server: the bench's measure of a prompt cache of many
conversations (docs/bench-suite.md, "Agent session").

A coding agent is several conversations at once. The script has a main thread (a long system
prompt and first turn, growing by a user turn each time), a short side request beside each of its
turns (a title, as Claude Code and opencode send), and a subagent with a long prompt of its own for
a few turns, interleaved as an agent interleaves them. Each request goes to the server's Chat
Completions API, streamed, greedy, with a few reply tokens, and its reply joins its conversation.

Per request: prompt tokens, the cached tokens the server reports, the tokens it prefilled, the
tokens new to the conversation (its prompt less the previous request's prompt and reply), the time
to the first token and in all. Per session: prefilled tokens / new tokens (1.0: every conversation
reused all of its prefix) and the wall time.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

import httpx

WORDS = (
    "the model reads a file then writes a test for each function it finds in the module and runs the "
    "suite again until every case passes or the budget is spent while the user waits for a short answer"
).split()


@dataclass(frozen=True)
class SessionShape:
    """Sizes in tokens of the scripted session (approximate: texts are built by the tokenizer)."""

    main_tokens: int = 12_000  # the main thread's system prompt and first turn
    main_growth: int = 600  # each later main turn
    main_turns: int = 6
    side_tokens: int = 300  # each side request
    sub_tokens: int = 8_000  # the subagent's first prompt
    sub_growth: int = 400
    sub_turns: int = 3
    reply_tokens: int = 16


class TextMaker:
    """Texts of about N tokens of a tokenizer, reproducible from a seed."""

    def __init__(self, count_tokens, seed: int = 0):
        self.count, self.rng = count_tokens, random.Random(seed)
        sample = " ".join(self.rng.choice(WORDS) for _ in range(400))
        self.tokens_per_word = max(self.count(sample), 1) / 400

    def text(self, tokens: int, tag: str) -> str:
        words = [tag] + [self.rng.choice(WORDS) for _ in range(max(1, int(tokens / self.tokens_per_word)))]
        return " ".join(words)


def script(shape: SessionShape, maker: TextMaker):
    """(conversation, messages to append) in the order an agent sends them; the driver adds each
    reply to its conversation before that conversation's next request."""
    yield (
        "main",
        [
            {"role": "system", "content": maker.text(shape.main_tokens * 9 // 10, "main-system")},
            {"role": "user", "content": maker.text(shape.main_tokens // 10, "main-turn-0")},
        ],
    )
    for turn in range(shape.main_turns):
        if turn:
            yield "main", [{"role": "user", "content": maker.text(shape.main_growth, f"main-turn-{turn}")}]
        yield (
            f"side-{turn}",
            [
                {"role": "system", "content": "Write a five-word title for this conversation."},
                {"role": "user", "content": maker.text(shape.side_tokens, f"side-{turn}")},
            ],
        )
        if turn < shape.sub_turns:
            if turn == 0:
                yield (
                    "sub",
                    [
                        {"role": "system", "content": maker.text(shape.sub_tokens * 9 // 10, "sub-system")},
                        {"role": "user", "content": maker.text(shape.sub_tokens // 10, "sub-turn-0")},
                    ],
                )
            else:
                yield "sub", [{"role": "user", "content": maker.text(shape.sub_growth, f"sub-turn-{turn}")}]


def request(client: httpx.Client, base: str, model: str, messages: list[dict], reply_tokens: int) -> dict:
    """One streamed, greedy Chat Completions request: its usage, cached tokens and times."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": reply_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, first, text, usage = time.perf_counter(), None, "", None
    with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text += piece
    done = time.perf_counter()
    if usage is None:
        raise RuntimeError(f"{base}: the stream carried no usage (stream_options.include_usage)")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": cached,
        "prefilled_tokens": usage["prompt_tokens"] - cached,
        "ttft_s": (first or done) - started,
        "wall_s": done - started,
        "reply": text,
    }


def run_session(
    base: str, model: str, shape: SessionShape, maker: TextMaker, timeout: float = 3600, before=None
) -> dict:
    """Replay the script against the server at `base` (no /v1), naming `model` (mlx_lm.server
    loads the model a request names); per-request records and totals. `before(i, messages)`, if
    given, runs before request i and may return a new base URL (a restarted server)."""
    conversations: dict[str, list[dict]] = {}
    last: dict[str, int] = {}  # a conversation's previous prompt + reply, in tokens
    records = []
    started = time.perf_counter()
    with httpx.Client(timeout=timeout) as client:
        for i, (name, add) in enumerate(script(shape, maker)):
            messages = conversations.setdefault(name, []) + add
            base = (before and before(i, messages)) or base
            r = request(client, base, model, messages, shape.reply_tokens)
            r["conversation"] = name
            r["new_tokens"] = r["prompt_tokens"] - last.get(name, 0)
            last[name] = r["prompt_tokens"] + r["completion_tokens"]
            conversations[name] = messages + [{"role": "assistant", "content": r.pop("reply")}]
            records.append(r)
    wall = time.perf_counter() - started
    prefilled, new = sum(r["prefilled_tokens"] for r in records), sum(max(r["new_tokens"], 0) for r in records)
    return {
        "requests": records,
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "prefilled_tokens": prefilled,
        "new_tokens": new,
        "recompute_ratio": prefilled / max(new, 1),
        "wall_s": wall,
        "shape": asdict(shape),
    }
