"""The store's manifest: a magic format name and a version, the MoE spec, every file's size
and sha256, and the byte layout of the expert layer files. See docs/store-format.md."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from edge0.errors import Edge0Error
from edge0.store.manifest_checks import check_manifest
from edge0.store.stripes import check_dirs, layer_files, layer_parts, locate

FORMAT = "edge0-store"
VERSION = 2
# Version 1 stores (tensor-major layer files, 9 ranges per expert) still load; see docs/store-format.md.
READS_VERSIONS = (1, 2)
MANIFEST = "edge0-manifest.json"
RESIDENT_FILE = "model.safetensors"
VISION_FILE = "vision.safetensors"  # a VL model's vision tower and projector (resident)
CONFIG_FILE = "config.json"
# Sidecars a store may carry, each tied to the store's identity (manifest_hash).
HEADS_FILE = "prerouter.safetensors"
LORA_FILE = "lora.safetensors"


def lora_file(k: int) -> str:
    """The adapter trained for serving width K."""
    return f"lora-k{k}.safetensors"


# A layer entry with this "layout" keeps each expert's tensors in one 4 KiB-aligned row; without
# it the layer file is tensor-major (version 1). The reader decides per layer, not per version.
EXPERT_MAJOR = "expert-major"
ALIGN = 4096
RELAYOUT = "edge0 relayout"


def expert_file(layer: int) -> str:
    return f"experts/layer-{layer:03d}.safetensors"


def _regenerate(root: Path) -> str:
    return f"regenerate it with: edge0 convert --hf-path <source model> -o {root}"


def open_manifest(root, verify: bool = False) -> dict:
    """Read and check a store's manifest. Sizes are always checked; sha256 too with `verify`."""
    root = Path(root)
    path, manifest = read_manifest(root)
    check_dirs(root, manifest, path)
    if "manifest_sha256" not in manifest and manifest["version"] >= 2:
        raise Edge0Error(f"{path}: {_NO_CHECKSUM_V2}; check the store with: edge0 verify {root}; {_regenerate(root)}")
    if "manifest_sha256" in manifest and manifest["manifest_sha256"] != manifest_checksum(manifest):
        raise Edge0Error(
            f"{path} was changed after conversion (its checksum differs); check the store with: "
            f"edge0 verify {root}; {_regenerate(root)}"
        )
    # the tensors every load depends on; config, tokenizer and sidecars are checked by
    # edge0 verify (a user may edit or replace them; each has its own checks at load)
    for rel in tensor_files(manifest):
        check_file(root, locate(root, manifest, rel), manifest["files"][rel], verify)
    for entry in manifest["expert_layers"]:
        check_layout(path, root, entry, manifest)
    return manifest


# Version 2 stores have carried their checksum from the start: one without it had it removed.
_NO_CHECKSUM_V2 = "a version 2 manifest without its checksum (manifest_sha256), which every version 2 store carries"


