"""A Hugging Face or mlx-lm checkpoint -> an edge0 store (the library behind `edge0 convert`).

Resident weights go to model.safetensors, quantized exactly as mlx-lm would; routed experts go to
one layer-stacked int4 file per MoE layer. Tensors are evaluated and written one at a time into a
temporary directory that is renamed at the end, so an interrupted run leaves nothing loadable.
A conversion holds a lock beside its output, so two runs never write the same store; partial
directories of killed runs are removed by the next run to the same output (store/outdir.py).
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
from edge0.families import refusal, spec_for, supported
from edge0.store.format import (
    CONFIG_FILE,
    FORMAT,
    HEADS_FILE,
    LORA_FILE,
    MANIFEST,
    RESIDENT_FILE,
    VERSION,
    VISION_FILE,
    seal,
    sha256_file,
)
from edge0.store.outdir import output_lock, partial_dir, remove_stale_partials, unwind_on_termination
from edge0.store.stripes import StripeDirs
from edge0.store.writer import SafetensorsWriter, write_layer
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
        return Path(
            snapshot_download(
                hf_path, allow_patterns=["*.json", "*.safetensors", "*.py", "*.model", "*.txt", "*.jinja"]
            )
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise Edge0Error(
            f"--hf-path {hf_path}: could not fetch from the Hugging Face Hub ({type(e).__name__}); "
            "check the repo id and network, or pass a local directory"
        ) from None


def _split(weights: dict, experts: list[tuple[str, int]]):
    """Resident tensor names, and per MoE layer the expert tensor names in write order."""
    layers, taken = [], set()
    for path, layer in experts:
        names = [k for k in sorted(weights) if k.startswith(path + ".")]
        # Group each projection's weight/scales/biases together: they are siblings of one quantize op.
        names.sort(key=lambda k: (k[len(path) + 1 :].rsplit(".", 1)[0], PARTS.index(k.rsplit(".", 1)[1])))
        layers.append((path, layer, names))
        taken.update(names)
    return sorted(k for k in weights if k not in taken), layers


def convert(
    hf_path: str,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    quiet: bool = False,
    reuse: bool = False,
    trust_remote_code: bool = False,
    stripes: list | None = None,
) -> Path:
    """Convert `hf_path` (local dir or repo id) into an edge0 store at `out`; returns its path.
    `trust_remote_code`: load a tokenizer that is Python code shipped with the model (Kimi's).
    `stripes`: more directories (one per disk, none existing yet) to cut every expert's row over,
    beside the store's own (store/stripes.py).

    `out` must not exist, and a conversion to `out` already running in another process is an
    error. With `reuse` (the bundled model's first use), a store already at `out` is returned as
    it is, and a conversion running elsewhere is waited for and its store returned."""
    from edge0.backend import io as bio

    out = Path(out).expanduser()
    if reuse and (out / MANIFEST).is_file():
        return out
    if out.exists():
        raise Edge0Error(f"-o {out}: already exists; choose a new output directory or delete it")
    src = resolve_source(hf_path)
    if (src / MANIFEST).is_file():
        raise Edge0Error(f"--hf-path {src}: already an edge0 store; load it with --model {src}")
    config = bio.read_config(src, "pass a Hugging Face or mlx-lm model directory")
    why = refusal(config)
    if why:
        raise Edge0Error(
            f"{src / 'config.json'}: model_type {config['model_type']!r} is not supported: {why}; "
            "run it resident with mlx-lm (mlx_lm.generate)"
        )
    if not any(src.glob("*.safetensors")):
        raise Edge0Error(f"{src}: no *.safetensors weights; pass a Hugging Face or mlx-lm model directory")
    bio.expert_modules(bio.build_model(config, src), src, supported())  # fail early on a dense model
    bio.check_remote_code(src, trust_remote_code)  # before the lock: a usage error leaves nothing
    with output_lock(out, wait=reuse, quiet=quiet):
        if reuse and (out / MANIFEST).is_file():  # the run we waited for wrote it
            return out
        if out.exists():
            raise Edge0Error(f"-o {out}: already exists; choose a new output directory or delete it")
        remove_stale_partials(out, quiet)
        dirs = StripeDirs(stripes or [], quiet, out)
        with unwind_on_termination():
            return _convert(src, str(hf_path), out, config, dtype, quiet, trust_remote_code, dirs)


def _convert(
    src: Path,
    hf_path: str,
    out: Path,
    config: dict,
    dtype: str | None,
    quiet: bool,
    trust_remote_code: bool,
    dirs: StripeDirs,
) -> Path:
    from edge0.backend import io as bio
    from edge0.backend import quant

    t0 = time.perf_counter()
    # mlx-lm writes a "quantization" entry; such checkpoints are indexed, not re-quantized.
    already = "quantization" in config
    if already:
        weights, config, tokenizer, experts = quant.index_quantized(src, trust_remote_code)
    else:
        weights, config, tokenizer, experts = quant.quantize_hf(src, dtype=dtype, trust_remote_code=trust_remote_code)
    spec = spec_for(config)
    tower = _tower(src, config)
    for name in tower:  # an mlx-vlm checkpoint holds its tower beside the text model's tensors
        weights.pop(name, None)
    resident, layers = _split(weights, experts)

    tmp = partial_dir(out, os.getpid())
    total = sum(weights[k].nbytes for k in weights) + sum(w.nbytes for w in tower.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=quiet)
    files = {}
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "experts").mkdir(parents=True)
        dirs.make()
        files[RESIDENT_FILE], resident_crc32 = _write(tmp / RESIDENT_FILE, resident, weights, bar)
        vision = None
        if tower:
            vision = {"file": VISION_FILE, "tensors": len(tower), "bytes": sum(w.nbytes for w in tower.values())}
            files[VISION_FILE], _ = _write(tmp / VISION_FILE, sorted(tower), tower, bar)
        expert_layers = []
        for path, layer, names in layers:
            entries = [(k, bio.st_dtype(weights[k]), tuple(weights[k].shape)) for k in names]
            entry = write_layer(tmp, dirs, files, layer, path, entries, lambda k: _materialize(weights, k, bar))
            expert_layers.append(entry)
        bar.close()
        bio.save_config(dict(config), config_path=tmp / CONFIG_FILE, keep_vision_config=bool(vision))
        tokenizer.save_pretrained(str(tmp))
        # Heads and adapters bundled with a checkpoint are tied to the store's identity, which
        # every conversion of that checkpoint shares.
        for extra in (
            "generation_config.json",
            HEADS_FILE,
            LORA_FILE,
            *sorted(p.name for p in src.glob("lora-k*.safetensors")),
            *(_processor_files() if vision else ()),
        ):
            if (src / extra).is_file():
                shutil.copy(src / extra, tmp / extra)
        for f in sorted(tmp.rglob("*")):  # config, tokenizer and sidecars: covered by `edge0 verify`
            rel = f.relative_to(tmp).as_posix()
            if f.is_file() and rel not in files:
                files[rel] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "created_by": f"edge0 {__version__}",
            "source": {"path": str(hf_path), "already_quantized": already},
            "model_type": config.get("model_type"),
            "spec": spec.to_dict() if spec else None,
            "quantization": config.get("quantization"),
            "files": files,
            "resident_crc32": resident_crc32,
            "expert_layers": expert_layers,
        }
        if vision:
            manifest["vision"] = vision
        if dirs.final:
            manifest["stripes"] = dirs.manifest()
        (tmp / MANIFEST).write_text(json.dumps(seal(manifest), indent=1))
        dirs.commit()
        os.rename(tmp, out)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        dirs.discard()
        raise
    if not quiet:
        print(
            f"wrote {out} ({total / 1e6:.1f} MB, {len(layers)} MoE layers) in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
    return out


def _processor_files() -> tuple[str, ...]:
    from edge0.backend import vision as bvision

    return bvision.PROCESSOR_FILES


def _tower(src: Path, config: dict) -> dict:
    """A VL checkpoint's vision tower and projector (kept as the checkpoint stores them), else {}."""
    from edge0.backend import vision as bvision

    if not bvision.has_tower(config):
        return {}
    if not bvision.available():
        print(
            f"{src}: a vision-language model; mlx-vlm is not installed, so the store holds the language model "
            "only (pip install 'edge0[vision]' and convert again to keep its vision tower)",
            file=sys.stderr,
        )
        return {}
    return bvision.tower_weights(src, config)


def _materialize(weights: dict, name: str, bar):
    """Evaluate one tensor and drop the converter's reference to it; returns its raw bytes."""
    from edge0.backend import io as bio

    a = weights.pop(name)
    bio.materialize([a])
    bar.update(a.nbytes)
    return bio.raw_bytes(a)


def _write(path: Path, names: list[str], weights: dict, bar) -> tuple[dict, int]:
    """Evaluate and write `names` one by one, freeing each after it is written; returns
    ({"size", "sha256"}, crc32 of the file)."""
    from edge0.backend import io as bio

    w = SafetensorsWriter(
        path, [(k, bio.st_dtype(weights[k]), tuple(weights[k].shape)) for k in names], {"format": "mlx"}
    )
    for k in names:
        w.write(k, _materialize(weights, k, bar))
    return w.close(), w.crc32
