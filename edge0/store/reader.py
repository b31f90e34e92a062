"""Expert reads from the layer files of a store, through one of the strategies in readers.py.

Expert-major layers (format version 2): expert e is the row [offset + e * expert_stride,
offset + (e + 1) * expert_stride), one read. Tensor-major layers (version 1): expert e of a
tensor is [offset + e * expert_nbytes, offset + (e + 1) * expert_nbytes), one read per tensor.
"""

from __future__ import annotations

import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edge0.errors import Edge0Error
from edge0.store.format import ALIGN, EXPERT_MAJOR, RELAYOUT
from edge0.store.pacing import StoragePacer
from edge0.store.readers import CHUNK, DEFAULT_QUEUE_DEPTH, IOV_MAX, aligned_empty, choose_io, make_reader, split
from edge0.store.stripes import layer_files, layer_parts, store_dirs


def _runs(ids: list[int]):
    """(output row, first expert, count) for each run of consecutive expert ids: one read each."""
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        yield i, ids[i], j - i
        i = j


class ExpertStore:
    """Byte-range access to every MoE layer's experts. Thread-safe; counts bytes read.

    `io`: "auto" (chosen from the store's size and the memory available; see readers.choose_io),
    "mmap", "pread" or "direct". `queue_depth`: reads of one call in flight at once.
    `cold_reads` drops every range it reads from the OS page cache too, so each read comes from
    storage: a benchmark knob that simulates a model much larger than RAM on a machine where it
    would otherwise stay cached. `check_experts`: the first read of each expert in this process
    is checked against its crc32 in the manifest (expert-major layers), so damage is caught
    where it is read, not as garbage output. `pace_reads` (bytes/s): every read completes as from
    a disk of that bandwidth (store/pacing.py), a benchmark knob for storage slower than this one."""

    def __init__(
        self,
        root,
        manifest: dict,
        cold_reads: bool = False,
        io: str = "auto",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        check_experts: bool = True,
        pace_reads: int | None = None,
    ):
        self.root = Path(root)
        self.dirs = store_dirs(root, manifest)
        self.layers = {int(l["layer"]): l for l in manifest["expert_layers"]}
        # per layer: the manifest's crc32 of each expert, and which were checked (once per process)
        self._crc = {
            l: np.array(info["expert_crc32"], dtype=np.int64)
            for l, info in self.layers.items()
            if check_experts and "expert_crc32" in info
        }
        self._checked = {l: np.zeros(len(c), dtype=bool) for l, c in self._crc.items()}
        self.experts_checked, self.check_s = 0, 0.0
        self.resident_checked: str | None = None  # the hash model.safetensors was checked with at load
        self.reason = "requested"
        if io == "auto":
            files = manifest.get("files", {})
            sizes = [files.get(f, {}).get("size", 0) for l in self.layers.values() for f in layer_files(l)]
            io, self.reason = choose_io(sum(sizes))
        # one reader per directory (each its own disk: its own queue, and its own pace)
        self._readers = [
            make_reader(io, d, queue_depth, cold_reads, StoragePacer(pace_reads) if pace_reads else None)
            for d in self.dirs
        ]
        self._reader = self._readers[0]
        # the parts beyond the first are read on these threads while the caller reads the first
        self._fanout = ThreadPoolExecutor(4 * (len(self.dirs) - 1), "edge0-stripe") if len(self.dirs) > 1 else None
        self._lock = threading.Lock()
        self.bytes_read = 0

    @property
    def io(self) -> str:
        """The read strategy in use."""
        return self._reader.name

    @property
    def cold_reads(self) -> bool:
        return self._reader.cold_reads

    @cold_reads.setter
    def cold_reads(self, value: bool) -> None:
        for r in self._readers:
            r.cold_reads = value

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of one expert of `layer` (all its tensors, without row padding)."""
        return sum(t["expert_nbytes"] for t in self.layers[layer]["tensors"].values())

    def layer_paths(self, layer: int) -> list[Path]:
        """The files that hold `layer`'s experts (one, or one per stripe directory)."""
        info = self.layers[layer]
        if info.get("layout") != EXPERT_MAJOR:
            return [self.root / info["file"]]
        return [self.dirs[p["dir"]] / p["file"] for p in layer_parts(info)]

    def _fill(
        self, info: dict, ids: list[int] | None, into: dict | None = None
    ) -> dict[str, tuple[np.ndarray, str, tuple]]:
        """Read experts `ids` (None: all, in large reads) of one layer into fresh arrays, and the
        tensors in `into` straight into its rows (see `read`)."""
        n = int(info["num_experts"]) if ids is None else len(ids)
        runs = [(0, 0, n)] if ids is None else list(_runs(ids))
        tensors = info["tensors"]
        into = into or {}
        for name, rows in into.items():
            size = int(tensors[name]["expert_nbytes"])
            if len(rows) != n or any(
                r.dtype != np.uint8 or r.shape != (size,) or not r.flags.c_contiguous for r in rows
            ):
                raise ValueError(f"read into {name}: need {n} contiguous uint8 rows of {size} bytes")
        # One contiguous, 4 KiB-aligned array per tensor (MLX copies a strided view's whole base),
        # carved from one block per call: one allocation, which the C allocator then reuses.
        starts, total = {}, 0
        for name, t in tensors.items():
            if name not in into:
                starts[name] = total
                total += -(-n * int(t["expert_nbytes"]) // ALIGN) * ALIGN
        block = aligned_empty(total, mapped=ids is None)  # a whole layer: returned to the OS once freed
        fresh = {
            name: block[starts[name] : starts[name] + n * int(tensors[name]["expert_nbytes"])].reshape(
                n, int(tensors[name]["expert_nbytes"])
            )
            for name in starts
        }
        out = {**fresh, **into}  # each tensor's destination, one row per expert read
        aligned = False
        if info.get("layout") == EXPERT_MAJOR:
            stride = int(info["expert_stride"])
            row, pos = [], 0  # one expert's row: (gap before, tensor name), then the tail padding
            for name, t in sorted(tensors.items(), key=lambda kv: kv[1]["expert_offset"]):
                row.append((int(t["expert_offset"]) - pos, name))
                pos = int(t["expert_offset"]) + int(t["expert_nbytes"])
            tail = stride - pos
            # every segment an aligned array (no padding, page-multiple tensors): direct I/O in place
            aligned = (
                not tail
                and all(gap == 0 and int(tensors[name]["expert_nbytes"]) % ALIGN == 0 for gap, name in row)
                and all(r.ctypes.data % ALIGN == 0 for rows in into.values() for r in rows)
            )
            reads = [
                (part, _part_ranges(part, row, tail, out, runs)) for part in layer_parts(info) if part["row_bytes"]
            ]
        else:
            ranges = []
            for name, t in tensors.items():
                size = int(t["expert_nbytes"])
                for i, e, k in runs:
                    if name in into:  # rows that need not be adjacent: one range each
                        for j in range(k):
                            ranges += split(int(t["offset"]) + (e + j) * size, into[name][i + j])
                    else:
                        ranges += split(int(t["offset"]) + e * size, out[name][i : i + k].reshape(-1))
            reads = [({"dir": 0, "file": info["file"]}, ranges)]
        self._read_parts(reads, aligned)
        if int(info["layer"]) in self._checked:
            self._check(info, list(range(n)) if ids is None else ids, out)
        with self._lock:
            self.bytes_read += n * sum(int(t["expert_nbytes"]) for t in tensors.values())
        return {name: (fresh[name], tensors[name]["dtype"], tuple(tensors[name]["shape"][1:])) for name in fresh}

    def _read_parts(self, reads: list, aligned: bool) -> None:
        """Each part's ranges from its directory's reader, the directories at once."""
        futures = [
            self._fanout.submit(self._readers[part["dir"]].read, part["file"], ranges, aligned)
            for part, ranges in reads[1:]
        ]
        try:
            if reads:
                self._readers[reads[0][0]["dir"]].read(reads[0][0]["file"], reads[0][1], aligned)
        finally:
            for f in futures:
                f.result()

    def _check(self, info: dict, ids: list[int], out: dict) -> None:
        """Compare the experts of this read that were never checked with their crc32."""
        layer = int(info["layer"])
        checked, want = self._checked[layer], self._crc[layer]
        t0 = time.perf_counter()
        n = 0
        try:
            for row, e in enumerate(ids):
                if checked[e]:
                    continue
                crc = 0
                for name in info["tensors"]:  # the writer's order
                    crc = zlib.crc32(out[name][row], crc)
                if crc != want[e]:
                    raise Edge0Error(
                        f"{self.root / info['file']}: layer {layer} expert {e} does not match its checksum "
                        f"(crc32): the store is damaged; find every damaged file with: edge0 verify {self.root}"
                    )
                checked[e] = True
                n += 1
        finally:
            with self._lock:
                self.experts_checked += n
                self.check_s += time.perf_counter() - t0

    def read(self, layer: int, ids, into: dict | None = None) -> dict[str, tuple[np.ndarray, str, tuple]]:
        """Copy experts `ids` of `layer` out of the file: one read per run of consecutive ids
        (expert-major) or per tensor and run (tensor-major), up to `queue_depth` in flight.

        Returns {tensor name: (uint8 bytes [len(ids), expert_nbytes], safetensors dtype,
        per-expert shape)}; tensor names are relative to the layer's expert module
        (e.g. "gate_proj.scales"). The arrays are C-contiguous, disjoint parts of one block
        allocated for this call, never reused by the store. With an expert-major layer, one read
        fills all tensors of an expert (a vectored read, or a run of adjacent experts at once).

        `into` {tensor name: one flat uint8 array of its expert_nbytes per id}: those tensors are
        read straight into these arrays (a slot set's rows: no second copy) and left out of the
        result.
        """
        return self._fill(self.layers[layer], [int(e) for e in ids], into)

    def read_layer(self, layer: int) -> dict[str, tuple[np.ndarray, str, tuple]]:
        """All experts of `layer` in large sequential reads (same layout as `read`)."""
        return self._fill(self.layers[layer], None)

    def io_stats(self) -> dict:
        """Which reader ran and why, reads issued, bytes issued (with row padding) and read
        (tensor bytes), the most reads in flight at once, and direct-I/O fallbacks (summed over
        the stripe directories, with each one's own under "dirs" when there are several)."""
        d = _summed([r.stats() for r in self._readers])
        d.update(
            reason=self.reason,
            bytes_read=self.bytes_read,
            expert_checks=bool(self._checked),
            experts_checked=self.experts_checked,
            check_ms=1000 * self.check_s,
        )
        d["tensor_major_layers"] = sum(l.get("layout") != EXPERT_MAJOR for l in self.layers.values())
        return d

    def describe_io(self) -> str:
        """One line: reader, queue depth, why, layout, and any fallback."""
        s = self.io_stats()
        line = f"expert reads: {s['reader']}, queue depth {s['queue_depth']} ({s['reason']})"
        if s["tensor_major_layers"]:
            per = max(len(l["tensors"]) for l in self.layers.values())
            line += (
                f"; {s['tensor_major_layers']} tensor-major layers (format version 1): {per} reads per expert, "
                f"re-lay out with: {RELAYOUT} {self.root} <new dir>"
            )
        else:
            line += "; expert-major layout: 1 read per expert"
        if len(self.dirs) > 1:
            line += f"; every expert striped over {len(self.dirs)} directories ({', '.join(map(str, self.dirs))})"
        if s["paced"]:
            each = s["paced"]["rate_bytes_per_s"] / len(self.dirs) / 1e6
            line += f"; paced as a {each:g} MB/s disk" + (" each" if len(self.dirs) > 1 else "")
        line += "; experts checked (crc32) when first read" if s["expert_checks"] else "; experts not checked when read"
        if self.resident_checked:
            line += f", resident weights ({self.resident_checked}) at load"
        if s["direct_fallbacks"]:
            reasons = "; ".join(s["direct_fallback_reasons"])
            line += f"; page-cache bypass fell back to pread for {s['direct_fallbacks']} files: {reasons}"
        return line

    def close(self) -> None:
        if self._fanout is not None:
            self._fanout.shutdown(wait=True)
        for r in self._readers:
            r.close()


def _part_ranges(part: dict, row: list, tail: int, out: dict, runs: list) -> list:
    """The (file offset, length, segments) reads of one part of a layer's rows: for each run of
    consecutive experts (at most CHUNK bytes and IOV_MAX segments a read), the row bytes
    [row_start, row_start + row_bytes) of each, scattered into the output arrays."""
    start, size = int(part["row_start"]), int(part["row_bytes"])
    per = max(1, min(CHUNK // size, IOV_MAX // (2 * len(row) + 1)))
    ranges = []
    for i, e, k in runs:
        for j in range(0, k, per):
            segments = []
            for r in range(i + j, i + min(k, j + per)):
                whole = []
                for gap, name in row:
                    whole += [gap, out[name][r]] if gap else [out[name][r]]
                segments += _cut(whole + ([tail] if tail else []), start, start + size)
            ranges.append((int(part["offset"]) + (e + j) * size, (min(k, j + per) - j) * size, segments))
    return ranges


def _cut(segments: list, start: int, end: int) -> list:
    """The segments of a row (arrays, or ints: bytes to skip) that cover its bytes [start, end)."""
    out, pos = [], 0
    for s in segments:
        n = s if isinstance(s, int) else s.nbytes
        lo, hi = max(pos, start), min(pos + n, end)
        if lo < hi:
            out.append(hi - lo if isinstance(s, int) else s[lo - pos : hi - pos])
        pos += n
    return out


def _summed(stats: list[dict]) -> dict:
    """One reader's stats, or several directories' readers' added up (rates of paced disks too)."""
    if len(stats) == 1:
        return stats[0]
    d = dict(stats[0])
    for k in ("reads", "bytes_issued", "direct_fallbacks"):
        d[k] = sum(s[k] for s in stats)
    d["max_queue_depth"] = max(s["max_queue_depth"] for s in stats)
    d["direct_fallback_reasons"] = sorted({r for s in stats for r in s["direct_fallback_reasons"]})
    if d["paced"]:
        paced = [s["paced"] for s in stats]
        d["paced"] = {
            **paced[0],
            **{k: sum(p[k] for p in paced) for k in ("rate_bytes_per_s", "reads", "storage_bytes", "waited_s")},
        }
    d["dirs"] = stats
    return d
