"""What a pipeline stage hands the next one beside (or instead of) the hidden state, for the
families whose layers pass on more: kimi_k3's attention-residual blocks (a family mlx-lm does not
pipeline, run with SkipLayers: backend/stages.py) and deepseek_v41's hyper-connection streams and
compressed state (mlx-lm's own stage message)."""

from __future__ import annotations

import importlib

import mlx.core as mx

from edge0.errors import Edge0Error


class ResidualBlocksMessage:
    """kimi_k3 with attention residuals (`attn_res_block_size`): each layer mixes its input with
    the blocks of earlier layers' partial sums (mlx-lm's ResidualBlocks, one per block start,
    each `[B, T, D]` for this forward's tokens), so a stage hands on the blocks with the hidden
    state, as mlx-lm's own pipeline does (KimiK3TextModel sends `[k + 1, B, T, D]`). Here the
    message is `[B, T, (k + 1) * D]` in the hidden state's dtype: the k blocks, then the hidden
    state; a stage that passed on the hidden state alone would compute other tokens."""

    def __init__(self, hidden: int):
        self.hidden = hidden

    def receive(self, message, kwargs):
        """The hidden state in `message`; its blocks go into the forward's ResidualBlocks (as
        mlx-lm's KimiK3TextModel receives them)."""
        b, t = message.shape[:2]
        parts = message.reshape(b, t, -1, self.hidden)
        blocks = kwargs["blocks"]
        if parts.shape[2] > 1:
            raw = parts[:, :, :-1].transpose(2, 0, 1, 3)
            xf = raw.astype(mx.float32)
            blocks.raw, blocks.inv_rms = raw, mx.rsqrt((xf * xf).mean(axis=-1) + blocks.eps)
        return parts[:, :, -1]

    def send(self, out):
        """The message from a stage's last layer's output `(hidden, blocks)`."""
        h, blocks = out
        b, t = h.shape[:2]
        raw = blocks.raw.astype(h.dtype).transpose(1, 2, 0, 3)  # [B, T, k, D]
        return mx.concatenate([raw, h[:, :, None]], axis=2).reshape(b, t, -1)


def message(model, inner):
    """How a family mlx-lm does not pipeline packs what its stages hand on beside the hidden
    state (None: the hidden state alone)."""
    args = getattr(inner, "args", None)
    if getattr(model, "model_type", None) == "kimi_k3" and getattr(args, "attn_res_block_size", None):
        return ResidualBlocksMessage(int(args.hidden_size))
    return None


