"""Reasoning text: the chat template's thinking switch, and the model's reasoning split out of
its streamed text.

The format is the tokenizer's: mlx-lm's TokenizerWrapper names the markers (`think_start`,
`think_end`, e.g. `<think>` and `</think>` for Qwen3-style models; `has_thinking` says whether
there are any) and passes `enable_thinking` to the template, which Qwen3-style templates use to
leave the reasoning out (an empty `<think></think>` in the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union

from edge0.backend.logits import only_token
from edge0.textstream import partial_suffix_len

OPEN_TAIL_TOKENS = 32  # a template opens the block in its generation prompt, at the very end


@dataclass(frozen=True)
class Reasoning:
    """A piece of the model's reasoning text (not part of the answer)."""

    text: str


def markers(tokenizer) -> tuple[str, str] | None:
    """(think_start, think_end) of a tokenizer with a reasoning format, else None."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    return tokenizer.think_start, tokenizer.think_end


def opens_reasoning(tokenizer, prompt: list[int]) -> bool:
    """The prompt ends inside a reasoning block (its template opened one for the model): in its
    last tokens (a generation prompt), the last think_start comes after the last think_end."""
    found = markers(tokenizer)
    if not found:
        return False
    tail = tokenizer.decode(prompt[-OPEN_TAIL_TOKENS:])
    return tail.rfind(found[0]) > tail.rfind(found[1])


class ReasoningSplitter:
    """Turns streamed text into Reasoning pieces and answer text.

    A reasoning block is recognized at the start of the output (or the prompt opened one); the
    whitespace around its text and before the answer after it is dropped, as templates put
    newlines there (an answer without a block is left as it is).
    Text that may be the start of a marker is held back until it is decided.
    """

    def __init__(self, start: str, end: str, inside: bool):
        self.start, self.end = start, end
        self.inside = inside
        self._buf = ""
        self._began = inside  # a block was seen: later markers are answer text
        self._lead = inside  # at the start of reasoning or of the answer after it: drop whitespace

    def feed(self, text: str) -> Iterator[Union[Reasoning, str]]:
        self._buf += text
        while self._buf:
            if self.inside:
                i = self._buf.find(self.end)
                if i >= 0:
                    piece, self._buf = self._buf[:i].rstrip(), self._buf[i + len(self.end) :]
                    yield from self._emit(piece, Reasoning)
                    self.inside, self._lead = False, True
                    continue
                # Hold back a possible marker start and trailing whitespace (it may end the block).
                cut = len(self._buf[: len(self._buf) - partial_suffix_len(self._buf, [self.end])].rstrip())
                piece, self._buf = self._buf[:cut], self._buf[cut:]
                yield from self._emit(piece, Reasoning)
                return
            if not self._began:
                stripped = self._buf.lstrip()
                if stripped.startswith(self.start):
                    self._buf, self._began, self.inside, self._lead = stripped[len(self.start) :], True, True, True
                    continue
                if self.start.startswith(stripped):  # maybe the marker, not complete yet
                    return
                self._began = True
            piece, self._buf = self._buf, ""
            yield from self._emit(piece, str)

    def _emit(self, piece: str, kind) -> Iterator[Union[Reasoning, str]]:
        if self._lead:
            piece = piece.lstrip()
            self._lead = not piece
        if piece:
            yield Reasoning(piece) if kind is Reasoning else piece

    def finish(self) -> Iterator[Union[Reasoning, str]]:
        """End of generation: release held text (an unfinished block stays reasoning)."""
        rest, self._buf = self._buf, ""
        yield from self._emit(rest.rstrip() if self.inside else rest, Reasoning if self.inside else str)


class ThinkingBudget:
    """A logits processor ending the reasoning block once it holds `budget` tokens: the next
    token is then think_end (Anthropic's thinking.budget_tokens). Needs single-token markers."""

    def __init__(self, start_id: int, end_id: int, budget: int, inside: bool):
        self.start_id, self.end_id, self.budget = start_id, end_id, budget
        self.inside, self.spent, self.seen = inside, 0, 0
        self.forced = 0  # blocks ended by the budget

    def __call__(self, generated: list[int], logprobs):
        for token in generated[self.seen :]:
            if token == self.start_id:
                self.inside = True
            elif token == self.end_id:
                self.inside = False
            elif self.inside:
                self.spent += 1
        self.seen = len(generated)
        if self.inside and self.spent >= self.budget:
            self.forced += 1
            return only_token(logprobs, self.end_id)
        return logprobs


def budget(tokenizer, budget_tokens: int, inside: bool) -> ThinkingBudget | None:
    """The budget processor, or None when a marker is not one token (the budget is then not
    enforced; max_tokens still bounds the whole reply)."""
    found = markers(tokenizer)
    ids = [tokenizer.encode(m, add_special_tokens=False) for m in found] if found else []
    if len(ids) != 2 or any(len(i) != 1 for i in ids):
        return None
    return ThinkingBudget(ids[0][0], ids[1][0], budget_tokens, inside)
