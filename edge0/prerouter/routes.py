"""Routes from the heads: the head owned by MoE layer N reads layer N's MoE input at token t and
predicts layer N+1's router logits at token t+1. The prediction, routed by the family's own
routing function, *is* layer N+1's route at t+1. PreRouting is the state the MoE blocks of one
engine share (SpecMoEBlock calls `predicted`, `teacher_forced` and `predict`)."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

from edge0.backend import core as B
from edge0.backend.routing import expert_scores, route


class PreRouting:
    """Heads by owner layer, the predicted routes for this step (`pending`) and the ones made
    during it for the next step (`next`).

    On a pipeline stage (edge0.distributed), `heads` are this stage's owners and `biases` its
    consumers' router biases; an owner whose consumer is in `remote` (a later stage) keeps its
    head's logits in `outgoing` for the stage exchange, and the consumer's stage routes them in
    `receive`, so the route is the same as in one process."""

    def __init__(
        self,
        heads: dict,
        consumer: dict,
        biases: dict,
        spec,
        k: int,
        diagnostics: bool = False,
        remote: frozenset = frozenset(),
    ):
        self.heads, self.consumer, self.biases, self.remote = heads, consumer, biases, remote
        self.spec, self.k, self.diagnostics = spec, k, diagnostics
        self.parallel = False  # full-sequence forward routed as decoding would (training, eval)
        self.verifying = False  # a multi-token decode step (speculative verify): routed as decoding would
        self.stepping = False  # inside a decode step (the stager says): a prefill span's one token is not one
        self.gate_rows = None  # a batch's step: [B] True for the rows with no prediction (they joined since)
        self.pending: dict = {}
        self.next: dict = {}
        self.next_scores: dict = {}  # consumer layer -> the head's scores over all experts (lazy)
        self.outgoing: dict = {}  # remote consumer layer -> head logits for the next step (lazy)
        self.overlaps: dict = {}  # consumer layer -> device scalars (diagnostic mode)
        self.routed_by_head: Counter = Counter()  # decode calls per layer that used a prediction
        self.routed_by_gate: Counter = Counter()  # ... and that evaluated the layer's own gate

    def reset(self) -> None:
        self.pending, self.next, self.next_scores, self.outgoing, self.overlaps = {}, {}, {}, {}, {}
        self.verifying = self.stepping = False
        self.gate_rows = None

    @contextmanager
    def teacher_forcing(self):
        """A full-sequence forward inside this context routes every pre-routed layer at position t
        with the head's prediction from t-1 (position 0 with the gate): the routes decoding uses."""
        self.reset()
        self.parallel = True
        try:
            yield
        finally:
            self.parallel = False
            self.reset()

    # -- the MoE block's hooks ------------------------------------------------------------------
    def predicted(self, block, x):
        """A decode call's route predicted at the previous token, or None (use the gate). In a
        multi-token step, position 0 takes the route predicted at the previous step and position
        t > 0 the one this step's head predicted at t - 1: the routes plain decoding would use."""
        if x.shape[-2] != 1:
            return self._verify_route(block, x) if self.verifying else None
        if not self.stepping:  # a one-token prefill span (a sequence joining a batch)
            return None
        r = self.pending.pop(block.layer, None)
        (self.routed_by_gate if r is None else self.routed_by_head)[block.layer] += 1
        if r is not None and self.gate_rows is not None:  # rows that joined since route with the gate
            gate = block.gate_route(x)[:2]
            r = tuple(B.where(self.gate_rows[:, None, None], g, p) for g, p in zip(gate, r))
        if r is not None and self.diagnostics:
            self.compare(block.layer, r[0], block.gate_route(x)[0])
        return r

    def _verify_route(self, block, x):
        made = self.next.get(block.layer)  # by the owner layer, earlier in this forward: [.., T, K]
        if made is None:
            return None
        first = self.pending.get(block.layer)  # kept until advance(): a replay of the step reads it again
        if first is None:
            self.routed_by_gate[block.layer] += 1
            first = block.gate_route(x[..., :1, :])[:2]
        self.routed_by_head[block.layer] += x.shape[-2] - 1
        return tuple(B.concatenate([f, m[..., :-1, :]], axis=-2) for f, m in zip(first, made))

    def teacher_forced(self, layer: int, inds, scores):
        """In a teacher-forced pass, position t takes the head's route from t-1 (position 0 keeps
        the gate's); otherwise the gate's route as it is."""
        if not self.parallel or inds.shape[-2] == 1 or layer not in self.next:
            return inds, scores
        p_inds, p_scores = self.next.pop(layer)
        return (
            B.concatenate([inds[..., :1, :], p_inds[..., :-1, :]], axis=-2),
            B.concatenate([scores[..., :1, :], p_scores[..., :-1, :]], axis=-2),
        )

    def predict(self, layer: int, x) -> None:
        """Owner layer hook: predict the consumer's route for the next token."""
        if layer not in self.heads or not (self.parallel or (self.stepping and (x.shape[-2] == 1 or self.verifying))):
            return
        c = self.consumer[layer]
        logits = self.heads[layer](x.astype(B.float32))
        if c in self.remote:
            self.outgoing[c] = logits
        else:
            self.receive(c, logits)

    def receive(self, layer: int, logits) -> None:
        """The head logits [.., T, E] predicting consumer `layer`'s next route."""
        self.next[layer] = route(logits, self.spec.routing, self.k, self.biases[layer])
        self.next_scores[layer] = expert_scores(logits, self.spec.routing)  # for the expert cache

    def take_outgoing(self) -> dict:
        """The predictions made on this stage for consumers on a later one (since the last call)."""
        out, self.outgoing = self.outgoing, {}
        return out

    def compare(self, layer: int, predicted, gate) -> None:
        """Diagnostic mode: count predicted experts that the gate also picked (on the device)."""
        hit = (predicted[..., :, None] == gate[..., None, :]).any(axis=-1).sum()
        self.overlaps.setdefault(layer, []).append(hit)

    # -- the step boundary ----------------------------------------------------------------------
    def keep(self, position: int) -> None:
        """A multi-token step kept its inputs up to `position`: the predictions made there are
        the next step's routes."""
        self.verifying = False

        def at(a):
            return a[..., position : position + 1, :]

        self.next = {c: (at(i), at(w)) for c, (i, w) in self.next.items()}
        self.next_scores = {c: at(s) for c, s in self.next_scores.items()}

    def select_rows(self, previous: list) -> None:
        """A batch's step: row i continues row `previous[i]` of the last step, whose predictions
        it takes; a row that joined since (None) routes this step with the gate, as a sequence's
        first step (the prompt's last token) does alone."""
        if all(p is None for p in previous):
            self.pending, self.gate_rows = {}, None
            return
        take = B.array([0 if p is None else p for p in previous])
        self.pending = {c: tuple(a[take] for a in r) for c, r in self.pending.items()}
        joined = [p is None for p in previous]
        self.gate_rows = B.array(joined) if any(joined) else None

    def advance(self) -> None:
        """The predictions made during this step become the next step's routes."""
        self.pending, self.next, self.next_scores = self.next, {}, {}
        self.gate_rows = None

    def next_indices(self) -> dict:
        return {c: inds for c, (inds, _) in self.next.items()}
