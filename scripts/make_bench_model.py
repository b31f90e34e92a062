"""Write a deterministic synthetic qwen3_moe bench model: an mlx-lm int4 checkpoint and its edge0 store.

The model has a realistic *shape* (Qwen3-30B-A3B scaled to 2-core machines) and random weights.
It is written directly as an already-quantized mlx-lm checkpoint (uint32-packed int4 weights,
bf16 scales/biases, 8-bit routers, exactly the names and shapes `mlx_lm convert -q` produces),
one tensor at a time, then indexed into an edge0 store by `edge0 convert`. That is much cheaper
than writing an fp32/bf16 source (8 GB / 4 GB for the full size) and quantizing it, and it
means the mlx-lm resident arm and the edge0 arms run on byte-identical tensors.

Random weights route nearly uniformly over the experts: the hard case for expert caching.

Usage:
    python scripts/make_bench_model.py OUT [--size full|quick|tiny] [--layers N] [--experts E]
        [--top-k K] [--hidden H] [--moe-intermediate I] [--vocab V] [--seed S] [--no-store]

OUT (must not exist) receives:
    mlx/          the mlx-lm checkpoint (config.json, model-*.safetensors + index, tokenizer)
    store/        the edge0 store (edge0 convert --hf-path OUT/mlx -o OUT/store)
    bench-model.json   shape, seed, sizes and generator version
Both are written into a temporary directory beside OUT and renamed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

GENERATOR_VERSION = 1

# Qwen3-30B-A3B (hidden 2048, 48 layers, 128 experts top-8, moe_intermediate 768, 32/4 heads,
# vocab 151936) scaled to a 2-core machine.
SIZES = {
    "full": dict(
        hidden=1024,
        layers=24,
        experts=128,
        top_k=8,
        moe_intermediate=384,
        heads=16,
        kv_heads=4,
        head_dim=64,
        vocab=151936,
    ),
    "quick": dict(
        hidden=512, layers=8, experts=64, top_k=8, moe_intermediate=256, heads=8, kv_heads=2, head_dim=64, vocab=32768
    ),
    "tiny": dict(
        hidden=128, layers=2, experts=16, top_k=4, moe_intermediate=64, heads=2, kv_heads=1, head_dim=64, vocab=None
    ),
}
GROUP, BITS = 64, 4


def bench_config(shape: dict) -> dict:
    """The config.json of the bench model before quantization (mlx-lm adds "quantization")."""
    from tests.fixtures import tokenizer as tok

    vocab = max(shape["vocab"] or 0, tok.vocab_size())
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": shape["hidden"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["head_dim"],
        "intermediate_size": 3 * shape["hidden"],
        "moe_intermediate_size": shape["moe_intermediate"],
        "num_experts": shape["experts"],
        "num_experts_per_tok": shape["top_k"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": tok.token_id(tok.PAD_TOKEN),
        "eos_token_id": tok.token_id(tok.EOS_TOKEN),
        "pad_token_id": tok.token_id(tok.PAD_TOKEN),
    }


def layout(config: dict):
    """(quantized config, [(name, st_dtype, shape)]) exactly as `mlx_lm convert -q` would write
    them: the mlx-lm model is built lazily and quantized lazily, nothing is ever evaluated."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model

    from edge0.backend.io import ST_DTYPE

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(dict(config)))
    with contextlib.redirect_stdout(io.StringIO()):
        model, qconfig = quantize_model(model, config, GROUP, BITS)
    # Floating tensors are stored in bf16 (torch_dtype), as mlx-lm writes a bf16 source.
    entries = [
        (k, "BF16" if ST_DTYPE[v.dtype] in ("F32", "F16") else ST_DTYPE[v.dtype], tuple(v.shape))
        for k, v in tree_flatten(model.parameters())
    ]
    return qconfig, entries


def _rng(seed: int, name: str) -> np.random.Generator:
    # One stream per tensor, keyed by its name: any tensor can be (re)generated on its own.
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _gain(path: str, fan_in: int, n_layers: int) -> float:
    """Std of a dequantized weight is gain / sqrt(fan_in). A plain random init collapses a
    24-layer residual stream (every position ends up with the same hidden state, greedy decoding
    repeats one token and routing stops changing: the easy case for caching). So, as in GPT-2's
    init, the residual branches' output projections are scaled by 1/sqrt(2 L) and the embedding
    has unit-variance entries: each layer sees mostly its own token, and routes vary per token."""
    if path.endswith("mlp.gate"):
        return 2.0  # routers: far from uniform for each token
    if path == "model.embed_tokens":
        return math.sqrt(fan_in)
    if path.endswith(("o_proj", "down_proj")):
        return 1.0 / math.sqrt(2 * n_layers)
    return 1.0


