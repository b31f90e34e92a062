"""Experts striped over several directories, one per disk: each expert's row is cut into one part
per directory, so every read (one expert or a whole layer) draws on all the disks at once.

Cut within each row rather than placing whole experts: a decode step reads a layer's few misses
(about 8 of 128 experts) together, and 8 whole experts spread over two disks leave the busier
one 5-6 of them on average; parts of every row give each disk an equal share of every read.

Directory 0 is the store itself; the others are the manifest's `stripes.dirs` (absolute paths),
each holding a mark file (`edge0-stripe-K.json`) with the store's stripe id, so a missing or
wrong directory is one clear error at load. See docs/store-format.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

from edge0.errors import Edge0Error
from edge0.store.outdir import partial_dir, remove_stale_partials

ALIGN = 4096  # as format.ALIGN (format imports this module)
PART_FORMAT = "edge0-expert-part"
MARK_FORMAT = "edge0-stripe"
MARK_VERSION = 1
# the only files a directory other than the store may hold (a manifest names nothing else there)
_PART_NAME = re.compile(r"experts/layer-\d{3,}\.part-\d+\.safetensors|edge0-stripe-\d+\.json")


def row_parts(stride: int, n: int) -> list[tuple[int, int]]:
    """(row start, bytes) of each of `n` parts of a `stride`-byte row: whole 4 KiB pages, as even
    as they go (a row of fewer pages than parts leaves the last parts empty)."""
    pages, out, start = stride // ALIGN, [], 0
    for k in range(n):
        size = (pages // n + (k < pages % n)) * ALIGN
        out.append((start, size))
        start += size
    return out


def part_file(layer: int, k: int) -> str:
    return f"experts/layer-{layer:03d}.part-{k}.safetensors"


def mark_file(k: int) -> str:
    return f"edge0-stripe-{k}.json"


def layer_parts(entry: dict) -> list[dict]:
    """Where an expert-major layer's rows live: [{"dir", "file", "offset", "row_start",
    "row_bytes"}], one per part; an unstriped layer is one part, its whole file."""
    if "parts" in entry:
        return entry["parts"]
    stride = int(entry["expert_stride"])
    return [{"dir": 0, "file": entry["file"], "offset": int(entry["offset"]), "row_start": 0, "row_bytes": stride}]


def layer_files(entry: dict) -> list[str]:
    """The files holding a layer's experts (its parts', or its one file)."""
    return [p["file"] for p in entry["parts"]] if "parts" in entry else [entry["file"]]


def store_dirs(root, manifest: dict) -> list[Path]:
    """Directory 0 (the store) and every stripe directory, in the manifest's order."""
    return [Path(root), *(Path(d) for d in (manifest.get("stripes") or {}).get("dirs", []))]


def locate(root, manifest: dict, rel: str) -> Path:
    """The path of `rel`, a key of the manifest's files, in the directory that holds it."""
    return store_dirs(root, manifest)[int((manifest["files"].get(rel) or {}).get("dir", 0))] / rel


def check_names(manifest: dict, bad) -> None:
    """Stripe directories are absolute paths, and a file placed outside the store is a part file
    or a mark (so a manifest cannot name any other file there); `bad(key, what)` makes the error."""
    stripes = manifest.get("stripes")
    if stripes is None:
        dirs = []
    elif not (
        isinstance(stripes, dict) and isinstance(stripes.get("id"), str) and isinstance(stripes.get("dirs"), list)
    ):
        raise bad("stripes", "needs an id (a string) and dirs (a list of absolute paths)")
    else:
        dirs = stripes["dirs"]
    for i, d in enumerate(dirs):
        if not (isinstance(d, str) and os.path.isabs(d) and "\0" not in d):
            raise bad(f"stripes.dirs[{i}]", f"is {str(d)[:200]!r}, not an absolute path")
    for rel, info in manifest["files"].items():
        k = info.get("dir", 0) if isinstance(info, dict) else 0
        if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= len(dirs)):
            raise bad(f"files[{rel!r}].dir", f"is {k!r}, not a directory of the store (0 to {len(dirs)})")
        if k and not _PART_NAME.fullmatch(rel):
            raise bad(f"files[{rel!r}]", f"is placed in stripe directory {k}, which holds only expert parts")


