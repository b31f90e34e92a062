"""Lay a store's expert files out again: tensor-major layer files (format version 1) as
expert-major (version 2), and with `stripes` every expert's row cut over more directories, one
per disk (store/stripes.py); a striped store without `stripes` is joined back into one.

    edge0 relayout SRC OUT [--stripe DIR ...]

Every other file is copied as is. The store keeps its identity (format.manifest_hash), so heads,
adapters and traces made for SRC fit OUT. Written into `.<OUT>.partial-<pid>` (and each stripe
directory likewise) and renamed at the end, like `edge0 convert`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from edge0.errors import Edge0Error
from edge0.store.format import EXPERT_MAJOR, MANIFEST, VERSION, open_manifest, seal
from edge0.store.outdir import output_lock, partial_dir, remove_stale_partials, unwind_on_termination
from edge0.store.reader import ExpertStore
from edge0.store.stripes import StripeDirs, layer_files
from edge0.store.writer import write_layer


def _read_range(path: Path, offset: int, n: int) -> bytearray:
    buf = bytearray(n)
    with open(path, "rb") as fh:
        fh.seek(offset)
        if fh.readinto(buf) != n:
            raise Edge0Error(f"{path} ends before byte {offset + n}; the store is damaged, convert it again")
    return buf


def relayout_store(src, out, stripes: list | None = None, quiet: bool = True) -> Path:
    """Write an expert-major copy of store `src` at `out` (which must not exist), cut over the
    directories `stripes` (none existing yet) if given; returns `out`. Each tensor-major file is
    checked against its manifest sha256 while it is read, each expert-major row against its crc32."""
    src, out = Path(src), Path(out).expanduser()
    manifest = open_manifest(src)
    if out.exists():
        raise Edge0Error(f"{out}: already exists; choose a new output directory or delete it")
    with output_lock(out, wait=False, quiet=False), unwind_on_termination():
        if out.exists():  # written while we waited for the lock
            raise Edge0Error(f"{out}: already exists; choose a new output directory or delete it")
        remove_stale_partials(out, quiet=False)
        dirs = StripeDirs(stripes or [], quiet, out)
        return _relayout(src, out, manifest, partial_dir(out, os.getpid()), dirs)


def _relayout(src: Path, out: Path, manifest: dict, tmp: Path, dirs: StripeDirs) -> Path:
    layer_rels = {f for l in manifest["expert_layers"] for f in layer_files(l)}
    store = None
    try:
        shutil.copytree(
            src,
            tmp,
            ignore=lambda d, names: [
                n for n in names if n == MANIFEST and Path(d) == src or os.path.relpath(Path(d) / n, src) in layer_rels
            ],
        )
        dirs.make()
        files = {k: v for k, v in manifest["files"].items() if k not in layer_rels and not v.get("dir")}
        layers = []
        for entry in manifest["expert_layers"]:
            rel, module = entry["file"], entry["module"]
            if entry.get("layout") == EXPERT_MAJOR and "parts" not in entry and not dirs.final:
                shutil.copy(src / rel, tmp / rel)  # already as wanted
                files[rel] = manifest["files"][rel]
                layers.append(entry)
                continue
            tensors = [(f"{module}.{name}", t["dtype"], tuple(t["shape"])) for name, t in entry["tensors"].items()]
            if entry.get("layout") == EXPERT_MAJOR:  # the rows, checked against their crc32 as read
                store = store or ExpertStore(src, manifest, io="pread")
                whole = store.read_layer(int(entry["layer"]))
                get = lambda k, whole=whole: memoryview(whole[k[len(module) + 1 :]][0])  # noqa: E731
                want = entry["tensor_major"]
            else:
                num = int(entry["num_experts"])
                spans = {
                    f"{module}.{name}": (int(t["offset"]), num * int(t["expert_nbytes"]))
                    for name, t in entry["tensors"].items()
                }
                get = lambda k, spans=spans, rel=rel: _read_range(src / rel, *spans[k])  # noqa: E731
                want = manifest["files"][rel]
            new = write_layer(tmp, dirs, files, int(entry["layer"]), module, tensors, get)
            if new["tensor_major"] != want:
                raise Edge0Error(
                    f"{src / rel}: its bytes do not match the manifest's sha256; the store is damaged, convert it again"
                )
            layers.append(new)
        relaid = {k: v for k, v in manifest.items() if k not in ("stripes", "manifest_sha256")}
        relaid.update(version=VERSION, files=files, expert_layers=layers)
        if dirs.final:
            relaid["stripes"] = dirs.manifest()
        (tmp / MANIFEST).write_text(json.dumps(seal(relaid), indent=1))
        dirs.commit()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        dirs.discard()
        raise
    finally:
        if store is not None:
            store.close()
    return out
