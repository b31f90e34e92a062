"""Layer-major prefill (edge0.backend.layerwise): the same KV cache, logits and greedy tokens as
mlx-lm's chunked forward for every family; each layer's experts read once per span; cancellation
between layers; a layer that does not add its MoE output to the residual is detected."""

import time

import httpx
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import edge0
from edge0.backend import layerwise as blw
from edge0.backend.moe import StreamingExperts
from edge0.errors import Edge0Error
from edge0.server.config import ServerConfig
from tests.fake_server import running_server
from tests.fixtures import ALL_FAMILIES, CHUNKED_PREFILL
from tests.fixtures.families import SPECD, UNIVERSAL

PROMPT = [(7 * i) % 200 + 10 for i in range(300)]


def feed(engine, tokens, layerwise: bool):
    """A fresh cache fed with `tokens` by one of the two prefills; (cache, log-probs of the next token)."""
    from edge0.backend import forward as bfw

    engine.prefiller.layerwise = layerwise
    cache = engine.kv.make()
    assert engine.prefiller(tokens[:-1], cache)
    return cache, np.array(bfw.forward(engine.model, tokens[-1:], cache))


def state(cache) -> list[np.ndarray]:
    """The arrays of the caches a span feeds in pieces (a rotating window's layout depends on how
    its tokens came, so only its logits are compared)."""
    pieces = [c for c in cache if isinstance(c, blw.CHUNKABLE_CACHES)]
    return [np.array(a.astype(mx.float32)) for a in blw._state_arrays(pieces)]


# Families whose layers are called with more than (h, mask, cache) or answer with a tuple, whose
# experts are a list, or whose caches take a span in one call: hunyuan (cross-layer KV, a tuple),
# bailing_moe_linear (an offset), mistral4 (an attention scale), gpt_oss (sliding windows), dbrx
# (a list of experts), kimi_k3 (linear attention and MLA in a vision wrapper). -m slow: every family.
CALL_FORMS = ("hunyuan", "bailing_moe_linear", "mistral4", "gpt_oss", "dbrx", "kimi_k3")
LAYERWISE = SPECD + UNIVERSAL + CALL_FORMS
OTHERS = [pytest.param(f, marks=pytest.mark.slow) for f in sorted(set(ALL_FAMILIES) - set(LAYERWISE) - CHUNKED_PREFILL)]


@pytest.mark.parametrize("family", LAYERWISE + tuple(OTHERS))
def test_same_cache_logits_and_tokens_as_the_chunked_forward(family, store_for):
    engine = edge0.load(store_for(family), dtype="float32", prerouter=False)
    p = engine.prefiller
    p.span_tokens, p.moe_chunk, p.score_bytes = 128, 48, 1  # 3 spans, several MoE and attention chunks
    chunked_cache, chunked = feed(engine, PROMPT, layerwise=False)
    spans_before = p.spans
    cache, ours = feed(engine, PROMPT, layerwise=True)
    assert p.spans - spans_before == 3  # fed layer by layer, not through the fallback
    assert np.abs(ours - chunked).max() <= 1e-4
    for a, b in zip(state(cache), state(chunked_cache), strict=True):
        assert a.shape == b.shape and np.abs(a - b).max() <= 1e-4

    p.layerwise = False
    expected = engine.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens
    p.layerwise = True
    got = engine.generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert got.tokens == expected
    assert got.stats["prefill_tokens"] == len(PROMPT)


def test_each_layer_is_read_once_per_span(store_for):
    engine = edge0.load(store_for("qwen3_moe"), dtype="float32", prerouter=False)
    store_bytes = engine.streaming.total_expert_bytes
    p = engine.prefiller
    p.moe_chunk = 64  # 5 MoE chunks per layer: the layer stays held across them
    # the last layer's output feeds only the logits: the span computes its cache, and only the
    # prompt's last token goes through its experts (its logits give the first token)
    last = max(engine.store.layers)
    last_bytes = engine.store.expert_nbytes(last) * int(engine.store.layers[last]["num_experts"])
    tail = engine.spec.top_k * engine.store.expert_nbytes(last)
    for i, should_stop in enumerate((None, lambda: False)):  # the CLI path and the server's cancellable path
        engine.reset_cache()
        stats = engine.generate(PROMPT, max_tokens=2, should_stop=should_stop).stats
        assert stats["prefill_layers_whole"] == len(engine.store.layers) - 1
        # every other layer exactly once, and the last token's K experts of the last layer (the
        # second time they are in the expert cache)
        assert stats["prefill_expert_bytes_read"] == store_bytes - last_bytes + (tail if i == 0 else 0)
    p.layerwise = False  # the chunked forward reads every layer once per chunk of 512 (cancellable)
    engine.reset_cache()
    chunked = engine.generate(PROMPT * 4, max_tokens=2, should_stop=lambda: False).stats
    assert chunked["prefill_expert_bytes_read"] == 3 * store_bytes


