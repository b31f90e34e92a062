"""Re-lay a store's tensor-major layer files (format version 1) out as expert-major (version 2).

    edge0 relayout SRC OUT

Every other file is copied as is. The store keeps its identity (format.manifest_hash), so heads,
adapters and traces made for SRC fit OUT. Written into `.<OUT>.partial-<pid>` and renamed at the
end, like `edge0 convert`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from edge0.errors import Edge0Error
from edge0.store.format import EXPERT_MAJOR, MANIFEST, VERSION, open_manifest, seal
from edge0.store.outdir import output_lock, partial_dir, remove_stale_partials, unwind_on_termination
from edge0.store.writer import write_expert_layer


def _read_range(path: Path, offset: int, n: int) -> bytearray:
    buf = bytearray(n)
    with open(path, "rb") as fh:
        fh.seek(offset)
        if fh.readinto(buf) != n:
            raise Edge0Error(f"{path} ends before byte {offset + n}; the store is damaged, convert it again")
    return buf


def relayout_store(src, out) -> Path:
    """Write a version 2 copy of store `src` at `out` (which must not exist); returns `out`.
    Each tensor-major file is checked against its manifest sha256 while it is read."""
    src, out = Path(src), Path(out).expanduser()
    manifest = open_manifest(src)
    if out.exists():
        raise Edge0Error(f"{out}: already exists; choose a new output directory or delete it")
    layer_files = {l["file"] for l in manifest["expert_layers"]}
    with output_lock(out, wait=False, quiet=False), unwind_on_termination():
        if out.exists():  # written while we waited for the lock
            raise Edge0Error(f"{out}: already exists; choose a new output directory or delete it")
        remove_stale_partials(out, quiet=False)
        return _relayout(src, out, manifest, layer_files, partial_dir(out, os.getpid()))


def _relayout(src: Path, out: Path, manifest: dict, layer_files: set, tmp: Path) -> Path:
    try:
        shutil.copytree(
            src,
            tmp,
            ignore=lambda d, names: [
                n for n in names if n == MANIFEST and Path(d) == src or os.path.relpath(Path(d) / n, src) in layer_files
            ],
        )
        files, layers = dict(manifest["files"]), []
        for entry in manifest["expert_layers"]:
            rel, module, num = entry["file"], entry["module"], int(entry["num_experts"])
            if entry.get("layout") == EXPERT_MAJOR:
                shutil.copy(src / rel, tmp / rel)
                layers.append(entry)
                continue
            tensors = [(f"{module}.{name}", t["dtype"], tuple(t["shape"])) for name, t in entry["tensors"].items()]
            spans = {
                f"{module}.{name}": (int(t["offset"]), num * int(t["expert_nbytes"]))
                for name, t in entry["tensors"].items()
            }
            files[rel], fields = write_expert_layer(
                tmp / rel, module, tensors, lambda k: _read_range(src / rel, *spans[k])
            )
            if fields["tensor_major"] != manifest["files"][rel]:
                raise Edge0Error(
                    f"{src / rel}: its bytes do not match the manifest's sha256; the store is damaged, convert it again"
                )
            layers.append({"layer": entry["layer"], "module": module, "file": rel, **fields})
        (tmp / MANIFEST).write_text(
            json.dumps(seal({**manifest, "version": VERSION, "files": files, "expert_layers": layers}), indent=1)
        )
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
