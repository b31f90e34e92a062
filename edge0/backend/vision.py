"""Images in, for the vision-language families: the vision tower, its merger and the position logic
are mlx-vlm's own modules (the reference), resident beside the text model; the text model stays
Edge0's (its experts streamed). An image prompt is prefilled with mlx-vlm's input embeddings, its
M-RoPE positions and its DeepStack features; every later token of that sequence is placed at its
cache offset plus the prompt's rope delta, as mlx-vlm places it."""

from __future__ import annotations

import copy
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from edge0.backend import io as bio
from edge0.backend.assemble import quantized_like
from edge0.backend.modules import set_module
from edge0.errors import Edge0Error

# How a VL model's images are processed: copied from its checkpoint into a store as they are.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)

LANGUAGE = "language_model."
MAX_IMAGE_SIDE = 8192  # pixels: a larger image is refused before its pixels are decoded
IMAGE_KEY = 1 << 61  # prompt-cache key ids of image tokens: above any vocabulary (ImagePrompt.key)


def _vlm_classes(config: dict, where: Path):
    """mlx-vlm's package of this family, or an Edge0Error naming the fix."""
    try:
        from mlx_vlm.utils import get_model_and_args
    except ImportError:
        raise Edge0Error(
            f"{where}: a vision-language model; images need mlx-vlm (pip install 'edge0[vision]')"
        ) from None
    try:
        return get_model_and_args(copy.deepcopy(config))[0]
    except (ValueError, KeyError, ImportError) as e:
        raise Edge0Error(
            f"{where / 'config.json'}: the installed mlx-vlm has no vision model for model_type "
            f"{config.get('model_type')!r} ({e}); upgrade mlx-vlm (pip install -U mlx-vlm)"
        ) from None


def available() -> bool:
    """Whether mlx-vlm is installed (the `vision` extra): without it a VL model is served text only."""
    import importlib.util

    return importlib.util.find_spec("mlx_vlm") is not None


def has_tower(config: dict) -> bool:
    """Whether a checkpoint's config describes a vision tower."""
    return isinstance(config.get("vision_config"), dict) and bool(config["vision_config"])


def _vlm_model(config: dict, where: Path):
    """mlx-vlm's whole model for `config` (lazily initialised: nothing is evaluated) and its package."""
    arch = _vlm_classes(config, where)
    cfg = copy.deepcopy(config)
    cfg.setdefault("vision_config", {})
    cfg.setdefault("text_config", {})
    model_config = vlm_config(arch, cfg)
    return arch.Model(model_config), arch, model_config


def vlm_config(arch, config: dict):
    """mlx-vlm's ModelConfig of `config`, its text, vision and projector parts as mlx-vlm's loader
    builds them."""
    from mlx_vlm.utils import update_module_configs

    model_config = arch.ModelConfig.from_dict(config)
    return update_module_configs(model_config, arch, config, ["text", "vision", "perceiver", "projector", "audio"])


def tower_weights(src: Path, config: dict) -> dict[str, mx.array]:
    """The vision tower's and projector's tensors of a checkpoint (HF layout or mlx-vlm's), named
    and laid out as mlx-vlm's model holds them; lazy, in the dtype the checkpoint stores."""
    from mlx_vlm.utils import sanitize_weights

    model, arch, model_config = _vlm_model(config, src)
    weights = bio.lazy_load(sorted(src.glob("*.safetensors")))
    weights = sanitize_weights(model, weights)
    if hasattr(arch, "VisionModel"):
        weights = sanitize_weights(arch.VisionModel, weights, model_config.vision_config)
    names = {n for n, _ in tree_flatten(model.parameters()) if not n.startswith(LANGUAGE)}
    kept = {}
    for name, value in weights.items():
        if name.startswith(LANGUAGE):
            continue
        stem = name.rsplit(".", 1)[0]
        if name in names or f"{stem}.weight" in names:  # a weight, or a quantized one's scales and biases
            kept[name] = value
    if not kept:
        raise Edge0Error(
            f"{src}: config.json has a vision_config but no vision tower tensors were found; pass the "
            "complete checkpoint (its model*.safetensors files)"
        )
    return kept


