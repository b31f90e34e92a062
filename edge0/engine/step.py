"""One decode step, in one place: T new tokens of a sequence through the model (T = 1 for a plain
step, the last token and k drafts for a speculative verify), or one token of each of B sequences
(a batch, batch.py), through the cache the caller hands it, with the step hooks in their order.
The engine's decode loop, the speculative verify, a pipeline follower and the bench's verify
timing all run their steps here; nothing else calls the step hooks.

Step n, in order (edge0/engine/hooks.py): before_step (n > 0: the previous step was evaluated
whole), multi_token (T > 1), rows (a batch's step: which row each row was), before_forward, the
forward, after_forward (the graph is built), the caller's `finish` on the outputs (a sample, an
accept/reject, a send to the next rank), kept (a verify: how many of its T tokens it kept),
step_done, the executors' end of step; then the cache holds the kept tokens."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

from edge0.backend import core as B
from edge0.backend import forward as bfw
from edge0.backend import kvcache as bkv


class Stepper:
    """An engine's steps (the speculator, a batch and a follower are handed this, not the
    engine): its model, its executors (`streaming`) and the step hooks features attach."""

    def __init__(self, model, streaming, hooks):
        self.model, self.streaming, self.hooks = model, streaming, hooks
        # a verify's rewind feeds the kept tokens again even where this process's layers all cut
        # back: a pipeline's rank 0 when another rank's layers may not (recurrent state, a sliding
        # window; Pipeline.lead)
        self.replays = False

    def run(
        self,
        step: int,
        n_tokens: int,
        forward: Callable,
        finish: Callable,
        per_row: int = 0,
        previous=None,
        last: bool = False,
        ending: list[int] = (),
    ):
        """The protocol above: `forward()` builds the outputs, `finish(outputs)` returns
        (result, kept: the position up to which a multi-token step's inputs were kept, or None).
        A batch's step passes its tokens per row (`per_row`) and each row's `previous` index;
        `last`: the step makes every sequence's last token; `ending`: the rows whose last token it
        makes (some of a batch's)."""
        hooks = self.hooks
        if step > 0:
            hooks.before_step(step)
        if (per_row or n_tokens) > 1:  # T > 1 tokens of a sequence (a verify), not one token per row
            hooks.multi_token(step, n_tokens)
        if previous is not None:
            hooks.rows(step, previous)
        if last:
            hooks.last_step(step)
        elif ending:
            hooks.last_step(step, list(ending))
        hooks.before_forward(step)
        # T tokens of one sequence are one decode call: each MoE layer reads their union once
        with self.streaming.decoding() if n_tokens > 1 else nullcontext():
            out = forward()
        hooks.after_forward(step, out)
        result, kept = finish(out)
        if kept is not None:
            hooks.kept(step, kept)
        hooks.step_done(step)
        self.streaming.end_step()
        return result

    # -- the engine's steps ----------------------------------------------------------------------
    def decode(self, tokens: list[int], step: int, sampler, cache, last: bool = False) -> int:
        """A plain step: `tokens` (the prompt's last token or the last generated one) fed through
        `cache`, one token sampled with `sampler`; the cache then also holds `tokens`. `last`: the
        sequence's token limit is reached with this token."""
        return self.run(
            step,
            1,
            lambda: bfw.forward(self.model, tokens, cache),
            lambda logprobs: (bfw.sample(sampler, logprobs), None),
            last=last,
        )

    def first(self, logprobs, sampler, last: bool = False) -> int:
        """Step 0 of a sequence whose prefill fed its prompt's last token (Solo.prefill): its
        forward is done, `logprobs` [1, V] are its outputs; the hooks run as for any step."""
        return self.run(0, 1, lambda: logprobs, lambda lp: (bfw.sample(sampler, lp), None), last=last)

    def decode_batch(
        self, tokens: list[int], step: int, samplers: list, cache, previous: list, ending: list[int] = ()
    ) -> list[int | Exception]:
        """A step of a batch (batch.py): one token of each sequence, fed through the merged
        `cache`; one token sampled per row with that sequence's sampler. Row i was row
        `previous[i]` of the last step (None: it joined since); `ending`: the rows whose token
        limit is reached with this step. A row whose sampler raised gets the exception instead of
        a token (sample_row)."""
        return self.run(
            step,
            len(tokens),
            lambda: bfw.forward_rows(self.model, tokens, cache),
            lambda logprobs: (sample_rows(samplers, logprobs), None),
            per_row=1,
            previous=previous,
            last=len(ending) == len(tokens),
            ending=ending,
        )

    def verify_batch(self, rows: list[list[int]], step: int, decide: Callable, cache, previous: list):
        """A multi-token step of a batch: row i feeds `rows[i]` (its last token and a draft, or its
        last token alone; shorter rows are padded with their last token, positions nothing reads).
        `decide(logprobs [B, T, V])` returns (result, kept: how many of its inputs each row keeps);
        each row's cache then drops the rest."""
        width = max(len(r) for r in rows)
        padded = [r + [r[-1]] * (width - len(r)) for r in rows]

        def finish(logprobs):
            B.eval(logprobs)  # the shared forward: its failure is the batch's, never one row's (sample_row)
            result, kept = decide(logprobs)
            bkv.drop_row_tails(cache, [width - k for k in kept])
            return result, None

        return self.run(
            step,
            len(rows) * width,
            lambda: bfw.forward_rows_all(self.model, padded, cache),
            finish,
            per_row=width,
            previous=previous,
        )

    def verify(self, step: int, inputs: list[int], decide: Callable, cache) -> tuple[int, int, bool]:
        """A multi-token step of `inputs` (the last token and a draft) through `cache`:
        `decide(logprobs [T, V])` returns (n, next) where the first n draft tokens are kept; the
        cache is taken back to `inputs[: n + 1]`. Returns (n, next, whether the kept tokens were
        fed again: recurrent layers cannot be trimmed, so they went back to before the step)."""
        point = bkv.rewind_point(cache, replay=self.replays)
        replayed = False

        def finish(logprobs):
            nonlocal replayed
            n, nxt = decide(logprobs)
            keep = inputs[: n + 1]
            if len(keep) < len(inputs) and bkv.rewind(cache, len(inputs) - len(keep), len(inputs), point):
                with self.streaming.decoding():
                    bfw.prefill(self.model, keep, cache)
                replayed = True
            return (n, nxt), n

        n, nxt = self.run(step, len(inputs), lambda: bfw.forward_all(self.model, inputs, cache), finish)
        return n, nxt, replayed

    def kept_after(self, step: int, position: int) -> None:
        """A pipeline follower: rank 0's verify of step `step` kept its inputs up to `position`,
        which rank 0's next message says (after this rank's step ended); the hooks hear it then,
        before the next step, as one process's hear it before that step."""
        self.hooks.kept(step, position)

    def follow(self, step: int, n_tokens: int, forward: Callable, send: Callable, cache, **rows):
        """A pipeline follower's step of `n_tokens` tokens: this stage's forward (`forward()`,
        evaluated here with its `cache`) and `send(out)` to the next rank between after_forward
        and step_done; `rows`: a batch's `per_row`, `previous`, `last` and `ending`, as rank 0's
        step had them (`run`)."""

        def finish(out):
            B.eval(out, [c.state for c in cache])
            send(out)
            return out, None

        return self.run(step, n_tokens, forward, finish, **rows)


def sample_rows(samplers: list, logprobs) -> list[int | Exception]:
    """Each row's token (sample_row), after the shared forward is evaluated: its failure is the
    batch's, never charged to the row whose sample happened to evaluate it."""
    B.eval(logprobs)
    return [sample_row(s, logprobs[i]) for i, s in enumerate(samplers)]


def sample_row(sampler, logprobs) -> int | Exception:
    """A batch row's token, or the exception its sampler raised (a grammar refusing, log-probs
    that are not finite): that row ends with it, the other rows go on."""
    try:
        return bfw.sample(sampler, logprobs)
    except Exception as e:  # noqa: BLE001 - whatever one request's processors raise is that request's
        return e