def module_tensors(path: str, parts: dict, qconfig: dict, seed: int, n_text_tokens: int, control_ids) -> dict:
    """Raw bytes of one module's tensors. Quantized modules get uniform random codes and per-group
    scales/biases such that the dequantized weight has mean 0 and std gain/sqrt(fan_in)."""
    out = {}
    q = qconfig["quantization"].get(path)
    if "scales" in parts:
        bits = (q if isinstance(q, dict) else qconfig["quantization"])["bits"]
        group = (q if isinstance(q, dict) else qconfig["quantization"])["group_size"]
        wshape = parts["weight"][1]
        rng = _rng(seed, path + ".weight")
        out["weight"] = rng.integers(0, 2**32, size=wshape, dtype=np.uint32)
        sshape = parts["scales"][1]
        fan_in = sshape[-1] * group
        levels = 2**bits
        q_std = math.sqrt((levels * levels - 1) / 12.0)
        gain = _gain(path, fan_in, qconfig["num_hidden_layers"])
        rng = _rng(seed, path + ".scales")
        scales = (gain / math.sqrt(fan_in) / q_std) * np.exp(0.1 * rng.standard_normal(sshape, dtype=np.float32))
        biases = -(levels - 1) / 2.0 * scales
        if path == "lm_head":
            # Rows beyond the tokenizer (none when it is extended to the vocab) give logit 0;
            # control tokens are damped so greedy runs continue.
            scales[n_text_tokens:] = 0.0
            biases[n_text_tokens:] = 0.0
            scales[control_ids] *= 0.1
            biases[control_ids] *= 0.1
        out["scales"], out["biases"] = _bf16(scales), _bf16(biases)
    else:
        for part, (_, shape) in parts.items():
            rng = _rng(seed, f"{path}.{part}")
            if len(shape) == 1 and part == "weight":  # norms
                out[part] = _bf16(1.0 + np.clip(0.05 * rng.standard_normal(shape, dtype=np.float32), -0.4, 0.4))
            else:
                out[part] = _bf16(0.02 * rng.standard_normal(shape, dtype=np.float32))
    return out


def _modules(entries):
    """Group (name, dtype, shape) entries by module path, keeping first-seen order."""
    mods: dict[str, dict] = {}
    for name, dt, shape in entries:
        path, part = name.rsplit(".", 1)
        mods.setdefault(path, {})[part] = (dt, shape)
    return mods


def _shard_of(name: str) -> str:
    parts = name.split(".")
    return f"layer-{int(parts[2]):04d}" if name.startswith("model.layers.") else "other"


def write_tokenizer(out: Path, vocab: int) -> None:
    """The fixture tokenizer (314 byte-level BPE tokens and a chat template), its BPE vocab
    extended with filler tokens `<tN>` up to the model's vocab. Fillers are never produced by
    encoding (no merge makes them) but every id the model can emit decodes. Greedy decoding of a
    random model over only 314 tokens falls into short loops (a 2-token loop makes routing repeat,
    the easy case for caching); over a realistic vocab it does not. Fillers live in the BPE model,
    not as added tokens: 150k added tokens cost transformers ~450 MB of RSS, 150k vocab entries
    cost little."""
    from tests.fixtures import tokenizer as tok

    tok.write_tokenizer(out)
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    used = set(data["model"]["vocab"].values()) | {t["id"] for t in data["added_tokens"]}
    start = max(used) + 1
    for i in range(start, vocab):
        data["model"]["vocab"][f"<t{i}>"] = i
    path.write_text(json.dumps(data, ensure_ascii=False))


