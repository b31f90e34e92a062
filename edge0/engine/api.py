"""What the server may use of an engine, as checked Protocols: `EngineAPI` (edge0.engine.Engine
and the tests' fake engine both implement it; tests/test_engine_api.py fails when one drifts) and
`BatchAPI`, the running batch that `EngineAPI.batching()` yields (edge0/engine/batch.py)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from edge0.engine.reply import Step
from edge0.engine.request import Request


@runtime_checkable
class BatchAPI(Protocol):
    """Sequences join and leave between steps; each `advance` prefills a span of one that waits
    and runs one decode step of the others."""

    interrupt: object  # () -> bool, or None: a request waits to join (a long lone span gives way)
    counts: dict  # joined, left, spans, spans_dropped, steps, row_steps, most_rows, failed

    @property
    def busy(self) -> bool: ...

    def __len__(self) -> int: ...

    def join(self, request: Request): ...

    def leave(self, seq) -> None: ...

    def advance(self) -> list[tuple[object, Step | Exception]]: ...


@runtime_checkable
class EngineAPI(Protocol):
    """A loaded model as the server sees it (docs/engine-api.md)."""

    model_id: str
    model_type: str
    tokenizer: object
    chat_format: object
    takes_images: bool  # a vision tower is loaded (image_prompt)

    def chat_prompt(self, messages, tools=None, **template_kwargs) -> list[int]: ...

    def image_prompt(self, prompt, images: list[bytes]): ...

    def batch_problem(self) -> str | None: ...

    def spare_contexts(self) -> int | None: ...

    def batching(self) -> AbstractContextManager[BatchAPI]: ...

    def describe(self) -> str: ...

    def stats(self) -> dict: ...

    def expert_cache(self) -> dict: ...

    def resize_expert_cache(self, n_slots: int) -> None: ...

    def free_prompt_caches(self, nbytes: int) -> int: ...

    def prompt_caches_held(self) -> int: ...

    def restore_prompt_caches(self) -> None: ...

    def persist_prompt_cache(self) -> bool: ...

    def flush_prompt_caches(self) -> int: ...

    def close(self) -> None: ...