def check_dirs(root: Path, manifest: dict, manifest_path: Path) -> None:
    """Every stripe directory is there and is this store's (its mark holds the store's stripe id)."""
    stripes = manifest.get("stripes")
    if not stripes:
        return
    n = len(stripes["dirs"]) + 1
    for k, d in enumerate(store_dirs(root, manifest)[1:], start=1):
        mark = d / mark_file(k)
        fix = (
            "mount the disk that holds it at that path, or lay the store out again from its source: "
            "edge0 convert --hf-path <source model> -o <new dir> (with --stripe for each disk)"
        )
        if not d.is_dir():
            raise Edge0Error(f"{d}: missing; {manifest_path} places part {k + 1} of {n} of every expert there; {fix}")
        try:
            got = json.loads(mark.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            got = None
        if not isinstance(got, dict) or got.get("format") != MARK_FORMAT or got.get("id") != stripes["id"]:
            raise Edge0Error(
                f"{mark}: missing or not this store's (stripe id {stripes['id']}); {d} is not the stripe "
                f"directory {k} of {root}; {fix}"
            )


class StripeDirs:
    """The stripe directories a conversion writes beside its output: each must not exist; each is
    written as `.NAME.partial-PID` and renamed by `commit()` (before the store itself, so a store
    never names a directory that is not there); `discard()` removes the partial ones."""

    def __init__(self, dirs, quiet: bool, out: Path):
        self.final = [Path(d).expanduser().resolve() for d in dirs]
        self.id = uuid.uuid4().hex
        if len(set(self.final)) != len(self.final):
            raise Edge0Error("--stripe: the same directory given twice; give one directory per disk")
        store = Path(out).expanduser().resolve()
        for d in self.final:
            if d == store or store in d.parents or d in store.parents:
                raise Edge0Error(
                    f"--stripe {d}: is the output directory, inside it or above it; give a directory on another disk"
                )
        for d in self.final:
            if d.exists():
                raise Edge0Error(f"--stripe {d}: already exists; choose a new directory on that disk")
            try:
                d.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise Edge0Error(
                    f"--stripe {d}: cannot create {d.parent} ({e.strerror}); choose a writable disk"
                ) from None
            remove_stale_partials(d, quiet)
        self.tmp = [partial_dir(d, os.getpid()) for d in self.final]
        self.renamed: list[Path] = []  # renamed by commit(), this run's own

    @property
    def count(self) -> int:
        """Directories a layer is cut over: the store and every stripe directory."""
        return len(self.final) + 1

    def make(self) -> None:
        for k, t in enumerate(self.tmp, start=1):
            (t / "experts").mkdir(parents=True)
            (t / mark_file(k)).write_text(
                json.dumps({"format": MARK_FORMAT, "version": MARK_VERSION, "id": self.id, "dir": k})
            )

    def path(self, store_tmp: Path, k: int) -> Path:
        """Where directory `k` is being written (0: the store's own partial directory)."""
        return store_tmp if k == 0 else self.tmp[k - 1]

    def manifest(self) -> dict:
        return {"id": self.id, "dirs": [str(d) for d in self.final]}

    def commit(self) -> None:
        for t, d in zip(self.tmp, self.final):
            if d.exists():
                raise Edge0Error(f"--stripe {d}: created by another process while converting; choose a new directory")
            os.rename(t, d)
            self.renamed.append(d)

    def discard(self) -> None:
        """Remove what this run wrote: the partial directories, and those it renamed already (the
        store itself was not renamed, so nothing names them)."""
        for t in self.tmp:
            shutil.rmtree(t, ignore_errors=True)
        for d in self.renamed:
            shutil.rmtree(d, ignore_errors=True)