def write_checkpoint(out: Path, shape: dict, seed: int, quiet: bool = False) -> dict:
    """Write the mlx-lm checkpoint into `out` (created); returns {"config", "bytes", "expert_bytes"}."""
    from tqdm import tqdm

    from edge0.backend.io import save_config
    from edge0.store.writer import SafetensorsWriter
    from tests.fixtures import tokenizer as tok

    config = bench_config(shape)
    qconfig, entries = layout(config)
    out.mkdir(parents=True)
    mods = _modules(entries)
    shards: dict[str, list] = {}
    for name, dt, shp in entries:
        shards.setdefault(_shard_of(name), []).append((name, dt, shp))
    keys = ["other"] + sorted(k for k in shards if k != "other")
    names = {k: f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors" for i, k in enumerate(keys)}
    total = sum(np.prod(s, dtype=np.int64) * (4 if d == "U32" else 2) for _, d, s in entries)
    n_text = config["vocab_size"]  # the tokenizer is extended to the model's vocab
    control = [tok.token_id(t) for t in tok.SPECIAL_TOKENS]
    weight_map, expert_bytes = {}, 0
    bar = tqdm(total=int(total), unit="B", unit_scale=True, desc="bench model", disable=quiet)
    try:
        for key in keys:
            ordered = sorted(shards[key])
            writer = SafetensorsWriter(out / names[key], ordered, {"format": "mlx"})
            cache_path, cache = None, {}
            for name, dt, shp in ordered:
                path, part = name.rsplit(".", 1)
                if path != cache_path:
                    cache_path = path
                    cache = module_tensors(
                        path, {p: (d, s) for p, (d, s) in mods[path].items()}, qconfig, seed, n_text, control
                    )
                data = cache.pop(part)
                assert data.shape == tuple(shp), (name, data.shape, shp)
                writer.write(name, memoryview(np.ascontiguousarray(data)).cast("B"))
                bar.update(data.nbytes)
                if ".switch_mlp." in name:
                    expert_bytes += data.nbytes
                weight_map[name] = names[key]
            writer.close()
    finally:
        bar.close()
    index = {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    save_config(qconfig, config_path=out / "config.json")
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [config["eos_token_id"]],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(out, config["vocab_size"])
    return {"config": qconfig, "bytes": int(total), "expert_bytes": int(expert_bytes)}


def make_bench_model(
    out, size: str = "full", seed: int = 0, store: bool = True, quiet: bool = False, **overrides
) -> Path:
    """Write the bench model into `out` (must not exist), atomically; returns `out`."""
    out = Path(out).expanduser()
    if out.exists():
        raise SystemExit(f"make_bench_model: {out} already exists; choose a new directory or delete it")
    shape = {**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}
    if shape["hidden"] % GROUP or shape["moe_intermediate"] % GROUP:
        raise SystemExit(f"make_bench_model: hidden and moe_intermediate must be multiples of {GROUP}")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        info = write_checkpoint(tmp / "mlx", shape, seed, quiet)
        if store:
            from edge0.store.convert import convert

            convert(str(tmp / "mlx"), tmp / "store", quiet=quiet)
        meta = {
            "generator": "scripts/make_bench_model.py",
            "generator_version": GENERATOR_VERSION,
            "size": size,
            "seed": seed,
            "shape": shape,
            "checkpoint_bytes": info["bytes"],
            "expert_bytes": info["expert_bytes"],
            "store": store,
            "note": "random weights: routing is nearly uniform over experts (hard case for caching)",
        }
        (tmp / "bench-model.json").write_text(json.dumps(meta, indent=1) + "\n")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output directory (must not exist)")
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="full",
        help="preset: full (~2 GB of int4 experts), quick (~50 MB), tiny (tests)",
    )
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--moe-intermediate", type=int)
    p.add_argument(
        "--vocab", type=int, help="model vocab (the 314-token tokenizer is extended with filler tokens to it)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-store", action="store_true", help="write only the mlx-lm checkpoint")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    out = make_bench_model(
        a.out,
        a.size,
        a.seed,
        store=not a.no_store,
        quiet=a.quiet,
        layers=a.layers,
        experts=a.experts,
        top_k=a.top_k,
        hidden=a.hidden,
        moe_intermediate=a.moe_intermediate,
        vocab=a.vocab,
    )
    meta = json.loads((out / "bench-model.json").read_text())
    print(
        f"wrote {out}: {meta['checkpoint_bytes'] / 1e9:.2f} GB checkpoint, "
        f"{meta['expert_bytes'] / 1e9:.2f} GB routed experts",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
