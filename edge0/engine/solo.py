"""The lone sequence of a batch (batch.py): while a sequence is the only one, it runs in the
engine's working KV cache (kv.PromptCache) as one generation always has, so a batch of one costs
what one generation costs: its prompt fed whole (layer-major spans, cancellable between layers),
its steps plain or speculative (the engine's speculator, with sampled verification and the
replays of caches that cannot be cut back), the end of its prompt kept for the conversation's
next turn. When another sequence joins, the batch takes the lone one's cache out of the working
cache (`PromptCache.take`) and it goes on as any other sequence."""

from __future__ import annotations

from edge0.engine.request import Request
from edge0.errors import Edge0Error

# mlx-lm's quantized KV cache needs key widths its group size divides
KV_GROUP = (
    "--kv-group-size {group} does not divide this model's attention key width; use --kv-group-size 32 "
    "(or drop --kv-bits)"
)


class Solo:
    """The lone sequence's prefill and steps on an engine's working cache."""

    def __init__(self, engine):
        self.engine = engine

    def prepare(self, seq) -> None:
        """The working cache holds the longest prefix of `seq`'s prompt the prompt caches have
        (with reuse; else an empty cache)."""
        r: Request = seq.request
        seq.held = seq.fed = self.engine.kv.prepare(seq.prompt, r.reuse, r.namespace)
        seq.prepared = True

    def prefill(self, seq, stop=None) -> bool:
        """Feed `seq`'s prompt but its last token (after the prefix the prompt caches hold);
        False when `stop()` said so between layers or spans: what went into every layer stays
        (a cache that cannot be cut back is dropped, and the prompt caches are asked again)."""
        e = self.engine
        kv = e.kv
        if not seq.prepared:  # its cache was dropped (a cancelled span in a cache that cannot be cut back)
            self.prepare(seq)
        todo = seq.prompt[seq.fed : -1]
        kv.begin()
        try:
            fed = e.prefiller(todo, kv.cache, stop)
        except Exception as error:
            kv.failed(error)  # a cache restored from disk that fails is not restored again
            if fix := _kv_group(kv, error):
                raise fix from None
            raise
        kv.receipt = None  # a forward on the restored cache went through
        if fed < len(todo) or (stop is not None and stop()):
            if kv.keep(todo[:fed]):
                seq.fed += fed
            else:
                seq.prepared = False
            return False
        kv.advance(todo)
        seq.fed += len(todo)
        return True

    def steps(self, seq):
        """The lone row's steps, each the list of tokens it made (a verify makes several); the
        first feeds the prompt's last token. At each yield the cache holds what was fed."""
        e = self.engine
        kv, reply = e.kv, seq.reply
        try:
            y = e.stepper.decode(seq.prompt[-1:], 0, seq.sampler, reply.max_tokens <= 1)
        except ValueError as error:
            if fix := _kv_group(kv, error):
                raise fix from None
            raise
        kv.mark_prompt_end()
        yield [y]
        generated, spec = reply.tokens, e.speculation
        if spec is not None and seq.sampler.plain:
            yield from spec.decode(e.stepper, seq.prompt, generated, seq.sampler, reply.max_tokens, reply.eos)
            return
        if spec is not None:  # a verify samples its rows without the request's processors, top-k or log-probs
            spec.counts["unsupported_requests"] += 1
        while True:  # the step makes token len(generated) + 1
            n = len(generated)
            yield [e.stepper.decode(generated[-1:], n, seq.sampler, n + 1 >= reply.max_tokens)]


def _kv_group(kv, error: Exception) -> Edge0Error | None:
    """mlx-lm's quantized cache refuses key widths its group size does not divide: the error that
    says the fix (the cache is dropped), or None for any other error."""
    if isinstance(error, ValueError) and kv.kv_bits and "group size" in str(error):
        kv.reset()
        return Edge0Error(KV_GROUP.format(group=kv.kv_group_size))
    return None
