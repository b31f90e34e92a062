"""The model a bench run uses: a bench-model directory or an edge0 store, its sizes and the expert budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from edge0.bench.env import PKG_ROOT, _child_env
from edge0.errors import Edge0Error
from edge0.store.format import CONFIG_FILE, MANIFEST
from edge0.units import parse_size


@dataclass
class Model:
    store: Path
    mlx: Path | None
    mlx_missing_reason: str = ""
    info: dict = field(default_factory=dict)


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text())


def resolve_model(args) -> Model:
    if args.store:
        store = Path(args.store).expanduser()
        mlx = Path(args.mlx_model).expanduser() if args.mlx_model else None
        return _check_model(store, mlx, {})
    if args.model:
        d = Path(args.model).expanduser()
    else:
        from edge0.store.bundled import cache_dir

        d = Path(os.environ.get("EDGE0_BENCH_DIR") or cache_dir() / "bench") / args.size
        if not d.exists():
            build_bench_model(d, args.size)
    if (d / MANIFEST).is_file():  # an edge0 store
        mlx = Path(args.mlx_model).expanduser() if args.mlx_model else None
        return _check_model(d, mlx, {})
    if not (d / "store").is_dir():
        raise Edge0Error(
            f"--model {d}: neither an edge0 store nor a bench-model directory (store/ + mlx/); "
            "make one with: python scripts/make_bench_model.py DIR"
        )
    info = _read_json(d / "bench-model.json") if (d / "bench-model.json").is_file() else {}
    mlx = Path(args.mlx_model).expanduser() if args.mlx_model else d / "mlx"
    return _check_model(d / "store", mlx, info)


def _check_model(store: Path, mlx: Path | None, info: dict) -> Model:
    if not (store / MANIFEST).is_file():
        raise Edge0Error(f"{store}: not an edge0 store (no {MANIFEST}); pass --model DIR or --store DIR")
    m = Model(store, None, info=info)
    if mlx is None:
        src = _read_json(store / MANIFEST).get("source", {})
        if src.get("already_quantized") and Path(src.get("path", "")).is_dir():
            mlx = Path(src["path"])  # the store was converted from this mlx-lm checkpoint
    if mlx is None:
        m.mlx_missing_reason = (
            "no mlx-lm checkpoint with the same weights: pass --mlx-model DIR (the mlx-lm "
            "quantized checkpoint the store was converted from)"
        )
    elif not (mlx / "config.json").is_file() or "quantization" not in _read_json(mlx / "config.json"):
        raise Edge0Error(
            f"--mlx-model {mlx}: not an mlx-lm quantized checkpoint (config.json without "
            '"quantization"); pass the directory the store was converted from'
        )
    else:
        m.mlx = mlx
    return m


def build_bench_model(out: Path, size: str) -> None:
    script = PKG_ROOT / "scripts" / "make_bench_model.py"
    if not script.is_file():
        raise Edge0Error(
            f"no --model given and {script} is missing (it ships with a source checkout); "
            "make a bench model there, or pass --model DIR"
        )
    print(f"edge0 bench: building the {size} bench model into {out} (once)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, str(script), str(out), "--size", size], env=_child_env())
    if r.returncode != 0:
        raise Edge0Error(f"building the bench model failed (exit {r.returncode}); run {script} {out} --size {size}")


def store_sizes(store: Path) -> dict:
    man = _read_json(store / MANIFEST)
    config = _read_json(store / CONFIG_FILE)
    c = {**config, **config.get("text_config", {})}
    per_slot = sum(sum(t["expert_nbytes"] for t in l["tensors"].values()) for l in man["expert_layers"])
    experts = sum(
        sum(t["expert_nbytes"] for t in l["tensors"].values()) * int(l["num_experts"]) for l in man["expert_layers"]
    )
    top_k = int((man.get("spec") or {}).get("top_k") or c.get("num_experts_per_tok") or 1)
    return {
        "store_bytes": sum(int(f["size"]) for f in man["files"].values()),
        "expert_bytes": experts,
        "slot_bytes_all_layers": per_slot,
        "top_k": top_k,
        "moe_layers": len(man["expert_layers"]),
    }


def expert_budget(text: str, sizes: dict) -> int:
    """'20%' of all experts, or a size like '400MB'; at least two routes' worth of slots."""
    text = str(text).strip()
    if text.endswith("%"):
        try:
            frac = float(text[:-1]) / 100
        except ValueError:
            frac = -1
        if not 0 < frac <= 1:
            raise Edge0Error(f"--expert-cache {text}: a percentage must be in (0, 100]; e.g. 20%")
        budget = int(sizes["expert_bytes"] * frac)
    else:
        budget = parse_size(text)
    return max(budget, 2 * sizes["top_k"] * sizes["slot_bytes_all_layers"])
