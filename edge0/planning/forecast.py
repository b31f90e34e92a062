"""Fit and speed before download (`edge0 plan --hf-path`): from a checkpoint's config.json and
safetensors headers alone (a local directory, or a Hugging Face repo through its metadata calls),
the store Edge0 would make, what stays resident, the expert cache that fits a memory size, a
decode-speed band and the longest context, with a one-word verdict.

Speed model, per decode token: compute time for the bytes of weights a token touches (measured
int4 matmul throughput on this machine) plus a per-layer graph cost (measured), plus the expert
bytes that miss the cache read at the disk's measured expert-read rate. The band's ends are two
routing regimes: uniform routing (hit rate = cache share, the worst case) and routing with the
locality of a real MoE model (the synthetic routes fitted to Qwen3-30B-A3B, edge0.cache.synthetic).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0.backend import io as bio
from edge0.backend import kvcache as bkv
from edge0.backend.kvcache import KVFootprint
from edge0.errors import Edge0Error
from edge0.spec import model_dims, moe_dims, text_config
from edge0.store.headers import read_header
from edge0.store.pagecache import evict
from edge0.units import SAFETENSORS_DTYPES

# Routed-expert tensors: per expert (`experts.3.gate_proj.weight`, `experts.3.w1.weight`, Phixtral's
# `moe.mlp.3.fc1`), fused (`experts.gate_up_proj`, DBRX's `experts.mlp.w1`, Granite's
# `block_sparse_moe.input_linear`), stacked per projection (Step's `moe.gate_proj`) or by mlx-lm
# (`switch_mlp.gate_proj.weight`). Shared experts (`shared_experts.gate_proj`) do not match.
ROUTED = re.compile(
    r"(^|\.)(experts\.(\d+\.|gate_up_proj|down_proj|mlp\.)|switch_mlp\.|block_sparse_moe\.(input|output)_linear"
    r"|moe\.(mlp\.\d+\.|(gate|up|down)_proj))"
)
LAYER = re.compile(r"(?:layers|blocks|h)\.(\d+)\.")  # the decoder layer of a tensor name
VERDICTS = ((20.0, "FAST"), (8.0, "GOOD"), (2.0, "USABLE"), (0.0, "SLOW"))
# int4 with one scale and one bias per 64 weights in a 2-byte dtype: what `mlx_lm convert -q` writes
INT4_BYTES_PER_PARAM = 0.5 + 2 * 2 / 64


@dataclass
class Checkpoint:
    """What the headers and config say about a model."""

    source: str
    model_type: str
    num_layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    max_context: int
    kv: KVFootprint  # the model's own KV cache in float32 (latent attention, windows, recurrent states)
    resident_bytes: int  # in memory after conversion (int4 linears, float32 scales and the rest on CPU)
    resident_store_bytes: int  # the same tensors as stored (2-byte scales and biases)
    untouched_bytes: int  # resident bytes a decode token does not read: the input embedding (one row used)
    expert_bytes: int  # one expert of one layer, as stored
    checkpoint_bytes: int  # the source's own tensors

    @property
    def expert_store_bytes(self) -> int:
        return self.expert_bytes * self.num_experts * self.moe_layers

    @property
    def store_bytes(self) -> int:
        return self.resident_store_bytes + self.expert_store_bytes


def read_checkpoint(src: str) -> tuple[dict, dict]:
    """(config, {tensor: (dtype, shape)}) of a local directory or a Hugging Face repo id, reading
    only config.json and the safetensors headers."""
    p = Path(src).expanduser()
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not (p / "config.json").is_file() or not files:
            raise Edge0Error(
                f"--hf-path {p}: needs config.json and *.safetensors (a Hugging Face or mlx-lm model directory)"
            )
        try:
            config = json.loads((p / "config.json").read_text())
            tensors = {k: v for f in files for k, v in read_header(f).tensors.items()}
        except (OSError, ValueError) as e:
            raise Edge0Error(f"--hf-path {p}: unreadable config.json or safetensors header ({e})") from None
        return config, tensors
    if p.exists() or src.startswith((".", "/", "~")):
        raise Edge0Error(f"--hf-path {src}: not a directory; pass a model directory or a Hugging Face repo id")
    from huggingface_hub import get_safetensors_metadata, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        config = json.loads(Path(hf_hub_download(src, "config.json")).read_text())
        meta = get_safetensors_metadata(src)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise Edge0Error(
            f"--hf-path {src}: could not read its metadata from the Hugging Face Hub "
            f"({type(e).__name__}); check the repo id and network, or pass a local directory"
        ) from None
    tensors = {k: (t.dtype, list(t.shape)) for f in meta.files_metadata.values() for k, t in f.tensors.items()}
    return config, tensors


def summarize(config: dict, tensors: dict, source: str) -> Checkpoint:
    """Sizes Edge0 would have for this checkpoint (converted to int4 unless already quantized)."""
    c = text_config(config)
    quantized = "quantization" in config
    experts, top_k = moe_dims(config)
    if not experts or not top_k:
        raise Edge0Error(
            f"--hf-path {source}: config.json has no routed experts (num_experts / num_experts_per_tok); "
            "edge0 runs MoE models"
        )
    routed, resident, stored, embedding, ckpt = 0, 0, 0, 0, 0
    moe_layers = set()
    tied = bool(c.get("tie_word_embeddings"))
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) if shape else 1
        nbytes = n * SAFETENSORS_DTYPES.get(dtype, (None, 2))[1]
        ckpt += nbytes
        if ROUTED.search(name):
            layer = LAYER.search(name)
            moe_layers.add(int(layer.group(1)) if layer else -1)
            routed += nbytes if quantized else n * INT4_BYTES_PER_PARAM
            continue
        if quantized:
            # scales and biases are widened to float32 on the CPU (docs/dtype.md)
            mem = n * 4 if name.endswith((".scales", ".biases")) or dtype in ("F16", "BF16") else nbytes
            disk = nbytes
        else:
            mem, disk = (n * (0.5 + 2 * 4 / 64), n * INT4_BYTES_PER_PARAM) if len(shape) == 2 else (n * 4, nbytes)
        resident, stored = resident + mem, stored + disk
        if "embed_tokens" in name and not tied:
            embedding += mem
    if not moe_layers:
        raise Edge0Error(
            f"--hf-path {source}: no routed-expert tensors in the safetensors headers (expected names "
            "like model.layers.N.mlp.experts.E.gate_proj.weight)"
        )
    # the family's mlx-lm model built from config.json alone (its weights never evaluated) tells
    # the layers and what its KV cache holds per token, as the engine will allocate it
    model = bio.build_model(config, Path(source))
    return Checkpoint(
        source=source,
        model_type=str(config.get("model_type")),
        num_layers=len(model.layers),
        moe_layers=len(moe_layers),
        num_experts=experts,
        top_k=top_k,
        hidden=model_dims(config)[0],
        max_context=int(c.get("max_position_embeddings") or 4096),
        kv=bkv.kv_footprint(model),
        resident_bytes=int(resident),
        resident_store_bytes=int(stored),
        untouched_bytes=int(embedding),
        expert_bytes=int(routed / (len(moe_layers) * experts)),
        checkpoint_bytes=ckpt,
    )


# -- probes ---------------------------------------------------------------------------------------
def probe_disk(where: Path, expert_bytes: int, total: int = 96 << 20) -> dict:
    """Seconds per cold read of one expert-sized range, and sequential MB/s, from a scratch file in
    `where` evicted from the page cache (the disk a store there would be read from)."""
    rng = np.random.default_rng(0)
    size = max(total, 8 * expert_bytes)
    fd, name = tempfile.mkstemp(prefix=".edge0-probe-", dir=where)
    try:
        with os.fdopen(fd, "wb") as fh:
            chunk = rng.integers(0, 255, size=8 << 20, dtype=np.uint8).tobytes()
            for _ in range(size // len(chunk)):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        size = os.path.getsize(name)
        cold = evict([name]) is not None
        with open(name, "rb", buffering=0) as fh:
            offsets = rng.integers(0, max(1, size // expert_bytes - 1), size=16) * expert_bytes
            t0 = time.perf_counter()
            for off in offsets:
                os.pread(fh.fileno(), expert_bytes, int(off))
            per_read = (time.perf_counter() - t0) / len(offsets)
            evict([name])
            t0 = time.perf_counter()
            while fh.read(8 << 20):
                pass
            seq = size / (time.perf_counter() - t0)
    finally:
        os.unlink(name)
    return {"expert_read_s": per_read, "sequential_bytes_per_s": seq, "cold": cold}


def probe_compute(config: dict, hidden: int) -> dict:
    """Int4 matmul throughput at this model's expert shape, and the per-layer cost of a decode
    step's graph (a decode step of the bundled demo model, whose weights are tiny, per layer)."""
    import edge0
    from edge0.backend.probe import int4_matmul_rate

    c = text_config(config)
    inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 4 * hidden)
    rate = int4_matmul_rate(inter, hidden)
    demo = edge0.load(None, prerouter=False, lora=False)
    demo.generate("The", max_tokens=4, ignore_eos=True)  # first-use costs are not per-step costs
    stats = demo.generate("The", max_tokens=24, ignore_eos=True).stats
    layer_s = 1.0 / stats["decode_tps"] / len(demo.store.layers)
    demo.close()
    return {"bytes_per_s": rate, "layer_s": layer_s}


