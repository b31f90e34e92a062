"""Drafters for speculative decoding, behind one interface: each proposes the next k tokens of a
sequence, which the engine verifies in one multi-token forward (speculative.py).

- `PromptLookup` (`--draft ngram`): the tokens that followed the latest earlier occurrence of the
  sequence's last n-gram, in the prompt or the generated text (n from `--draft-ngram` down to 1);
  costs next to nothing, so it keeps drafting while speculation is switched off to measure
  acceptance.
- `ModelDrafter` (`--draft PATH`): a small mlx-lm model loaded resident, with the same tokenizer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0.errors import Edge0Error

DEFAULT_NGRAM = 3
DEFAULT_NUM_DRAFT = 4  # tokens drafted per verify step


@dataclass
class Draft:
    tokens: list[int]
    probs: object = None  # the drafter's distributions [k, V] when it sampled; None: deterministic

    def until(self, eos) -> Draft:
        """The draft before its first end-of-sequence token: the verify's own next token is then that
        token when the model agrees, and nothing after it is fed into the KV cache (a generation
        never feeds its last token, and a recurrent model's cache cannot drop tokens)."""
        cut = next((i for i, t in enumerate(self.tokens) if t in eos), len(self.tokens))
        if cut == len(self.tokens):
            return self
        return Draft(self.tokens[:cut], None if self.probs is None else self.probs[:cut])


class Drafter:
    """The interface. `draft(context, k, temp, top_p, key)`: up to k tokens that may follow `context`
    (the prompt and the generated tokens, the last not yet fed to the model); a drafter that samples
    draws from `key` (a seeded request's own stream; None: the global one)."""

    name = "drafter"
    cheap = True  # drafting costs next to nothing: shadow drafts measure acceptance while off

    def start(self, prompt: list[int]) -> None:
        """A generation begins with `prompt`."""

    def draft(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0, key=None) -> Draft:
        raise NotImplementedError

    def fork(self) -> Drafter:
        """A drafter for another sequence, decoded beside this one (a batch's row): its own state,
        what is heavy (a draft model's weights) shared."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class PromptLookup(Drafter):
    """Prompt lookup: match the last n tokens (n = `max_n` .. 1) against the earlier context and
    draft what followed the latest match."""

    def __init__(self, max_n: int = DEFAULT_NGRAM):
        self.max_n = max_n
        self.name = "ngram"
        self.buf = np.zeros(0, dtype=np.int64)
        self.n = 0  # tokens of `buf` in use (the context so far)

    def start(self, prompt: list[int]) -> None:
        self.n = 0

    def _context(self, context: list[int]) -> np.ndarray:
        """The context as an array, grown in place: within a generation each call extends the last."""
        n = self.n if self.n <= len(context) else 0
        if len(context) > len(self.buf):
            grown = np.zeros(max(2 * len(self.buf), len(context), 256), dtype=np.int64)
            grown[:n] = self.buf[:n]
            self.buf = grown
        self.buf[n : len(context)] = context[n:]
        self.n = len(context)
        return self.buf[: self.n]

    def draft(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0, key=None) -> Draft:
        ctx = self._context(context)
        for n in range(min(self.max_n, len(ctx) - 1), 0, -1):
            tail = ctx[-n:]
            # windows starting at 0 .. len - n - 1: every earlier occurrence, not the tail itself
            win = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((win == tail).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return Draft(ctx[start : start + k].tolist())
        return Draft([])

    def fork(self) -> PromptLookup:
        return PromptLookup(self.max_n)

    def describe(self) -> str:
        return f"prompt lookup (n-gram <= {self.max_n})"


class ModelDrafter(Drafter):
    """A draft model: any mlx-lm model, loaded resident; it must use the model's tokenizer."""

    cheap = False

    def __init__(self, path, tokenizer, model_name: str, dtype: str | None = None):
        from edge0.backend.draft import DraftModel

        path = Path(path).expanduser()
        if not (path / "config.json").is_file():
            raise Edge0Error(
                f"--draft {path}: not an mlx-lm model directory (no config.json); pass ngram, none or a model directory"
            )
        try:
            self.model = DraftModel(path, dtype)
        except (OSError, ValueError, KeyError) as e:
            raise Edge0Error(f"--draft {path}: could not load it with mlx-lm ({type(e).__name__}: {e})") from None
        check_same_tokenizer(self.model.vocab(), tokenizer.get_vocab(), path, model_name)
        self.vocab_size = len(tokenizer.get_vocab())
        self.name = f"model {path.name}"
        self.path = path

    def draft(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0, key=None) -> Draft:
        tokens, probs = self.model.draft(context, k, temp, top_p, self.vocab_size, key)
        return Draft(tokens, probs)

    def fork(self) -> ModelDrafter:
        twin = copy.copy(self)
        twin.model = self.model.fork()
        return twin

    def describe(self) -> str:
        return f"draft model {self.path} ({self.model.dtype}, {self.model.nbytes / 2**20:.0f} MiB resident)"


def check_same_tokenizer(draft_vocab: dict, vocab: dict, path, model_name: str) -> None:
    """A draft model's token ids must mean what the model's mean; an Edge0Error naming the first
    difference otherwise."""
    if draft_vocab == vocab:
        return
    if len(draft_vocab) != len(vocab):
        why = f"{len(draft_vocab)} tokens against {len(vocab)}"
    else:
        tok = next(t for t in sorted(vocab) if draft_vocab.get(t) != vocab[t])
        why = f"token {tok!r} is id {draft_vocab.get(tok)} there and {vocab[tok]} in {model_name}"
    raise Edge0Error(
        f"--draft {path}: its tokenizer differs from {model_name}'s ({why}); a draft model must use the same "
        "tokenizer (the same family and vocabulary)"
    )


def make_drafter(draft: str | None, ngram: int | None, tokenizer, model_name: str, dtype: str | None = None):
    """The drafter for `--draft` (None or "none": no speculation)."""
    if draft is None or draft == "none":
        return None
    if draft == "ngram":
        return PromptLookup(ngram or DEFAULT_NGRAM)
    return ModelDrafter(draft, tokenizer, model_name, dtype)
