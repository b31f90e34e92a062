"""The store's manifest: a magic format name and a version, the MoE spec, every file's size
and sha256, and the byte layout of the layer-stacked expert tensors. See docs/store-format.md."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from edge0.errors import Edge0Error

FORMAT = "edge0-store"
VERSION = 1
MANIFEST = "edge0-manifest.json"
RESIDENT_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Sidecars a store may carry, each tied to the store's identity (manifest_hash).
HEADS_FILE = "prerouter.safetensors"
LORA_FILE = "lora.safetensors"


def lora_file(k: int) -> str:
    """The adapter trained for serving width K."""
    return f"lora-k{k}.safetensors"


def expert_file(layer: int) -> str:
    return f"experts/layer-{layer:03d}.safetensors"


def _regenerate(root: Path) -> str:
    return f"regenerate it with: edge0 convert --hf-path <source model> -o {root}"


def open_manifest(root, verify: bool = False) -> dict:
    """Read and check a store's manifest. Sizes are always checked; sha256 too with `verify`."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise Edge0Error(f"{root}: no such directory; pass the output directory of edge0 convert")
    if not path.is_file():
        raise Edge0Error(
            f"{root} is not an edge0 store (no {MANIFEST}); "
            f"create one with: edge0 convert --hf-path {root} -o <store dir>"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Edge0Error(f"{path} is not valid JSON ({e}); {_regenerate(root)}") from None
    if manifest.get("format") != FORMAT:
        raise Edge0Error(f"{path}: format is {manifest.get('format')!r}, not {FORMAT!r}; {_regenerate(root)}")
    if manifest.get("version") != VERSION:
        raise Edge0Error(
            f"{path}: store format version {manifest.get('version')} but this edge0 reads "
            f"version {VERSION}; {_regenerate(root)}"
        )
    for rel, info in manifest["files"].items():
        check_file(root, rel, info, verify)
    return manifest


def check_file(root: Path, rel: str, info: dict, verify: bool) -> None:
    f = root / rel
    if not f.is_file():
        raise Edge0Error(f"{f} is missing; {_regenerate(root)}")
    size = f.stat().st_size
    if size != info["size"]:
        raise Edge0Error(f"{f} is truncated or damaged ({size} bytes, manifest says {info['size']}); {_regenerate(root)}")
    if verify and sha256_file(f) != info["sha256"]:
        raise Edge0Error(f"{f} has a wrong checksum (sha256 differs from the manifest); {_regenerate(root)}")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while b := fh.read(chunk):
            h.update(b)
    return h.hexdigest()


def manifest_hash(root) -> str:
    """Identifies a store for heads and adapters trained on it: sha256 of its model type, spec
    and files (sizes and checksums). Conversion is deterministic, so every conversion of the same
    checkpoint has the same identity, wherever it was converted from."""
    m = json.loads((Path(root) / MANIFEST).read_text())
    ident = {k: m.get(k) for k in ("format", "version", "model_type", "spec", "quantization", "files")}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