KV_VARIANTS = {"float32": None, "8-bit": 8, "4-bit": 4}  # --kv-bits


def kv_footprint(ck: Checkpoint, bits: int | None = None, group_size: int = 64) -> KVFootprint:
    """The KV cache's footprint: float32, or quantized to `bits` with a float32 scale and bias per
    group where --kv-bits quantizes (full-attention layers)."""
    return ck.kv if bits is None else ck.kv.with_bits(bits, group_size)


def forecast(ck: Checkpoint, memory: int, disk: dict, compute: dict) -> dict:
    """The fit and the decode-speed band of `ck` in `memory` bytes, from the probes."""
    from edge0.cache.synthetic import generate

    overhead = 256 << 20  # runtime, tokenizer, MLX temporaries
    context = 4096
    kv = ck.kv.bytes_at(context)
    free = memory - ck.resident_bytes - overhead - kv
    min_cache = ck.top_k * ck.expert_bytes * ck.moe_layers  # one token's route in every layer
    cache = int(min(max(free, 0), ck.expert_store_bytes))
    fits = free >= min_cache
    share = cache / ck.expert_store_bytes if ck.expert_store_bytes else 1.0
    slots = max(ck.top_k, int(share * ck.num_experts)) if fits else ck.top_k
    hit_local = _lru_hit_rate(generate, ck.num_experts, ck.top_k, slots)
    hit_uniform = min(1.0, slots / ck.num_experts)
    touched = (
        ck.resident_bytes - ck.untouched_bytes + ck.top_k * ck.moe_layers * ck.expert_bytes
    )  # weights one token reads
    compute_s = touched / compute["bytes_per_s"] + ck.num_layers * compute["layer_s"]

    def tok_s(hit):
        misses = (1 - hit) * ck.top_k * ck.moe_layers
        return 1.0 / (compute_s + misses * disk["expert_read_s"])

    low, high = tok_s(hit_uniform), tok_s(hit_local)
    room = memory - ck.resident_bytes - overhead - min_cache
    longest = {n: kv_footprint(ck, b).longest(max(0, room), ck.max_context) for n, b in KV_VARIANTS.items()}
    verdict = "DOES-NOT-FIT" if not fits else next(v for t, v in VERDICTS if high >= t)
    return {
        "store_bytes": ck.store_bytes,
        "resident_bytes": ck.resident_bytes,
        "expert_cache_bytes": cache if fits else 0,
        "experts_cached_per_layer": slots,
        "hit_rate_uniform": hit_uniform,
        "hit_rate_local": hit_local,
        "tok_s_low": low,
        "tok_s_high": high,
        "longest_context": longest["float32"],
        "longest_context_kv": longest,  # with --kv-bits 8 / 4
        "kv_bytes_at_max_context": {n: kv_footprint(ck, b).bytes_at(ck.max_context) for n, b in KV_VARIANTS.items()},
        "verdict": verdict,
        "memory_bytes": memory,
    }


def _lru_hit_rate(generate, num_experts: int, top_k: int, slots: int, steps: int = 600, layers: int = 2) -> float:
    """LRU hit rate of `slots` cached experts per layer on synthetic Qwen3-like routes."""
    from edge0.cache import make_policy
    from edge0.cache.replay import replay_layer

    if slots >= num_experts:
        return 1.0
    routes, _ = generate(num_experts, top_k, layers, steps, seed=0)
    hits = total = 0
    for r in routes:
        cache, _ = replay_layer(r, None, make_policy("lru", slots, num_experts))
        hits, total = hits + cache.hits, total + cache.hits + cache.misses
    return hits / total