@dataclass
class ImageSpan:
    """What a forward over part of an image prompt needs besides its tokens (set on the model's
    attention and decoder layers for that forward): the M-RoPE positions [3, 1, L] and each
    DeepStack layer's visual features at the span's image positions."""

    positions: mx.array | None = None
    embeds: mx.array | None = None  # [1, L, D]: the span's input embeddings (images' features in place)
    visual: mx.array | None = None  # [L] bool: the span's image positions
    deepstack: list = field(default_factory=list)  # per layer: [n, D] features at those positions


class _Context:
    """The span being fed (None: a plain forward), shared by one model's M-RoPE modules and layers."""

    def __init__(self):
        self.span: ImageSpan | None = None


class MRoPE(nn.Module):
    """mlx-vlm's M-RoPE in place of the text model's RoPE: a plain forward places tokens at the
    cache offset plus the sequence's rope delta (kept on its cache, edge0.backend.kvcache); a
    span of an image prompt at the positions mlx-vlm computed for it."""

    def __init__(self, rotary, context: _Context):
        super().__init__()
        self._rotary, self._context = rotary, context
        self.cache = None  # the attention's cache during its call (_PositionedAttention)

    def __call__(self, x, offset=0):
        from mlx_vlm.models.rope_utils import apply_multimodal_rotary_pos_emb

        B, _, L, _ = x.shape
        span = self._context.span
        if span is not None and span.positions is not None:
            positions = span.positions
        else:
            delta = getattr(self.cache, "rope_delta", 0)
            base = offset + delta
            if isinstance(base, mx.array) and base.ndim == 1:
                base = base[:, None]
            positions = mx.broadcast_to(base + mx.arange(L)[None], (3, B, L))
        r = self._rotary
        cos, sin = r(x, positions)
        out, _ = apply_multimodal_rotary_pos_emb(
            x, x, cos, sin, mrope_section=r.mrope_section, unsqueeze_dim=1, style=r.style
        )
        return out


class _PositionedAttention:
    """Mixed into a VL model's attention class: its M-RoPE sees the call's cache (the rope delta)."""

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        self.rope.cache = cache
        try:
            return super().__call__(x, mask, cache, *args, **kwargs)
        finally:
            self.rope.cache = None


class _DeepStackLayer:
    """Mixed into the decoder layers that DeepStack feeds: the span's visual features of this layer
    are added to its output at the image positions, as mlx-vlm's model adds them."""

    def __call__(self, x, *args, **kwargs):
        h = super().__call__(x, *args, **kwargs)
        span = self._vl_context.span
        if span is None or self._vl_deepstack >= len(span.deepstack):
            return h
        idx = mx.array(np.where(np.array(span.visual))[0], dtype=mx.uint32)
        if idx.size == 0:
            return h
        return h.at[:, idx].add(span.deepstack[self._vl_deepstack][None].astype(h.dtype))


class _SpanEmbedding:
    """Mixed into the text model's token embedding: a span of an image prompt is embedded as the
    tower embedded it (the images' features in place), whatever the family's forward takes."""

    def __call__(self, ids):
        span = self._vl_context.span
        return super().__call__(ids) if span is None else span.embeds


def _mix(module: nn.Module, mixin: type) -> None:
    """Give `module` the behaviour of `mixin` over its own class (its parameters keep their names)."""
    cls = type(module)
    module.__class__ = type(f"{mixin.__name__.strip('_')}{cls.__name__}", (mixin, cls), {})