# -- stage boundaries that carry more than the hidden state ----------------------------------------
class HyperConnectionStage:
    """deepseek_v41's stage forward (mixed into its mlx-lm TextModel on a pipeline stage).

    Its layers keep `hc_mult` residual streams (hyper-connections) and the mix that collapses
    them for the next layer's input, and layers from compressed ones on read the compressed KV,
    the index keys and the top-k rows an earlier layer made (`shared`). mlx-lm's pipeline sends
    all of that between stages (TextModel._send/_receive: the streams, the mix, the new entries
    of what later layers read); a stage that received one collapsed hidden state and broadcast it
    back to every stream would give other tokens than one process, with no error. Here the same
    message, packed by mlx-lm's own layout, stands where the hidden state does: the stage returns
    it (padded and viewed as `[B, T, W]` in the compute dtype, so the stage exchange sends and
    receives it bit for bit as a hidden state) and the next stage's StageEmbedding returns it.
    The rest is mlx-lm 0.32's TextModel.__call__ without its own send, receive and all-gather."""

    def __call__(self, inputs, cache=None):
        v41, (first, last) = self.family_module, self.stage_ends
        args = self.args
        cache = cache or self.make_cache()
        start_pos = cache[0].offset
        previous = 0 if cache[0].window is None else cache[0].window.shape[1]
        h = self.embed_tokens(inputs)  # the embedded tokens, or the previous stage's message
        batch, length = h.shape[:2]
        window_idx = v41._window_indices(previous=previous, length=length, window=args.sliding_window)
        window_idx = mx.broadcast_to(window_idx, (batch, *window_idx.shape))
        shared = {}
        if first:
            streams = mx.broadcast_to(h[:, :, None, :], (batch, length, args.hc_mult, args.hidden_size))
            pre_mix = mx.zeros((batch, length, args.hc_mult), dtype=mx.float32)
            pre_mix[..., 0] = 1.0
        else:
            streams, pre_mix = self._unpack_stage(v41, h, start_pos, cache[0], shared)
        for layer, layer_cache in zip(self.pipeline_layers, cache, strict=True):
            streams, pre_mix = layer(
                streams, pre_mix, start_pos=start_pos, window_idx=window_idx, cache=layer_cache, shared=shared
            )
        if not last:
            return self._pack_stage(v41, streams, pre_mix, start_pos, shared)
        return self.norm(v41._collapse(streams, pre_mix))

    def _unpack_stage(self, v41, message, start_pos: int, cache, shared: dict):
        """The streams and the mix from the previous stage's message; what later layers read goes
        into `shared` and the first layer's cache (mlx-lm's TextModel._receive)."""
        batch, length = message.shape[:2]
        layout = v41._layout(self.args, self.crossing[0], batch, length, start_pos, message.dtype)
        parts = v41._unpack(message.reshape(-1).view(mx.uint8), layout)
        streams, pre_mix = parts.pop("streams"), parts.pop("pre_mix")
        for key, part in parts.items():
            if key in v41._CACHE_FIELDS:
                # the first layer never writes this field: it keeps the previous stage's entries
                if part.shape[1]:
                    setattr(cache, key, v41._append(getattr(cache, key), part))
                shared[key] = getattr(cache, key)
            elif key == "candidates":
                keys = v41._index_keys(self.args, self.crossing[0][key], start_pos + length)
                mask = mx.repeat(part, self.args.candidate_block_size, axis=-1)
                shared[key] = mask[..., :keys] if keys else None
            else:
                shared[key] = part
        return streams, pre_mix

    def _pack_stage(self, v41, streams, pre_mix, start_pos: int, shared: dict):
        """The message for the next stage (mlx-lm's TextModel._send, packed by its layout), as
        `[B, T, W]` in the streams' dtype."""
        batch, length = streams.shape[:2]
        layout = v41._layout(self.args, self.crossing[1], batch, length, start_pos, streams.dtype)
        state = {**shared, "streams": streams, "pre_mix": pre_mix}
        parts = []
        for key, shape, dtype in layout:
            part = state.get(key)
            if part is None:  # not written yet, so the layout has no entries either
                part = mx.zeros(shape, dtype)
            elif key in v41._CACHE_FIELDS:  # all entries so far: only the new ones travel
                part = part[:, part.shape[1] - shape[1] :]
            elif key == "candidates":
                part = part[..., :: self.args.candidate_block_size]
            if part.shape != shape or part.dtype != dtype:
                raise Edge0Error(
                    f"deepseek_v41: the next pipeline stage expects {key} as {dtype} {shape}, not {part.dtype} "
                    f"{part.shape}; run it in one process"
                )
            parts.append(part)
        packed = v41._pack(parts)
        row = batch * length * streams.dtype.size
        pad = -packed.size % row
        if pad:
            packed = mx.concatenate([packed, mx.zeros((pad,), mx.uint8)])
        return packed.view(streams.dtype).reshape(batch, length, -1)


# model_type -> (the mixin that runs a stage's forward, what of mlx-lm's module it uses)
_BOUNDARIES = {
    "deepseek_v41": (
        HyperConnectionStage,
        (
            "_window_indices",
            "_layout",
            "_pack",
            "_unpack",
            "_collapse",
            "_append",
            "_index_keys",
            "_crossing",
            "_CACHE_FIELDS",
        ),
    ),
}


def boundary(model, inner):
    """The mixin that runs a stage of this family (None: its stages pass on the hidden state
    alone). A family whose mlx-lm pipeline exchanges more than that (its PipelineMixin model has
    its own `_send` / `_receive`) without such a mixin here is refused: a stage that passed on the
    hidden state alone would give other tokens than one process, with no error."""
    model_type = getattr(model, "model_type", "?")
    own = any(callable(getattr(type(inner), m, None)) for m in ("_send", "_receive"))
    if not own:
        return None
    mixin, needs = _BOUNDARIES.get(model_type, (None, ()))
    module = importlib.import_module(type(inner).__module__)
    missing = [n for n in needs if not hasattr(module, n)]
    if mixin is None or missing:
        why = f" (mlx-lm's {module.__name__} lacks {', '.join(missing)})" if mixin is not None else ""
        raise Edge0Error(
            f"model_type {model_type!r}: mlx-lm's pipeline passes more than the hidden state between stages "
            f"(its own stage messages), which the stage exchange does not carry for this family{why}; "
            "run it in one process"
        )
    return mixin
