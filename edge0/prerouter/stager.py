"""Cross-token stager: after step t's graph is launched, read each head's prediction (it is ready
long before the step ends) and start reading those experts into the staged executors' next set;
at the step boundary, swap them in. Consumer layers then run with no host sync of routing.

It is the pre-router's StepHooks: the engine calls it at every step of a generation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge0.backend import core as B
from edge0.engine.hooks import StepHooks
from edge0.streaming.staged import follow_routes


def one_row(ids):
    """Host routes [.., 1, K] -> [K] (one sequence) or [B, K] (a batch's rows)."""
    ids = ids.reshape(-1, ids.shape[-1])
    return ids[0] if len(ids) == 1 else ids


class PreRouterStager(StepHooks):
    sees_first_forward = True

    def __init__(self, prerouting, staged: dict, heads_path: Path | None = None):
        # no per-step history: a server runs this for millions of steps (tests wrap the methods instead)
        self.pr, self.staged, self.heads_path = prerouting, staged, heads_path
        self.recall: dict[int, list[int]] = {}  # diagnostic mode: layer -> [agreeing, predicted]
        self.last = False  # this step makes every sequence's last token: stage nothing
        self.ending: list[int] = []  # the batch's rows whose last token this step makes: not staged
        self.early: set[int] = set()  # layers whose next step was staged during this step's forward

    def start(self) -> None:
        self.pr.reset()
        self.last, self.ending = False, []

    def last_step(self, step: int, rows: list[int] | None = None) -> None:
        """No step follows (for `rows`, or for every sequence): their experts would be read for
        nothing (and waited for at the end)."""
        if rows is None:
            self.last = True
        else:
            self.ending = rows

    def multi_token(self, step: int, n_tokens: int) -> None:
        """A verify: pre-routed layers route each position as plain decoding would."""
        self.pr.verifying = True

    def rows(self, step: int, previous: list) -> None:
        """A batch's step: each row takes its own row's predictions; a row that joined since has
        none (it routes with the gate), so no layer may trust the staged route without a sync."""
        self.pr.select_rows(previous)
        if any(p is None for p in previous):
            for ex in self.staged.values():
                ex.distrust()

    def before_forward(self, step: int) -> None:
        self.pr.stepping = True
        self.early = set()
        if not self.pr.verifying and not self.last:
            follow_routes(self.staged.values(), self._stage_early)

    def _stage_early(self, layer: int) -> None:
        """Layer `layer` routed this step on the host (a batch's rows, or no prediction): the
        prediction for its next step is computed by then (its owner runs earlier in the forward),
        so its reads start now, while the rest of the forward computes, not after it."""
        if layer in self.pr.next:
            self._stage_layer(layer, self.pr.next[layer][0])
            self.early.add(layer)

    def after_forward(self, step: int, launched) -> None:
        """Step `step`'s graph is built and `launched` (its outputs) is being evaluated: issue the
        reads for step + 1 now (after a multi-token step: once it is known which position is kept),
        in the layers that did not start them during the forward."""
        B.async_eval(launched)
        follow_routes(self.staged.values(), None)
        if not self.pr.verifying and not self.last:
            self._stage(step)

    def kept(self, step: int, position: int) -> None:
        """The verify kept its inputs up to `position`: the heads' predictions there are the next
        step's routes; read their experts."""
        self.pr.keep(position)
        self._stage(step)

    def _stage(self, step: int) -> None:
        for layer, inds in sorted(self.pr.next_indices().items()):
            if layer not in self.early:
                self._stage_layer(layer, inds)

    def _stage_layer(self, layer: int, inds) -> None:
        ex = self.staged.get(layer)
        if ex is None:
            return
        if ex.wants_scores:  # the head's scores come with its route, in the same sync
            scores = self.pr.next_scores[layer]
            B.eval(inds, scores)
            per_row = self._continuing(B.to_numpy(scores).reshape(-1, scores.shape[-1]))
            ex.stage(self._continuing(one_row(B.to_numpy(inds))), per_row.mean(axis=0))
        else:
            ex.stage(self._continuing(one_row(B.to_numpy(inds))))

    def _continuing(self, per_row):
        """A batch's per-row array [B, ...] without the rows that end with this step (a batch
        stays a batch, [rows left, ...], even with one row left); one sequence's as it is."""
        return np.delete(per_row, self.ending, axis=0) if self.ending and per_row.ndim == 2 else per_row

    def step_done(self, step: int) -> None:
        self.pr.stepping = False
        self.last, self.ending = False, []
        self._collect_recall()

    def before_step(self, step: int) -> None:
        """Boundary: swap the staged experts in; the predictions become this step's routes."""
        for layer in self.pr.next_indices():
            if layer in self.staged:
                self.staged[layer].swap()
        self.pr.advance()

    def finish(self) -> None:
        """End of a generation: complete any reads in flight and forget predictions."""
        follow_routes(self.staged.values(), None)  # a forward that raised never reached after_forward
        for ex in self.staged.values():
            ex.settle()
        self.pr.reset()

    def teacher_forcing(self):
        return self.pr.teacher_forcing()

    def _collect_recall(self) -> None:
        """Diagnostic mode: read the device-side counts of predicted experts the gate agreed with."""
        pr = self.pr
        if not pr.overlaps:
            return
        for layer, hits in pr.overlaps.items():
            r = self.recall.setdefault(layer, [0, 0])
            r[0] += sum(int(h.item()) for h in hits)
            r[1] += len(hits) * pr.k
        pr.overlaps = {}

    def stats(self) -> dict:
        pr = self.pr
        return {
            "prerouter": {
                "heads": str(self.heads_path),
                "diagnostics": pr.diagnostics,
                "routed_by_head": dict(pr.routed_by_head),
                "routed_by_gate": dict(pr.routed_by_gate),
                "recall": {l: h / n for l, (h, n) in sorted(self.recall.items()) if n} if pr.diagnostics else None,
            }
        }