def test_a_short_span_reads_only_the_union_of_its_routes(store_for):
    engine = edge0.load(store_for("qwen3_moe"), dtype="float32", prerouter=False)
    # 3 tokens (the prompt's last one is fed in the span) x K 2 < 8 experts
    stats = engine.generate(PROMPT[:3], max_tokens=1).stats
    layers = len(engine.store.layers)
    assert stats["prefill_layers_union"] == layers - 1 and stats["prefill_layers_whole"] == 0  # not the last
    per_expert = engine.store.expert_nbytes(sorted(engine.store.layers)[0])
    assert 0 < stats["prefill_expert_bytes_read"] <= layers * 3 * 2 * per_expert


def test_cancellation_is_seen_between_layers(store_for):
    engine = edge0.load(store_for("qwen3_moe"), dtype="float32", prerouter=False)
    engine.prefiller.score_bytes = 1 << 40  # one attention chunk and one MoE chunk per layer
    checks = []
    steps = list(engine.stream_generate(PROMPT, max_tokens=4, should_stop=lambda: checks.append(1) or len(checks) > 2))
    # checks: layer 0 starts, its attention chunk, its MoE chunk -> stop: the second layer never ran
    assert steps == [] and len(checks) == 3
    assert engine.kv.newest is None  # nothing was fed into every layer: no cache went back to the prompt caches
    calls = engine.streaming.stats.totals()["calls"]
    assert calls == 0  # layer 0's MoE chunk was not computed either
    again = engine.generate(PROMPT, max_tokens=4)
    engine.prefiller.layerwise = False
    engine.reset_cache()
    assert again.tokens == engine.generate(PROMPT, max_tokens=4).tokens


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_cancelled_prefill_keeps_the_spans_fed_into_every_layer_and_a_retry_resumes_there(store_for, layerwise):
    engine = edge0.load(store_for("qwen3_moe"), dtype="float32", prerouter=False)
    prompt = [(7 * i) % 200 + 10 for i in range(1124)]
    expected = engine.generate(prompt, max_tokens=6)
    engine.prefiller.layerwise, engine.prefiller.span_tokens = layerwise, 256
    engine.reset_cache()
    if layerwise:  # stop inside the third span: two spans went into every layer
        stop = lambda: engine.prefiller.spans - spans0 >= 2  # noqa: E731
    else:  # the chunked forward checks before each 512-token chunk: stop before the third
        checks = []
        stop = lambda: checks.append(1) or len(checks) > 2  # noqa: E731
    spans0 = engine.prefiller.spans
    assert list(engine.stream_generate(prompt, max_tokens=6, reuse_cache=True, should_stop=stop)) == []
    kept = 2 * (256 if layerwise else 512)
    assert engine.kv.newest.tokens == prompt[:kept] and {c.offset for c in engine.kv.newest.cache} == {kept}
    again = engine.generate(prompt, max_tokens=6, reuse_cache=True)
    assert again.stats["prefill_tokens"] == len(prompt) - kept  # the retry resumed
    assert again.tokens == expected.tokens


class _Layer(nn.Module):
    """A decoder layer whose MoE output is added after a norm (not a plain residual) when `post`."""

    def __init__(self, post: bool):
        super().__init__()
        self.mlp = nn.Sequential(StreamingExperts(nn.Linear(4, 4), 0))
        self.norm = nn.RMSNorm(4)
        self.post = post

    def __call__(self, x, mask=None, cache=None):
        r = self.mlp(x)
        return x + (self.norm(r) if self.post else r)


class _Model(nn.Module):
    def __init__(self, post: bool):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.layers = [_Layer(False), _Layer(post)]

    def __call__(self, inputs, cache=None):
        h = self.embed(inputs)
        for layer in self.layers:
            h = layer(h, None, None)
        return h


def test_the_residual_probe_tells_the_two_layers_apart():
    assert blw.lp.moe_child(_Layer(False)) == "mlp"
    plain = blw.probe(_Model(post=False))
    assert plain.why_not is None and [c.residual for c in plain.calls] == [True, True] and plain.hidden == 4
    post = blw.probe(_Model(post=True))
    assert post.why_not == "decoder layer 1 (_Layer) does not add its MoE output to its residual stream"


