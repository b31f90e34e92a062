"""The manifest's own shape, checked before anything in it is used: every key the loader reads is
there with its type, counts and sizes are consistent, and every path stays inside the store.

A manifest is data a store carries, so it may be damaged or written by someone else: a path of
`../../outside` or `/etc/shadow` was opened (and hashed by `edge0 verify`), and a wrong type or a
missing key ended in a traceback. Each problem is one line naming the key and the fix.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from edge0.errors import Edge0Error
from edge0.store.stripes import check_names, store_dirs
from edge0.units import SAFETENSORS_DTYPES, tensor_nbytes


def _fix(root: Path) -> str:
    return f"regenerate it with: edge0 convert --hf-path <source model> -o {root}"


def inside_store(root: Path, rel, key: str, manifest_path: Path) -> Path:
    """`root / rel`, for a manifest path `rel` found at `key`: refused unless it is relative, has no
    `..`, and does not leave the store through a symlink."""
    why = None
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        why = "not a relative path"
    elif PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
        why = "a path outside the store"
    elif not (root / rel).resolve().is_relative_to(root.resolve()):
        why = "a symlink that leads outside the store"
    if why:
        raise Edge0Error(
            f"{manifest_path}: {key} is {str(rel)[:200]!r}, {why}; every path in a manifest is relative to the "
            f"store and stays in it; {_fix(root)}"
        )
    return root / rel


def _count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_manifest(path: Path, root: Path, manifest) -> None:
    """Raise an Edge0Error naming the first key of `manifest` (read from `path`, the manifest of the
    store at `root`) that is missing, of the wrong type, inconsistent, or a path leaving the store."""

    def bad(key: str, what: str):
        return Edge0Error(f"{path}: {key} {what}; {_fix(root)}")

    if not isinstance(manifest, dict):
        raise Edge0Error(f"{path}: a JSON {type(manifest).__name__}, not an object; {_fix(root)}")
    for key, kind, name in (
        ("files", dict, "an object"),
        ("expert_layers", list, "a list"),
        ("model_type", str, "a string"),
    ):
        if not isinstance(manifest.get(key), kind):
            raise bad(key, f"is missing or not {name}")
    if not isinstance(manifest.get("spec"), (dict, type(None))):
        raise bad("spec", "is not an object or null")
    check_names(manifest, bad)
    dirs = store_dirs(root, manifest)
    for rel, info in manifest["files"].items():
        inside_store(dirs[info.get("dir", 0)] if isinstance(info, dict) else root, rel, "a key of files", path)
        if not isinstance(info, dict) or not _count(info.get("size")) or not isinstance(info.get("sha256"), str):
            raise bad(f"files[{rel!r}]", "needs a size (an integer >= 0) and a sha256 (a string)")
    if not manifest["expert_layers"]:
        raise bad("expert_layers", "is empty: a MoE store has at least one layer of routed experts")
    spec_experts = (manifest["spec"] or {}).get("num_experts")
    for i, entry in enumerate(manifest["expert_layers"]):
        _check_layer(f"expert_layers[{i}]", entry, manifest["files"], spec_experts, bad, root, path)


def _check_layer(key: str, entry, files: dict, spec_experts, bad, root: Path, path: Path) -> None:
    if not isinstance(entry, dict):
        raise bad(key, "is not an object")
    if not _count(entry.get("layer")) or not isinstance(entry.get("module"), str):
        raise bad(key, "needs a layer (an integer >= 0) and a module (a string)")
    inside_store(root, entry.get("file"), f"{key}.file", path)
    if "parts" in entry:  # cut over several directories: `file` names the layer, its parts hold it
        parts = entry["parts"]
        if not (isinstance(parts, list) and parts and all(isinstance(p, dict) for p in parts)):
            raise bad(f"{key}.parts", "is not a list of parts")
        for i, p in enumerate(parts):
            if p.get("file") not in files or not all(_count(p.get(k)) for k in ("offset", "row_start", "row_bytes")):
                raise bad(f"{key}.parts[{i}]", "needs a file listed in files, an offset, a row_start and row_bytes")
    elif entry["file"] not in files:
        raise bad(f"{key}.file", f"{entry['file']!r} is not listed in files")
    experts = entry.get("num_experts")
    if not _count(experts, 1):
        raise bad(f"{key}.num_experts", f"is {experts!r}, not an integer >= 1")
    if spec_experts is not None and experts != spec_experts:
        raise bad(f"{key}.num_experts", f"is {experts}, but spec.num_experts is {spec_experts}")
    tensors = entry.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise bad(f"{key}.tensors", "is missing or empty")
    place = "expert_offset" if entry.get("layout") is not None else "offset"
    for name, t in tensors.items():
        _check_tensor(f"{key}.tensors[{name!r}]", t, experts, place, bad)
    crc = entry.get("expert_crc32")
    if crc is not None and not (isinstance(crc, list) and len(crc) == experts and all(_count(c) for c in crc)):
        raise bad(f"{key}.expert_crc32", f"is not a list of {experts} checksums")


def _check_tensor(key: str, t, experts: int, place: str, bad) -> None:
    """One expert tensor: a known dtype, a stacked shape [E, ...] of positive sizes, the bytes of one
    expert as that shape says, and its place (an offset >= 0)."""
    if not isinstance(t, dict) or t.get("dtype") not in SAFETENSORS_DTYPES:
        raise bad(key, "needs a dtype, one of " + ", ".join(SAFETENSORS_DTYPES))
    shape = t.get("shape")
    if not (isinstance(shape, list) and len(shape) >= 2 and all(_count(n, 1) for n in shape)):
        raise bad(f"{key}.shape", f"is {shape!r}, not a list of sizes >= 1 ([experts, ...])")
    if shape[0] != experts:
        raise bad(f"{key}.shape", f"is {shape}: its first size is not the layer's num_experts ({experts})")
    nbytes = tensor_nbytes(t["dtype"], shape[1:])
    if t.get("expert_nbytes") != nbytes:
        raise bad(f"{key}.expert_nbytes", f"is {t.get('expert_nbytes')!r}, but one expert of that shape is {nbytes}")
    if not _count(t.get(place)):
        raise bad(f"{key}.{place}", f"is {t.get(place)!r}, not an integer >= 0")