def read_manifest(root: Path) -> tuple[Path, dict]:
    """(path, manifest) of the store at `root`: valid JSON, this format, a version this edge0 reads,
    and every key the loader uses present, of its type, with its paths inside the store
    (manifest_checks.py). An Edge0Error in one line otherwise."""
    path = root / MANIFEST
    if not root.is_dir():
        raise Edge0Error(f"{root}: no such directory; pass the output directory of edge0 convert")
    if not path.is_file():
        raise Edge0Error(
            f"{root} is not an edge0 store (no {MANIFEST}); "
            f"create one with: edge0 convert --hf-path {root} -o <store dir>"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise Edge0Error(f"{path} is not valid JSON ({type(e).__name__}: {e}); {_regenerate(root)}") from None
    if not isinstance(manifest, dict):
        raise Edge0Error(f"{path}: a JSON {type(manifest).__name__}, not an object; {_regenerate(root)}")
    if manifest.get("format") != FORMAT:
        raise Edge0Error(f"{path}: format is {manifest.get('format')!r}, not {FORMAT!r}; {_regenerate(root)}")
    if manifest.get("version") not in READS_VERSIONS:
        raise Edge0Error(
            f"{path}: store format version {manifest.get('version')!r} but this edge0 reads "
            f"versions {' and '.join(map(str, READS_VERSIONS))}; {_regenerate(root)}"
        )
    check_manifest(path, root, manifest)
    return path, manifest


def tensor_files(manifest: dict) -> list[str]:
    """The model's tensor files: the resident weights and each MoE layer's file (or its parts)."""
    return [RESIDENT_FILE, *(f for e in manifest.get("expert_layers") or [] for f in layer_files(e))]


def is_sidecar(rel: str) -> bool:
    """Heads and adapters: files a user may add or replace in a store (each checks its own identity)."""
    return rel == HEADS_FILE or (rel.startswith("lora") and rel.endswith(".safetensors"))


def manifest_checksum(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without this checksum: detects a changed offset or size."""
    return hashlib.sha256(
        json.dumps({k: v for k, v in manifest.items() if k != "manifest_sha256"}, sort_keys=True).encode()
    ).hexdigest()


def seal(manifest: dict) -> dict:
    """The manifest with its own checksum added (written last by convert and relayout)."""
    return {**manifest, "manifest_sha256": manifest_checksum(manifest)}


def verify_store(root) -> tuple[dict, list[str]]:
    """(manifest, problems): the manifest's own checksum, every file's size and sha256, and every
    expert layer's layout against its file, all of them checked (not only up to the first problem),
    each problem on one line. A manifest that cannot be read is an Edge0Error."""
    root = Path(root)
    path, manifest = read_manifest(root)
    check_dirs(root, manifest, path)
    problems = []
    if "manifest_sha256" not in manifest:
        why = (
            _NO_CHECKSUM_V2
            if manifest["version"] >= 2
            else "has no checksum of its own (written before edge0 stores carried one); its offsets are not covered"
        )
        problems.append(f"{path}: {why}: {_regenerate(root)}")
    elif manifest["manifest_sha256"] != manifest_checksum(manifest):
        problems.append(f"{path}: changed after conversion (its checksum differs); {_regenerate(root)}")
    for rel, info in manifest["files"].items():
        try:
            check_file(root, locate(root, manifest, rel), info, verify=True)
        except Edge0Error as e:
            note = " (a sidecar: replaced, or damaged)" if is_sidecar(rel) else ""
            problems.append(f"{e}{note}")
    for entry in manifest["expert_layers"]:
        try:
            check_layout(path, root, entry, manifest)
        except (Edge0Error, OSError) as e:  # a missing file is reported above
            problems += [str(e)] if isinstance(e, Edge0Error) else []
    return manifest, problems


def check_layout(path: Path, root: Path, entry: dict, manifest: dict) -> None:
    """An expert-major entry must describe rows that lie inside its 4 KiB-aligned file (or, cut
    over several directories, parts that make up the row, each inside its file); a tensor-major
    one, tensors that lie inside theirs."""
    layout = entry.get("layout")
    if layout is None:  # tensor-major (version 1 layout)
        size = (root / entry["file"]).stat().st_size
        num = entry["num_experts"]
        if any(t["offset"] + num * t["expert_nbytes"] > size for t in entry["tensors"].values()):
            raise Edge0Error(f"{root / entry['file']}: tensors in the manifest end past the file; {_regenerate(root)}")
        return
    if layout != EXPERT_MAJOR:
        raise Edge0Error(f"{path}: layer {entry.get('layer')} has unknown layout {layout!r}; {_regenerate(root)}")
    try:
        stride, num = int(entry["expert_stride"]), int(entry["num_experts"])
        ends = [int(t["expert_offset"]) + int(t["expert_nbytes"]) for t in entry["tensors"].values()]
        parts = [(p["file"], int(p["offset"]), int(p["row_start"]), int(p["row_bytes"])) for p in layer_parts(entry)]
    except (KeyError, TypeError, ValueError):
        raise Edge0Error(
            f"{path}: layer {entry.get('layer')} lacks expert-major layout fields; {_regenerate(root)}"
        ) from None
    starts = [sum(p[3] for p in parts[:i]) for i in range(len(parts) + 1)]
    if [p[2] for p in parts] != starts[:-1] or starts[-1] != stride:
        raise Edge0Error(f"{path}: layer {entry.get('layer')}: its parts do not make up its rows; {_regenerate(root)}")
    for rel, offset, _, size in parts:
        f = locate(root, manifest, rel)
        if (
            offset % ALIGN
            or size % ALIGN
            or stride % ALIGN
            or max(ends) > stride
            or offset + num * size != f.stat().st_size
        ):
            raise Edge0Error(f"{f}: layout in the manifest does not match the file; {_regenerate(root)}")


def check_file(root: Path, f: Path, info: dict, verify: bool) -> None:
    """The file `f` of the store at `root` has the manifest's size (and sha256, with `verify`)."""
    if not f.is_file():
        raise Edge0Error(f"{f} is missing; {_regenerate(root)}")
    size = f.stat().st_size
    if size != info["size"]:
        raise Edge0Error(
            f"{f} is truncated or damaged ({size} bytes, manifest says {info['size']}); {_regenerate(root)}"
        )
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
    checkpoint has the same identity, wherever it was converted from.

    The identity is that of the store's tensor-major (version 1) form: an expert-major layer
    contributes the size and sha256 its tensor-major file would have (`tensor_major` in its
    entry), so heads, adapters and traces carry over between layouts."""
    m = json.loads((Path(root) / MANIFEST).read_text())
    # the model's tensors only: config, tokenizer and sidecar files were hashed later (format 2)
    files = {k: v for k, v in (m.get("files") or {}).items() if k in set(tensor_files(m))}
    for entry in m.get("expert_layers") or []:
        if entry.get("layout") == EXPERT_MAJOR:  # its logical file, whether one or cut in parts
            for rel in layer_files(entry):
                files.pop(rel, None)
            files[entry["file"]] = entry["tensor_major"]
    ident = {k: m.get(k) for k in ("format", "model_type", "spec", "quantization")}
    ident.update(version=1, files=files)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
