"""The prompt-cache directory's names and index entries (store/promptcache.py): the only names
the cache reads, replaces or removes, and the checks an index entry passes before it is trusted."""

from __future__ import annotations

import math
import re

# The names the cache writes, the only ones it reads, replaces or removes.
_FOLDER = re.compile(r"[0-9a-f]{32}")  # DIR/<identity prefix>/
_FILE = re.compile(r"[0-9a-f]{32}\.safetensors")  # <hash of the namespace and tokens>.safetensors in a folder
_FILE_TMP = re.compile(r"\.[0-9a-f]{32}\.\d+\.tmp\.safetensors")  # a cache file being written
_INDEX_TMP = re.compile(r"\.index\.json\.\d+\.tmp")  # the index being written
_ENTRY = re.compile(r"[0-9a-f]{32}/[0-9a-f]{32}\.safetensors")  # an index entry's name: none leaves DIR
_NAMESPACE = re.compile(r"[0-9a-f]{0,128}")
# The shortest prefix restored: one block of the memory tier (engine.kvpool.BLOCK); reading a whole
# file to reuse fewer tokens costs more than prefilling them.
MIN_TOKENS = 64


def _tokens_ok(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


def _before_index(name: str) -> bool:
    """Whether `name`, in DIR, is one the cache writes before its .lock and index: files and folders
    named like its own are not, without them (a folder of someone else's files can hold 32-hex
    names too)."""
    return bool(_INDEX_TMP.fullmatch(name))


def _entry_ok(e) -> bool:
    return (
        isinstance(e, dict)
        and isinstance(e.get("identity"), str)
        and isinstance(e.get("namespace"), str)
        and _NAMESPACE.fullmatch(e["namespace"]) is not None
        and _tokens_ok(e.get("tokens"))
        and isinstance(e.get("used"), (int, float))
        and math.isfinite(e["used"])
        and _prompt_end_ok(e.get("prompt_end", 0))
    )


def _prompt_end_ok(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _prompt_end(entry: dict) -> int:
    """Where the prompt of the request that filled an entry's cache ended: its `prompt_end`, or
    (unknown: 0, an older edge0's file) all of its tokens."""
    end = entry.get("prompt_end", 0)
    return end if 0 < end <= len(entry["tokens"]) else len(entry["tokens"])


def _continues(tokens: list[int], entry: dict) -> bool:
    """Whether `tokens` continue the conversation of a saved `entry`: they hold its whole prompt
    (then its reply as the client renders it, a new turn; or its reply as generated), so the
    entry's file serves no request that a file of `tokens`, trimmed, does not serve."""
    end = _prompt_end(entry)
    return len(tokens) >= end and tokens[:end] == entry["tokens"][:end]


def _check_namespace(namespace) -> None:
    if not isinstance(namespace, str) or _NAMESPACE.fullmatch(namespace) is None:
        raise ValueError(f"a prompt-cache namespace is a lowercase hex digest (at most 128 digits), not {namespace!r}")
