"""A Hugging Face or mlx-lm checkpoint -> an edge0 store (the library behind `edge0 convert`).

Resident weights go to model.safetensors, quantized exactly as mlx-lm would; routed experts go to
one layer-stacked int4 file per MoE layer. Tensors are evaluated and written one at a time into a
temporary directory that is renamed at the end, so an interrupted run leaves nothing loadable.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from edge0.errors import Edge0Error
from edge0.families import spec_for, supported
from edge0.store.format import CONFIG_FILE, FORMAT, HEADS_FILE, LORA_FILE, MANIFEST, RESIDENT_FILE, VERSION, expert_file
from edge0.store.writer import SafetensorsWriter
from edge0.version import __version__

PARTS = ("weight", "scales", "biases", "bias")


def resolve_source(hf_path: str) -> Path:
    """A local directory as is; anything else is a Hugging Face repo id fetched through
    huggingface_hub (which honours HF_HUB_OFFLINE and its cache)."""
    p = Path(hf_path).expanduser()
    if p.is_dir():
        return p
    if p.exists() or hf_path.startswith((".", "/", "~")):
        raise Edge0Error(f"--hf-path {hf_path}: not a directory; pass a model directory or a Hugging Face repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(hf_path, allow_patterns=["*.json", "*.safetensors", "*.py", "*.model", "*.txt", "*.jinja"]))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise Edge0Error(f"--hf-path {hf_path}: could not fetch from the Hugging Face Hub ({type(e).__name__}); "
                         "check the repo id and network, or pass a local directory") from None


def _split(weights: dict, experts: list[tuple[str, int]]):
    """Resident tensor names, and per MoE layer the expert tensor names in write order."""
    layers, taken = [], set()
    for path, layer in experts:
        names = [k for k in sorted(weights) if k.startswith(path + ".")]
        # Group each projection's weight/scales/biases together: they are siblings of one quantize op.
        names.sort(key=lambda k: (k[len(path) + 1:].rsplit(".", 1)[0], PARTS.index(k.rsplit(".", 1)[1])))
        layers.append((path, layer, names))
        taken.update(names)
    return sorted(k for k in weights if k not in taken), layers


def convert(hf_path: str, out: str | os.PathLike, *, dtype: str | None = None, quiet: bool = False) -> Path:
    """Convert `hf_path` (local dir or repo id) into an edge0 store at `out`; returns its path."""
    from edge0.backend import io as bio
    from edge0.backend import quant

    out = Path(out).expanduser()
    if out.exists():
        raise Edge0Error(f"-o {out}: already exists; choose a new output directory or delete it")
    src = resolve_source(hf_path)
    t0 = time.perf_counter()
    config = bio.read_config(src, "pass a Hugging Face or mlx-lm model directory")
    if not any(src.glob("*.safetensors")):
        raise Edge0Error(f"{src}: no *.safetensors weights; pass a Hugging Face or mlx-lm model directory")
    bio.expert_modules(bio.build_model(config, src), src, supported())  # fail early on a dense model
    # mlx-lm writes a "quantization" entry; such checkpoints are indexed, not re-quantized.
    already = "quantization" in config
    if already:
        weights, config, tokenizer, experts = quant.index_quantized(src)
    else:
        weights, config, tokenizer, experts = quant.quantize_hf(src, dtype=dtype)
    spec = spec_for(config)
    resident, layers = _split(weights, experts)

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "experts").mkdir(parents=True)
    total = sum(weights[k].nbytes for k in weights)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=quiet)
    files = {}
    try:
        files[RESIDENT_FILE] = _write(tmp / RESIDENT_FILE, resident, weights, bar)[0]
        expert_layers = []
        for path, layer, names in layers:
            rel = expert_file(layer)
            shapes = {k: weights[k].shape for k in names}
            dtypes = {k: bio.st_dtype(weights[k]) for k in names}
            files[rel], offsets, sizes = _write(tmp / rel, names, weights, bar)
            num = shapes[names[0]][0]
            expert_layers.append({
                "layer": layer,
                "module": path,
                "file": rel,
                "num_experts": num,
                "tensors": {
                    k[len(path) + 1:]: {
                        "dtype": dtypes[k],
                        "shape": list(shapes[k]),
                        "offset": offsets[k],
                        "expert_nbytes": sizes[k] // num,
                    }
                    for k in names
                },
            })
        bar.close()
        bio.save_config(dict(config), config_path=tmp / CONFIG_FILE)
        tokenizer.save_pretrained(str(tmp))
        # Heads and adapters bundled with a checkpoint are tied to the store's identity, which
        # every conversion of that checkpoint shares.
        for extra in ("generation_config.json", HEADS_FILE, LORA_FILE, *sorted(
                p.name for p in src.glob("lora-k*.safetensors"))):
            if (src / extra).is_file():
                shutil.copy(src / extra, tmp / extra)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "created_by": f"edge0 {__version__}",
            "source": {"path": str(hf_path), "already_quantized": already},
            "model_type": config.get("model_type"),
            "spec": spec.to_dict() if spec else None,
            "quantization": config.get("quantization"),
            "files": files,
            "expert_layers": expert_layers,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.rename(tmp, out)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not quiet:
        print(f"wrote {out} ({total / 1e6:.1f} MB, {len(layers)} MoE layers) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return out


def _write(path: Path, names: list[str], weights: dict, bar):
    """Evaluate and write `names` one by one, freeing each after it is written.
    Returns ({"size", "sha256"}, absolute offsets, byte sizes)."""
    from edge0.backend import io as bio

    entries = [(k, bio.st_dtype(weights[k]), tuple(weights[k].shape)) for k in names]
    w = SafetensorsWriter(path, entries, {"format": "mlx"})
    for k in names:
        a = weights.pop(k)
        bio.materialize([a])
        w.write(k, bio.raw_bytes(a))
        bar.update(a.nbytes)
        del a
    return w.close(), w.offsets, w.sizes
