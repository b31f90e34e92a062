"""Chat formats of the model families (base.py): which one a tokenizer's template and vocabulary
use. Formats mlx-lm has no parser for, or that need more than its parser, come first; then
mlx-lm's own inference (mlxlm.py); a template with neither serves plain chat and refuses tools."""

from __future__ import annotations

import importlib
import pkgutil

from edge0.formats.base import ChatFormat
from edge0.formats.markup import Reasoning, Segment
from edge0.formats.mlxlm import MlxLmFormat

__all__ = ["ChatFormat", "Reasoning", "Segment", "detect", "OWN"]


def _own() -> list[type]:
    """Every format module's formats: ChatFormat subclasses with a classmethod `matches(template:
    str, vocab: dict) -> bool` and a constructor taking the tokenizer, by `priority` (lower is
    tried first: the more specific)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name in ("base", "markup", "mlxlm"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [
            v
            for v in vars(module).values()
            if isinstance(v, type)
            and issubclass(v, ChatFormat)
            and v.__module__ == module.__name__
            and "matches" in vars(v)
        ]
    return sorted(found, key=lambda f: (f.priority, f.__name__))


OWN: list[type] = _own()


def detect(tokenizer) -> ChatFormat:
    """The chat format of `tokenizer` (an mlx-lm TokenizerWrapper, or anything with its attributes)."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for fmt in OWN:
        if fmt.matches(template, vocab):
            return fmt(tokenizer)
    found = MlxLmFormat(tokenizer)
    return found if found.calls or found.think else ChatFormat()