@dataclass
class ImagePrompt:
    """A prompt with images: its tokens (each image's placeholder expanded to its tokens), the
    images' digests and pixels (prepared on any thread: numpy), and what prefilling it needs (the
    tower's features, computed on the engine thread when first needed: Tower.features)."""

    tokens: list[int]
    digests: list[str]
    visual: np.ndarray  # [T] bool
    inputs: dict  # the processor's arrays (pixel values, grids, ...) as numpy, for get_input_embeddings
    embeds: mx.array | None = None  # [T, D]
    positions: mx.array | None = None  # [3, 1, T] (None: the family places image tokens as text)
    delta: int = 0  # position of token t after the prompt: t + delta
    deepstack: list = field(default_factory=list)  # per layer: [n_visual, D]

    def key(self, tokens: list[int]) -> list[int]:
        """`tokens` (the prompt, then generated ones) with each image token replaced by an id of the
        digests of its image and the images before it: the prompt caches' key, so a prefix match
        never crosses an image that differs. A family that writes an image as several runs of
        image tokens (tiles) keys every run by all the prompt's images."""
        visual = self.visual
        starts = np.flatnonzero(visual & ~np.concatenate([[False], visual[:-1]]))
        own = len(starts) == len(self.digests)  # one run per image
        bases = [
            IMAGE_KEY
            | int(hashlib.sha256("".join(self.digests[: r + 1] if own else self.digests).encode()).hexdigest()[:10], 16)
            << 20
            for r in range(len(starts))
        ]
        keyed = list(tokens)
        for r, start in enumerate(starts):
            end = start
            while end < len(visual) and visual[end]:
                if end < len(keyed):
                    keyed[end] = bases[r] | ((end - start) & 0xFFFFF)
                end += 1
        return keyed

    def span(self, start: int, end: int) -> ImageSpan:
        """What feeding tokens [start, end) needs."""
        before = int(self.visual[:start].sum())
        inside = self.visual[start:end]
        n = int(inside.sum())
        return ImageSpan(
            None if self.positions is None else self.positions[:, :, start:end],
            self.embeds[None, start:end],
            mx.array(inside),
            [d[before : before + n] for d in self.deepstack],
        )


