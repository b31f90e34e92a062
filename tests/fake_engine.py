"""A deterministic stand-in for edge0's Engine (docs/engine-api.md), for server and chat tests.

The tokenizer is byte-level, so every multi-byte UTF-8 character is split across tokens, plus a
few ChatML special tokens. The "model" answers from the last message of the prompt:

- `call NAME ARG...` with tools in the prompt -> a `<tool_call>` JSON call NAME(city=ARG...);
- a tool response -> "The weather is RESULT.";
- `count N` -> "0 1 2 ... N-1" (long replies for queue and disconnect tests);
- `think TEXT` with thinking on (the default; `enable_thinking=False` puts an empty
  `<think></think>` in the prompt, as Qwen3's template does) -> "<think>\nAbout TEXT.\n</think>\n\nTEXT";
- anything else -> "Echo: TEXT"; raw prompts (no template) -> "Echo: PROMPT".

Log-probs, when asked, are made up but fixed: token i of a reply has -0.5 * (i + 1), and the
top ones are the token itself and the next ids, each 1.0 lower. Logits processors are recorded
(in the call's kwargs), not applied: the fake has no logits.

With `prefill_delay` it spends that many seconds per prompt token before the first one, in
chunks of PREFILL_CHUNK tokens, checking `should_stop` between chunks as the real engine does.

It records every call in `calls` and the highest number of generations running at once. The
server drives it as it drives the real engine, through `batching()` (FakeBatch: one sequence at
a time, as `batch_problem()` says).
"""

from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from edge0.engine import GenerationResult, Step
from edge0.formats import detect
from edge0.sampling import check_sampling
from edge0.textstream import StopMatcher

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
EMPTY_THINK = f"{THINK_START}\n\n{THINK_END}\n\n"  # what enable_thinking=False puts in the prompt (Qwen3)
SPECIALS = [
    IM_START,
    IM_END,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    THINK_START,
    THINK_END,
]
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
PREFILL_CHUNK = 64


