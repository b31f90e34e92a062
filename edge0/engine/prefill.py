"""Feeding a prompt into the KV cache: layer-major spans where the model allows it, so a long
prompt reads each layer's experts once per span (edge0.backend.layerwise), otherwise mlx-lm's
chunked forward, which reads them once per chunk (counted as `prefill_chunked_spans`, and said
by `describe()` with the reason, from the probe run at load)."""

from __future__ import annotations

from edge0.backend import core as B
from edge0.backend import forward as bfw
from edge0.backend import layerwise as blw
from edge0.backend import stages as bstages
from edge0.backend import vision as bvision
from edge0.errors import Edge0Error
from edge0.spec import HIDDEN_KEYS, model_dims

# The span's activations (about 6 x tokens x hidden x 4 bytes at a layer's peak: its input, the
# post-attention residual, the MoE input, the MoE output in chunks and joined, and the sum) stay
# under this bound; a longer prompt goes in several spans, each reading each expert once.
SPAN_ACTIVATION_BYTES = 512 << 20
MOE_CHUNK = 512  # tokens per MoE call inside a span (bounds the experts' intermediate activations)
# mlx-lm's chunked forward (the fallback): 2048-token chunks, 512 when the caller can cancel,
# since a cancellation is seen only between chunks. A span whose attention runs in one call
# (layerwise.whole_span) is no longer than mlx-lm's chunk, so its score matrix is no larger.
CHUNK, CANCELLABLE_CHUNK = 2048, 512
DEFAULT_HEADS = 32  # for the score-matrix bound when the config does not say