class Tower:
    """A VL store's vision tower (mlx-vlm's modules, resident) and how it turns images into a prompt."""

    def __init__(self, root: Path, config: dict, weights: dict, compute_dtype: str, processor):
        model, _, model_config = _vlm_model(config, root)
        quantized_like(model, weights, config.get("quantization"))
        # the text model is Edge0's: mlx-vlm's own is never evaluated, and its layers go now
        lm = model.language_model
        from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

        # an M-RoPE family places image tokens by their rows and columns; the others as text
        self.rotary = next(
            (
                m.rotary_emb
                for _, m in lm.named_modules()
                if isinstance(getattr(m, "rotary_emb", None), MRoPERotaryEmbedding)
            ),
            None,
        )
        found = bio.decoder_layers(lm)
        if found is not None:
            setattr(found[0], found[1], [])
        dt = getattr(mx, compute_dtype)
        model.load_weights(
            [(n, w.astype(dt) if mx.issubdtype(w.dtype, mx.floating) else w) for n, w in weights.items()],
            strict=False,
        )
        mx.eval([w for n, w in tree_flatten(model.parameters()) if not n.startswith(LANGUAGE)])
        self.model, self.config, self.processor = model, model_config, processor
        self.nbytes = sum(w.nbytes for w in weights.values())
        self.image_token = int(
            next(
                v
                for k in ("image_token_index", "image_token_id", "media_placeholder_token_id")
                if (v := getattr(model_config, k, None)) is not None
            )
        )

    def attach(self, text_model: nn.Module) -> None:
        """Put M-RoPE in the text model's attention and DeepStack on its first layers, and let the
        tower embed tokens with the text model's embedding."""
        context = _Context()
        self.context = context
        layers = bio.decoder_layers(text_model)[2]
        depth = len(getattr(self.config.vision_config, "deepstack_visual_indexes", []) or [])
        for i, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None)
            if self.rotary is not None and attn is not None and hasattr(attn, "rope"):
                attn.rope = MRoPE(self.rotary, context)
                _mix(attn, _PositionedAttention)
            if i < depth:
                layer._vl_context, layer._vl_deepstack = context, i
                _mix(layer, _DeepStackLayer)
        ours = bio.decoder_layers(text_model)[0].embed_tokens
        path = next(p for p, m in self.model.language_model.named_modules() if p.split(".")[-1] == "embed_tokens")
        set_module(self.model.language_model, path, ours)
        # the tower computes a prompt's features outside any span: it embeds their text by the lookup
        ours._vl_context = context
        _mix(ours, _SpanEmbedding)

    def prompt(self, text: str, images: list[bytes], pixels: list) -> ImagePrompt:
        """The prompt `text` (the chat template's, one image placeholder per image) through the
        family's own processor, as mlx-vlm prepares it: its tokens (each image's expanded) and the
        images' arrays (numpy: any thread). `pixels`: each image decoded (decode_image)."""
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        try:
            inputs = prepare_inputs(
                self.processor,
                images=pixels,
                prompts=[text],
                image_token_index=self.image_token,
                add_special_tokens=should_add_special_tokens(self.config.model_type, self.processor),
            )
        except (ValueError, IndexError) as e:  # the processor found placeholders and images that do not match
            raise Edge0Error(
                f"the prompt's image placeholders do not match its {len(images)} images ({e}); send each image as "
                "its own content part"
            ) from None
        tokens = np.array(inputs.pop("input_ids"))[0].tolist()
        inputs.pop("attention_mask", None)
        visual = np.array(tokens) == self.image_token
        return ImagePrompt(
            tokens,
            [hashlib.sha256(b).hexdigest() for b in images],
            visual,
            {k: np.asarray(v) for k, v in inputs.items() if v is not None},
        )

    def features(self, prompt: ImagePrompt) -> ImagePrompt:
        """`prompt` with the tower's features: its input embeddings, M-RoPE positions, rope delta and
        DeepStack features (computed once, on the engine thread)."""
        if prompt.embeds is None:
            extra = {k: mx.array(v) for k, v in prompt.inputs.items() if k != "pixel_values"}
            features = self.model.get_input_embeddings(
                mx.array(prompt.tokens)[None], mx.array(prompt.inputs["pixel_values"]), **extra
            )
            deepstack = list(getattr(features, "deepstack_visual_embeds", None) or [])
            positions = getattr(features, "position_ids", None) if self.rotary is not None else None
            mx.eval(features.inputs_embeds, positions, deepstack)
            prompt.embeds, prompt.positions, prompt.deepstack = features.inputs_embeds[0], positions, deepstack
            deltas = getattr(features, "rope_deltas", None)
            prompt.delta = int(np.array(deltas).reshape(-1)[0]) if positions is not None and deltas is not None else 0
        return prompt

    def feed(self, text_model, prompt: ImagePrompt, start: int, end: int, cache) -> None:
        """Feed tokens [start, end) of an image prompt into `cache` (one forward)."""
        self.context.span = self.features(prompt).span(start, end)
        try:
            text_model(mx.array(prompt.tokens[start:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
        finally:
            self.context.span = None


def set_rope_delta(cache: list, delta: int) -> None:
    """A sequence's rope delta, kept on each layer's cache (merged with the rows of a batch's)."""
    for c in cache:
        c.rope_delta = delta


def load_tower(root: Path, entry: dict, config: dict, compute_dtype: str, text_model) -> Tower:
    """The store's vision tower (manifest entry `entry`) and processor, attached to `text_model`."""
    from mlx_vlm.utils import load_processor

    weights = bio.lazy_load([root / entry["file"]])
    _vlm_classes(config, root)  # importing the family's package registers its processor
    try:
        processor = load_processor(root, add_detokenizer=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Edge0Error(
            f"{root}: its image processor does not load ({type(e).__name__}: {e}); put back the processor files "
            f"it was converted with ({', '.join(PROCESSOR_FILES[:2])})"
        ) from None
    tower = Tower(root, config, weights, compute_dtype, processor)
    tower.attach(text_model)
    return tower


def decode_image(data: bytes):
    """An image's bytes as an RGB PIL image; ValueError naming what is wrong. Its size is checked
    before its pixels are decoded (the processor scales every image down to its own bound)."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width < 1 or img.height < 1 or max(img.width, img.height) > MAX_IMAGE_SIDE:
            raise ValueError(f"an image of {img.width}x{img.height} pixels; each side must be 1 to {MAX_IMAGE_SIDE}")
        img.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"not a readable image ({type(e).__name__})") from None
    return img.convert("RGB")