def test_quantized_kv_cache_round_trip(store_for, tmp_path):
    """--kv-bits through generate, chat, the server and a prompt cache on disk (keyed by it)."""
    store = store_for("qwen3_moe")
    with pytest.raises(Edge0Error, match="--kv-group-size 64 does not divide"):  # head_dim 32
        edge0.load(store, dtype="float32", prerouter=False, kv_bits=8).generate(PROMPT, max_tokens=1)
    opts = dict(dtype="float32", prerouter=False, kv_bits=8, kv_group_size=32)
    engine = edge0.load(store, **opts)
    assert all(getattr(c, "bits", None) == 8 for c in engine.kv.make())
    first = engine.generate(PROMPT, max_tokens=6, reuse_cache=True)
    assert engine.kv.newest.cache[0].bits == 8 and len(engine.kv.newest.tokens) == len(PROMPT) + 5
    follow = engine.generate(PROMPT + first.tokens[:3] + [11, 12], max_tokens=3, reuse_cache=True)
    assert follow.stats["prefill_tokens"] == 2  # the quantized cache is trimmed and reused
    messages = [{"role": "user", "content": "hello world, " * 20}]
    greedy = engine.chat(messages, max_tokens=4)
    assert greedy.tokens == edge0.load(store, **opts).chat(messages, max_tokens=4).tokens

    served = edge0.load(store, prompt_cache_dir=tmp_path / "pc", **opts)
    with running_server(served, ServerConfig()) as base:
        reply = httpx.post(
            base + "/v1/chat/completions",
            timeout=60,
            # greedy: the APIs' default temperature 1 may sample an end of sequence early
            json={"model": served.model_id, "messages": messages, "max_tokens": 4, "temperature": 0},
        ).json()
        deadline = time.monotonic() + 10
        while httpx.get(base + "/v1/stats").json()["engine"]["prompt_cache"]["saved"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert reply["usage"]["completion_tokens"] == 4 and reply["choices"][0]["message"]["content"] == greedy.text
    follow = messages + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]}]
    follow += [{"role": "user", "content": "more"}]
    restarted = edge0.load(store, prompt_cache_dir=tmp_path / "pc", **opts)
    n = len(restarted.chat_prompt(follow))
    assert restarted.chat(follow, max_tokens=2, reuse_cache=True).stats["prefill_tokens"] < n - 40
    assert restarted.stats()["prompt_cache"]["restored"] == 1 and restarted.kv.newest.cache[0].bits == 8
    float_engine = edge0.load(store, prompt_cache_dir=tmp_path / "pc", dtype="float32", prerouter=False)
    assert float_engine.identity() != restarted.identity()
    assert float_engine.chat(follow, max_tokens=2, reuse_cache=True).stats["prefill_tokens"] == n


def test_moe_chunks_never_end_in_a_one_token_call():
    # a one-token call is a decode step to the MoE block (the pre-router predicts from it)
    assert blw.chunks(1025, 512) == [(0, 512), (512, 1025)]
    assert blw.chunks(1024, 512) == [(0, 512), (512, 1024)]
    assert blw.chunks(513, 512) == [(0, 513)] and blw.chunks(7, 512) == [(0, 7)]


def _counted(engine):
    """Counts the engine's plain decode steps and first steps taken from a prefill's log-probs."""
    counts = {"decode": 0, "first": 0}
    stepper = engine.stepper
    for name in counts:
        method = getattr(stepper, name)

        def wrapped(*a, _method=method, _name=name, **kw):
            counts[_name] += 1
            return _method(*a, **kw)

        setattr(stepper, name, wrapped)
    return counts


def test_the_prompt_s_last_token_goes_into_its_span_and_its_logits_give_the_first_token(store_for):
    store = store_for("qwen3_moe")
    merged = edge0.load(store, dtype="float32", prerouter=False)
    stepped = edge0.load(store, dtype="float32", prerouter=False)
    stepped.prefiller.layerwise = False  # chunk by chunk: a first decode step feeds the prompt's last token
    m, s = _counted(merged), _counted(stepped)
    for should_stop in (None, lambda: False):
        merged.reset_cache()
        stepped.reset_cache()
        want = stepped.generate(PROMPT, max_tokens=3, should_stop=should_stop)
        got = merged.generate(PROMPT, max_tokens=3, should_stop=should_stop)
        assert got.tokens == want.tokens
    assert m == {"decode": 4, "first": 2} and s == {"decode": 6, "first": 0}
    # a feature that acts on step 0's forward (the pre-router's heads) keeps the first decode step
    merged.hooks.sees_first_forward = True
    merged.reset_cache()
    assert merged.generate(PROMPT, max_tokens=3).tokens == want.tokens
    assert m == {"decode": 7, "first": 2}


def test_a_stage_span_longer_than_its_layers_take_goes_in_pieces_with_the_same_output(store_for):
    """A pipeline stage feeds the span rank 0 sized for its own layers: where this stage's layers
    take fewer tokens at once, the span goes in pieces, each layer by layer, and its output and
    cache are the whole span's."""
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    ids = mx.array([PROMPT[:40]])
    p = engine.prefiller
    whole_cache = engine.kv.make()
    whole = np.array(p.stage_span(ids, whole_cache).astype(mx.float32))
    spans = p.spans
    p.span_tokens = 16  # pieces of 16, 16 and 8 tokens
    cache = engine.kv.make()
    pieces = np.array(p.stage_span(ids, cache).astype(mx.float32))
    assert p.spans - spans == 3 and pieces.shape == whole.shape == (1, 40, whole.shape[-1])
    np.testing.assert_allclose(pieces, whole, atol=1e-4, rtol=1e-4)
    for a, b in zip(state(cache), state(whole_cache)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