class Prefiller:
    """Feeds prompt tokens into a model's cache; counts spans fed layer by layer and chunk by chunk."""

    def __init__(self, model, compute_dtype: str, span_tokens: int | None = None, layerwise: bool = True, stage=None):
        """`span_tokens`: tokens per span (default from SPAN_ACTIVATION_BYTES); `layerwise`
        False: always the chunked forward. `stage`: this rank's pipeline stage (edge0.distributed),
        whose spans go layer by layer through its own layers where mlx-lm pipelines the family."""
        self.model, self.compute_dtype = model, compute_dtype
        hidden, heads = model_dims(blw.lp.model_config(model))
        self.probe = self._probe(hidden, stage) if layerwise else blw.lp.Probe(why_not="switched off")
        self.hidden, self.heads = hidden or self.probe.hidden, heads or DEFAULT_HEADS
        self.span_tokens = span_tokens or default_span(self.hidden)
        self.layerwise = layerwise and self.probe.why_not is None
        self.moe_chunk, self.score_bytes = MOE_CHUNK, blw.SCORE_BYTES
        self.skip_last = True  # the last layer computes its cache alone (backend/layerwise.py)
        self.spans = 0  # spans fed layer by layer
        self.chunked_spans = 0  # spans fed by the chunked forward (the model does not allow layers)
        self.tower = None  # a VL store's vision tower (edge0.backend.vision.Tower)
        self.image_chunks = 0  # chunks of image prompts, fed by the chunked forward with their images

    def __call__(self, tokens: list[int], cache, should_stop=None, image=(None, 0)) -> int:
        """Feed `tokens`; returns how many went into every layer: all of them, or fewer when
        `should_stop()` said so between layers or chunks (the cache may then hold part of the
        next span in its first layers; kv.PromptCache.keep trims that)."""
        return self.feed(tokens, cache, should_stop, image=image)[0]

    def feed(self, tokens: list[int], cache, should_stop=None, logits: bool = False, image=(None, 0)):
        """`__call__`, returning (tokens fed, log-probs [1, V] after the last token or None).
        `logits` (layer by layer only): the last span also computes the log-probs after its last
        token, for that position alone, so the prompt's last token is fed in its span and its
        experts are read once with the span's instead of again by a first decode step. `image`:
        (the prompt's ImagePrompt or None, where `tokens` start in it): an image prompt is fed chunk
        by chunk with its embeddings, positions and DeepStack features (not layer by layer yet)."""
        if not tokens:
            return 0, None
        if image[0] is not None:
            return self._with_images(image[0], image[1], len(tokens), cache, should_stop), None
        if not self.layerwise:
            return self._chunked(tokens, cache, should_stop), None
        span = self.span_for(cache)
        plan = blw.SpanPlan(self.moe_chunk, self.heads, should_stop, self.score_bytes, self.skip_last)
        logprobs = None
        for i in range(0, len(tokens), span):
            part = tokens[i : i + span]
            try:
                logprobs = blw.prefill_layerwise(
                    self.model, part, cache, plan, self.probe, logits and i + len(part) == len(tokens)
                )
            except blw.PrefillCancelled:
                return i, None
            self.spans += 1
        return len(tokens), logprobs

    def _probe(self, hidden: int, stage):
        """The layer probe's findings for this model (a stage's, with a stand-in for its input)."""
        if stage is None:
            return blw.probe(self.model)
        with bstages.probe_input(self.model, hidden, B.dtype(self.compute_dtype)):
            return blw.probe(self.model)

    def stage_span(self, hidden, cache):
        """A pipeline stage's share of a span rank 0 feeds layer by layer: its input `hidden` [1, T,
        D] through its own layers, one at a time, into `cache`; returns what it sends on (its last
        layer's output, computed, unlike one process's last layer; stages.stage_output)."""
        plan = blw.SpanPlan(self.moe_chunk, self.heads, None, self.score_bytes, skip_last=False)
        # rank 0 sizes spans by its own layers: one longer than this stage's layers take at once
        # (a layer whose attention runs over the span in one call) goes in pieces here
        piece, t = self.span_for(cache), int(hidden.shape[1])
        outs = []
        for i in range(0, t, piece):
            out = blw.prefill_layerwise(self.model, hidden[:, i : i + piece], cache, plan, self.probe, output=True)
            outs.append(bstages.stage_output(self.model, out))
            self.spans += 1
        return outs[0] if len(outs) == 1 else B.concatenate(outs, axis=1)

    def takes_last(self, cache) -> bool:
        """Whether `feed` can give the log-probs after the prompt's last token into `cache`: layer
        by layer, where every layer takes its span in chunks (a rotating window cache fed a whole
        span holds more than its window until a one-token step trims it: the first decode step
        does that)."""
        return self.layerwise and not blw.whole_span(self.probe, cache)

    def span_for(self, cache) -> int:
        """Tokens one span feeds into `cache` (a batch prefills a joining sequence span by span,
        between decode steps)."""
        if not self.layerwise:
            return CANCELLABLE_CHUNK
        return min(self.span_tokens, CHUNK) if blw.whole_span(self.probe, cache) else self.span_tokens

    def place(self, cache, vision) -> None:
        """Where the tokens after a prompt go: each at its cache offset plus the prompt's rope delta
        (images take fewer positions than tokens); a model without a tower places them at the offset."""
        if self.tower is not None:
            bvision.set_rope_delta(cache, self.tower.features(vision).delta if vision is not None else 0)

    def _with_images(self, prompt, start: int, n: int, cache, should_stop) -> int:
        chunk = CANCELLABLE_CHUNK if should_stop else CHUNK
        for i in range(0, n, chunk):
            if should_stop and should_stop():
                return i
            self.tower.feed(self.model, prompt, start + i, start + min(n, i + chunk), cache)
            self.image_chunks += 1
        return n

    def _chunked(self, tokens, cache, should_stop) -> int:
        chunk = CANCELLABLE_CHUNK if should_stop else CHUNK
        for i in range(0, len(tokens), chunk):
            if should_stop and should_stop():
                return i
            bfw.prefill(self.model, tokens[i : i + chunk], cache, chunk)
        self.chunked_spans += 1
        return len(tokens)

    def describe(self) -> str:
        """How prompts are fed, for the engine's describe line."""
        if self.layerwise:
            return f"prefill layer by layer ({self.span_tokens}-token spans)"
        why = self.probe.why_not or "switched off"
        return f"prefill chunk by chunk, not layer by layer: {why}"

    def stats(self) -> dict:
        return {
            "prefill_spans": self.spans,
            "prefill_chunked_spans": self.chunked_spans,
            "prefill_image_chunks": self.image_chunks,
            "prefill_span_tokens": self.span_tokens,
            "prefill_layerwise": self.layerwise,
        }


def default_span(hidden: int) -> int:
    """Tokens per span whose activations fit SPAN_ACTIVATION_BYTES (float32), at least MOE_CHUNK."""
    if hidden <= 0:
        raise Edge0Error(
            f"config.json names no hidden size ({', '.join(HIDDEN_KEYS)}); edge0 cannot size its prefill spans "
            "for this model; pass --prefill-span N"
        )
    return max(MOE_CHUNK, SPAN_ACTIVATION_BYTES // (6 * hidden * 4))
