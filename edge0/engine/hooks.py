"""StepHooks: the declared interface through which a feature (the pre-router's stager, a test
oracle) takes part in an engine's generation loop. Every hook has a default that does nothing,
so a feature overrides only what it needs and the engine calls each one unconditionally."""

from __future__ import annotations

from contextlib import nullcontext


class StepHooks:
    """Hooks called by Engine, in this order for one generation: start; per step: before_step
    (at the boundary, from step 1 on), before_forward, after_forward (the step's graph is built),
    step_done (its token was sampled); then finish. A multi-token step (a speculative verify)
    also calls multi_token after before_step, and kept before step_done; a step of a batch calls
    rows after before_step (and multi_token when its rows verify drafts); a plain step that
    makes the last token of a sequence (its token limit) calls last_step before before_forward."""

    # The feature acts on step 0's forward (the pre-router's heads predict step 1's routes during
    # it): the prompt's last token is then fed by that step, not in the prefill's last span
    # (Solo.prefill).
    sees_first_forward = False

    def start(self) -> None:
        """A generation or a teacher-forced pass begins: forget per-sequence state."""

    def before_step(self, step: int) -> None:
        """Step boundary: the previous step was evaluated whole."""

    def multi_token(self, step: int, n_tokens: int) -> None:
        """Step `step` feeds `n_tokens` > 1 tokens of a sequence (the last token and a draft; in a
        batch, each row's: no `kept` follows there)."""

    def rows(self, step: int, previous: list) -> None:
        """Step `step` is a batch's: row i was row `previous[i]` of the batch's last step, or
        None when it joined since (rows leave and join between steps)."""

    def last_step(self, step: int, rows: list[int] | None = None) -> None:
        """Step `step` makes the last token (the token limit) of the batch's rows `rows`, or of
        every sequence in it (None): no step of theirs follows, so nothing needs reading ahead for
        them."""

    def kept(self, step: int, position: int) -> None:
        """Multi-token step `step` kept its inputs up to `position` (the rest were rejected drafts);
        what it computed at that position carries to the next step."""

    def before_forward(self, step: int) -> None:
        """Step `step`'s forward is about to run (every step, 0 included; prefill chunks are not
        steps)."""

    def after_forward(self, step: int, outputs) -> None:
        """Step `step`'s graph is built; `outputs` are its (unevaluated) log-probabilities."""

    def step_done(self, step: int) -> None:
        """Step `step` was evaluated and its token sampled."""

    def finish(self) -> None:
        """The generation ended (or was abandoned): complete anything in flight."""

    def teacher_forcing(self):
        """Context for a full-sequence forward routed as decoding would route it."""
        return nullcontext()

    def stats(self) -> dict:
        """Entries merged into Engine.stats()."""
        return {}
