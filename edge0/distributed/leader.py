"""Rank 0's step hooks across ranks: the engine's own, plus telling the other ranks where a
generation is and what each batch step's rows are (distributed/pipeline.py sends it)."""

from __future__ import annotations

import time

from edge0.engine.hooks import StepHooks


class LeaderHooks(StepHooks):
    """Rank 0's hooks: the engine's own (the pre-router's stager, or none), plus telling the other
    ranks where a generation is."""

    sees_first_forward = True

    def __init__(self, inner: StepHooks, pipeline):  # pipeline: its Pipeline (pipeline.py)
        self.inner, self.pipeline = inner, pipeline

    def start(self) -> None:
        self.pipeline.start()
        self.inner.start()

    def before_step(self, step: int) -> None:
        self.inner.before_step(step)

    def multi_token(self, step: int, n_tokens: int) -> None:
        self.inner.multi_token(step, n_tokens)

    def rows(self, step: int, previous: list) -> None:
        self.pipeline.previous = [None if p is None else int(p) for p in previous]
        self.inner.rows(step, previous)

    def last_step(self, step: int, rows: list[int] | None = None) -> None:
        if rows is None:
            self.pipeline.last = True
            self.inner.last_step(step)
        else:
            self.pipeline.ending = [int(r) for r in rows]
            self.inner.last_step(step, rows)

    def kept(self, step: int, position: int) -> None:
        self.pipeline.kept = [int(step), int(position)]
        self.inner.kept(step, position)

    def before_forward(self, step: int) -> None:
        self.pipeline.step = step
        self.inner.before_forward(step)

    def after_forward(self, step: int, outputs) -> None:
        p = self.pipeline
        p.step, p.previous, p.last, p.ending = -1, None, False, None
        self.inner.after_forward(step, outputs)

    def step_done(self, step: int) -> None:
        self.pipeline.compute_s += time.perf_counter() - self.pipeline.received_at
        self.inner.step_done(step)

    def finish(self) -> None:
        self.inner.finish()
        if self.pipeline.generating:
            self.pipeline.finish()

    def teacher_forcing(self):
        return self.inner.teacher_forcing()

    def stats(self) -> dict:
        return self.inner.stats()