class FakeTokenizer:
    """Byte-level tokenizer with ChatML specials and a json tool-call format (like mlx-lm's json_tools)."""

    eos_token_ids = [256 + SPECIALS.index(IM_END)]
    has_tool_calling = True
    tool_call_start = "<tool_call>"
    tool_call_end = "</tool_call>"
    has_thinking = True
    think_start, think_end = THINK_START, THINK_END

    @staticmethod
    def tool_parser(text, tools=None):
        return json.loads(text.strip())

    def __init__(self):
        self.encoded_chars = 0  # characters tokenized so far

    @property
    def backend_tokenizer(self):
        """The same vocabulary as a `tokenizers` byte-level tokenizer (what llguidance reads)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        from tests.fixtures.tokenizer import _bytes_to_unicode

        chars = _bytes_to_unicode()
        tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[], fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
        return tok

    def get_vocab(self) -> dict[str, int]:
        return {**{bytes([i]).decode("latin-1"): i for i in range(256)}, **{s: 256 + i for i, s in enumerate(SPECIALS)}}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        ids: list[int] = []
        for part in _SPLIT.split(text):
            if part in SPECIALS:
                ids.append(256 + SPECIALS.index(part))
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def token_bytes(self, tok: int) -> bytes:
        return bytes([tok]) if tok < 256 else SPECIALS[tok - 256].encode()

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages, tools=None, add_generation_prompt=False, tokenize=True, enable_thinking=True, **_
    ):
        out = ""
        if tools:
            out += f"{IM_START}system\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + f"\n</tools>{IM_END}\n"
        for m in messages:
            if m["role"] == "tool":
                out += f"{IM_START}user\n<tool_response>\n{m['content']}\n</tool_response>{IM_END}\n"
                continue
            thought = f"{THINK_START}\n{m['reasoning_content']}\n{THINK_END}\n\n" if m.get("reasoning_content") else ""
            out += f"{IM_START}{m['role']}\n{thought}{m.get('content') or ''}"
            for call in m.get("tool_calls") or []:
                fn = call["function"]
                out += (
                    "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}) + "\n</tool_call>"
                )
            out += f"{IM_END}\n"
        if add_generation_prompt:
            out += f"{IM_START}assistant\n" + ("" if enable_thinking else EMPTY_THINK)
        return self.encode(out) if tokenize else out


@dataclass
class Call:
    """What one stream_generate call saw and did."""

    prompt: list[int]
    kwargs: dict
    prefill_tokens: int = 0
    prefilled: int = 0  # prompt tokens fed so far (prefill_delay)
    steps: int = 0
    finish_reason: str | None = None
    closed_early: bool = False  # ended before a finish: closed, or should_stop said so


class FakeEngine:
    """Implements the Engine contract; `delay` is seconds per generated token, `prefill_delay`
    seconds per prefilled prompt token."""

    model_id = "fake-moe"
    model_type = "fake"
    takes_images = False  # no vision tower: the server refuses images before asking image_prompt
    follower = False  # one process: no ranks to follow (docs/distributed.md)
    pipeline = None

    def __init__(self, delay: float = 0.0, prefill_delay: float = 0.0, root=None, tokenize_s: float = 0.0):
        self.tokenizer = FakeTokenizer()
        self.chat_format = detect(self.tokenizer)
        self.root = root
        self.delay, self.prefill_delay = delay, prefill_delay
        self.tokenize_s = tokenize_s  # seconds each chat_prompt takes (a slow tokenizer)
        self.max_tokenizing = 0  # the most chat_prompt calls running at once
        self._tokenizing = 0
        self.interrupt_at: int | None = None  # raise KeyboardInterrupt once, at this step (Ctrl-C)
        self.fail_at: int | None = None  # raise RuntimeError once, at this step (a failing generation)
        self.calls: list[Call] = []
        self.max_active = 0
        self._active = 0
        self._lock = threading.Lock()
        self._cache_tokens: list[int] = []
        self._cache_namespace = ""

    def reply(self, prompt: list[int]) -> str:
        text = self.tokenizer.decode(prompt)
        thinking = not text.endswith(EMPTY_THINK)
        text = text.removesuffix(EMPTY_THINK)
        if not text.endswith(f"{IM_START}assistant\n"):
            return "Echo: " + text
        last = text.split(IM_START)[-2]
        if m := re.search(r"<tool_response>\n(.*)\n</tool_response>", last, re.S):
            return f"The weather is {m.group(1)}."
        content = last.split("\n", 1)[1].removesuffix(f"{IM_END}\n")
        words = content.split()
        if words[:1] == ["call"] and "<tools>" in text:
            call = {"name": words[1], "arguments": {"city": " ".join(words[2:])}}
            return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
        if words[:1] == ["count"]:
            return " ".join(str(i) for i in range(int(words[1])))
        if words[:1] == ["think"] and thinking:
            rest = content.split(None, 1)[1] if len(words) > 1 else ""
            return f"{THINK_START}\nAbout {rest}.\n{THINK_END}\n\n{rest}"
        return "Echo: " + content

    def image_prompt(self, prompt, images):
        raise AssertionError("the server asked a model without a vision tower for an image prompt")

    def chat_prompt(self, messages, tools=None, **template_kwargs) -> list[int]:
        with self._lock:
            self._tokenizing += 1
            self.max_tokenizing = max(self.max_tokenizing, self._tokenizing)
        try:
            time.sleep(self.tokenize_s)
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, **template_kwargs
            )
        finally:
            with self._lock:
                self._tokenizing -= 1

    def stream_generate(
        self,
        prompt,
        max_tokens=256,
        temperature=0.0,
        top_p=1.0,
        seed=None,
        stop=None,
        reuse_cache=False,
        should_stop=None,
        top_k=0,
        logits_processors=None,
        logprobs=None,
        cache_namespace="",
    ):
        check_sampling(temperature, top_p, seed, top_k=top_k)  # as the real engine does (an Edge0Error)
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        call = Call(
            tokens,
            dict(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                stop=stop,
                reuse_cache=reuse_cache,
                top_k=top_k,
                logits_processors=logits_processors,
                logprobs=logprobs,
                cache_namespace=cache_namespace,
            ),
        )
        self.calls.append(call)
        common = 0
        # same rule as the real engine: keep the longest prefix of tokens[:-1], in its own namespace
        if reuse_cache and cache_namespace == self._cache_namespace:
            for a, b in zip(self._cache_tokens, tokens[:-1]):
                if a != b:
                    break
                common += 1
        call.prefill_tokens = len(tokens) - common
        self._cache_tokens, self._cache_namespace = list(tokens), cache_namespace
        target = self.tokenizer.encode(self.reply(tokens)) + self.tokenizer.eos_token_ids
        with self._lock:
            self._active += 1
            self.max_active = max(self.max_active, self._active)
        pending, stopper = b"", StopMatcher(stop or [])
        try:
            for start in range(0, call.prefill_tokens, PREFILL_CHUNK):
                if should_stop and should_stop():
                    call.closed_early, self._cache_tokens = True, []
                    return
                time.sleep(self.prefill_delay * min(PREFILL_CHUNK, call.prefill_tokens - start))
                call.prefilled = min(start + PREFILL_CHUNK, call.prefill_tokens)
            for i, tok in enumerate(target[:max_tokens]):
                if self.delay:
                    time.sleep(self.delay)
                if self.interrupt_at == i:
                    self.interrupt_at = None
                    raise KeyboardInterrupt
                if self.fail_at == i:
                    self.fail_at = None
                    raise RuntimeError("the fake engine failed")
                finish = "stop" if tok in self.tokenizer.eos_token_ids else None
                if not finish:
                    pending += self.tokenizer.token_bytes(tok)
                cut = len(pending) if finish else _utf8_safe_len(pending)
                text, hit = stopper.feed(pending[:cut].decode("utf-8", errors="replace"))
                pending = pending[cut:]
                if hit:
                    finish = "stop"
                elif not finish and i + 1 == max_tokens:
                    finish = "length"
                if finish:
                    text += stopper.flush()
                call.steps, call.finish_reason = i + 1, finish
                step = Step(
                    tok, text, finish, self._stats(call) if finish else None, stopper.matched if finish else None
                )
                if logprobs is not None:
                    step.logprob = -0.5 * (i + 1)
                    step.top_logprobs = [((tok + j) % 256, step.logprob - j) for j in range(logprobs)]
                yield step
                if finish:
                    return
                if should_stop and should_stop():
                    call.closed_early = True
                    return
                self._cache_tokens.append(tok)
        except GeneratorExit:
            call.closed_early = True
            raise
        finally:
            with self._lock:
                self._active -= 1

    def batch_problem(self) -> str | None:
        return "the fake engine decodes one sequence at a time"

    @contextmanager
    def batching(self):
        yield FakeBatch(self)

    def _stats(self, call: Call) -> dict:
        return {
            "prompt_tokens": len(call.prompt),
            "prefill_tokens": call.prefill_tokens,
            "generation_tokens": call.steps,
            "prefill_tps": 1000.0,
            "decode_tps": 50.0,
            "peak_memory_bytes": 3 << 30,
            "peak_rss_bytes": 4 << 30,
            "expert_bytes_read": 1 << 20,
            "expert_hit_rate": 0.75,
        }

    def generate(self, prompt, max_tokens=256, **kwargs) -> GenerationResult:
        steps = list(self.stream_generate(prompt, max_tokens, **kwargs))
        return GenerationResult(
            "".join(s.text for s in steps), [s.token for s in steps], steps[-1].finish_reason, steps[-1].stats
        )

    def chat(self, messages, tools=None, **kwargs) -> GenerationResult:
        return self.generate(self.chat_prompt(messages, tools), **kwargs)

    def describe(self) -> str:
        return f"{self.model_id}: fake engine"

    def stats(self) -> dict:
        return {
            "model": self.model_id,
            "generations": len(self.calls),
            "generated_tokens": sum(c.steps for c in self.calls),
        }

    def reset_cache(self) -> None:
        self._cache_tokens = []

    def persist_prompt_cache(self) -> bool:
        return False  # no prompt-cache dir

    def flush_prompt_caches(self) -> int:
        return 0  # no prompt-cache dir

    def free_prompt_caches(self, nbytes: int) -> int:
        return 0  # no other conversations' caches in memory

    def prompt_caches_held(self) -> int:
        return 0

    def restore_prompt_caches(self) -> None:
        pass

    def expert_cache(self) -> dict:
        """No expert slots: nothing for a memory watcher to resize."""
        return {
            "slots_per_layer": 0,
            "configured_slots": 0,
            "min_slots": 0,
            "max_slots": 0,
            "slot_bytes": 0,
            "budget_bytes": 0,
        }

    def resize_expert_cache(self, n_slots: int) -> None:
        raise AssertionError("the fake engine has no expert slots to resize")

    def spare_contexts(self) -> int | None:
        return None  # no KV footprint

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeSequence:
    request: object
    steps: object = None  # its stream_generate generator
    finish: str | None = None


@dataclass
class FakeBatch:
    """The engine's Batch contract (edge0/engine/batch.py) over the fake's stream_generate: each
    `advance` one Step of every sequence; a sequence whose generation raises ends alone."""

    engine: FakeEngine
    seqs: list = field(default_factory=list)
    interrupt: object = None
    steps: int = 0
    counts: dict = field(
        default_factory=lambda: dict.fromkeys(
            ("joined", "left", "spans", "spans_dropped", "steps", "row_steps", "most_rows", "failed"), 0
        )
    )

    @property
    def busy(self) -> bool:
        return bool(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def join(self, request) -> FakeSequence:
        request.check()
        r, seq = request, FakeSequence(request)
        # the real engine's lone prefill stops on the batch's interrupt (a client gone) too
        seq.steps = self.engine.stream_generate(
            r.prompt,
            max_tokens=r.max_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            seed=r.seed,
            stop=r.stop,
            reuse_cache=r.reuse,
            should_stop=lambda: bool(self.interrupt and self.interrupt()),
            top_k=r.top_k,
            logits_processors=r.processors or None,
            logprobs=r.logprobs,
            cache_namespace=r.namespace,
        )
        self.seqs.append(seq)
        self.counts["joined"] += 1
        self.counts["most_rows"] = max(self.counts["most_rows"], len(self.seqs))
        return seq

    def leave(self, seq: FakeSequence) -> None:
        if seq in self.seqs:
            self.seqs.remove(seq)
            seq.steps.close()
            self.counts["left"] += 1

    def advance(self) -> list:
        out = []
        for seq in list(self.seqs):
            try:
                step = next(seq.steps)
            except StopIteration:  # should_stop said so: it waits for leave()
                continue
            except Exception as e:  # noqa: BLE001 - its own failure: it ends alone
                seq.finish = "error"
                self.seqs.remove(seq)
                self.counts["failed"] += 1
                out.append((seq, e))
                continue
            out.append((seq, step))
            if step.finish_reason:
                seq.finish = step.finish_reason
                self.seqs.remove(seq)
        self.steps += 1
        self.counts["steps"] += 1
        self.counts["row_steps"] += len(out)
        return out


def _utf8_safe_len(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # found the lead byte of the last character
            need = 1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return len(data) if back >= need else len(data) - back
    return len(data)
