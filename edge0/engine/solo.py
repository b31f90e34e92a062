"""The lone sequence of a batch (batch.py): while a sequence is the only one, it runs in its own
cache as one generation always has, so a batch of one costs what one generation costs: its prompt
fed whole (layer-major spans, cancellable between layers), its steps plain or speculative (the
engine's speculator, with sampled verification and the replays of caches that cannot be cut
back), the end of its prompt kept for the conversation's next turn. When another sequence joins,
its cache becomes a row of the batch's (or stays its own while it prefills) and it goes on as any
other sequence."""

from __future__ import annotations

from edge0.backend import kvcache as bkv
from edge0.engine.parts import Parts
from edge0.engine.request import Request
from edge0.errors import Edge0Error

# mlx-lm's quantized KV cache needs key widths its group size divides
KV_GROUP = (
    "--kv-group-size {group} does not divide this model's attention key width; use --kv-group-size 32 "
    "(or drop --kv-bits)"
)


class Solo:
    """The lone sequence's prefill and steps, in the cache it checked out of the prompt caches."""

    def __init__(self, parts: Parts):
        self.parts = parts

    def prepare(self, seq) -> None:
        """`seq`'s cache: the longest prefix of its prompt the prompt caches hold (with reuse; else
        an empty cache)."""
        r: Request = seq.request
        kv = self.parts.kv
        seq.cache, seq.held, seq.receipt = kv.checkout(seq.key(seq.prompt), r.namespace, r.reuse)
        seq.fed, seq.prepared = seq.held, True
        self.parts.prefiller.place(seq.cache, r.vision)

    def prefill(self, seq, stop=None) -> bool:
        """Feed `seq`'s prompt (after the prefix its cache holds) but its last token, which its
        first step feeds; or, layer by layer with more than that token left, all of it, the last
        token in its span with the log-probs after it kept for the first step (`seq.first`), so
        that token's experts are read with the span's and not again. False when `stop()` said so
        between layers or spans: what went into every layer stays (a cache that cannot be cut back
        is dropped, and the prompt caches are asked again)."""
        e = self.parts
        if seq.first is not None:  # its whole prompt is in
            return True
        if not seq.prepared:  # its cache was dropped (a cancelled span in a cache that cannot be cut back)
            self.prepare(seq)
        whole = (
            e.prefiller.takes_last(seq.cache)
            and not e.stepper.hooks.sees_first_forward
            and len(seq.prompt) - seq.fed >= 2
            and seq.request.vision is None
        )
        todo = seq.prompt[seq.fed :] if whole else seq.prompt[seq.fed : -1]
        try:
            fed, first = e.prefiller.feed(todo, seq.cache, stop, logits=whole, image=(seq.request.vision, seq.fed))
        except Exception as error:
            # a cache restored from disk that fails is not restored again, whoever catches this
            e.kv.failed(error, seq.receipt)
            seq.receipt = None
            if fix := _kv_group(e.kv, error):
                raise fix from None
            raise
        seq.receipt = None  # a forward on the restored cache went through
        if fed < len(todo):
            if bkv.trim_to(seq.cache, seq.fed + fed):
                seq.fed += fed
            else:
                seq.prepared, seq.cache = False, None
            return False
        seq.fed += len(todo)
        seq.first = first
        # a newcomer waits: it joins before this one steps, unless this one's first token is computed
        return first is not None or stop is None or not stop()

    def steps(self, seq):
        """The lone row's steps, each the list of tokens it made (a verify makes several); the
        first feeds the prompt's last token (or samples from the log-probs the prefill computed
        after it). At each yield the cache holds the prompt and every
        token made but the last (`seq.made`)."""
        e = self.parts
        kv, reply, cache = e.kv, seq.reply, seq.cache
        first, seq.first = seq.first, None
        try:
            if first is not None:  # the prefill fed the prompt's last token
                y = e.stepper.first(first, seq.sampler, reply.max_tokens <= 1)
            else:
                y = e.stepper.decode(seq.prompt[-1:], 0, seq.sampler, cache, reply.max_tokens <= 1)
        except ValueError as error:
            if fix := _kv_group(kv, error):
                raise fix from None
            raise
        if seq.reuse and kv.needs_prompt_copy(cache):
            kv.keep_prompt(seq.key(seq.prompt), bkv.copy_cache(cache), seq.namespace)
        yield self._made(seq, [y])
        generated, spec = reply.tokens, e.speculation
        if spec is not None and seq.sampler.plain:
            for ys in spec.decode(e.stepper, cache, seq.prompt, generated, seq.sampler, reply.max_tokens, reply.eos):
                yield self._made(seq, ys)
            return
        if spec is not None:  # a verify samples its rows without the request's processors, top-k or log-probs
            spec.counts["unsupported_requests"] += 1
        while True:  # the step makes token len(generated) + 1
            n = len(generated)
            yield self._made(seq, [e.stepper.decode(generated[-1:], n, seq.sampler, cache, n + 1 >= reply.max_tokens)])

    @staticmethod
    def _made(seq, ys: list[int]) -> list[int]:
        seq.made += ys
        return ys

    @staticmethod
    def fed(seq) -> list[int]:
        """The tokens `seq`'s cache holds between its steps: the prompt fed so far, or, once it
        steps, the prompt and what its steps made but the last (a verify may have fed tokens past
        a stop its reply ended on)."""
        return seq.prompt + seq.made[:-1] if seq.made else seq.prompt[: seq.fed]


def _kv_group(kv, error: Exception) -> Edge0Error | None:
    """mlx-lm's quantized cache refuses key widths its group size does not divide: the error that
    says the fix, or None for any other error."""
    if isinstance(error, ValueError) and kv.kv_bits and "group size" in str(error):
        return Edge0Error(KV_GROUP.format(group=kv.kv_group_size))
    return None
