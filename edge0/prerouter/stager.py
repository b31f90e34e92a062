"""Cross-token stager: after step t's graph is launched, read each head's prediction (it is ready
long before the step ends) and start reading those experts into the staged executors' next set;
at the step boundary, swap them in. Consumer layers then run with no host sync of routing."""

from __future__ import annotations

from edge0.backend import core as B


class PreRouterStager:
    def __init__(self, prerouting, staged: dict):
        self.pr, self.staged = prerouting, staged
        self.events: list[tuple] = []  # instrumentation: ("issue", step, layer) / ("done", step)

    def after_forward(self, engine, step: int, launched) -> None:
        """Step `step`'s graph is built and `launched` (its outputs) is being evaluated: issue the
        reads for step + 1 now."""
        B.async_eval(launched)
        for layer, inds in sorted(self.pr.next_indices().items()):
            if layer in self.staged:
                ex = self.staged[layer]
                if ex.wants_scores:  # the head's scores come with its route, in the same sync
                    scores = self.pr.next_scores[layer]
                    B.eval(inds, scores)
                    ex.stage(B.to_numpy(inds).ravel(), B.to_numpy(scores).ravel())
                else:
                    ex.stage(B.to_numpy(inds).ravel())
                self.events.append(("issue", step + 1, layer))

    def step_done(self, step: int) -> None:
        self.events.append(("done", step))

    def before_step(self, engine, step: int) -> None:
        """Boundary: swap the staged experts in; the predictions become this step's routes."""
        for layer in self.pr.next_indices():
            if layer in self.staged:
                self.staged[layer].swap()
        self.pr.advance()

    def finish(self, engine) -> None:
        """End of a generation: complete any reads in flight and forget predictions."""
        for ex in self.staged.values():
            ex.settle()
        self.pr.reset()
