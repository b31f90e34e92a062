"""Streaming safetensors writers: tensor-major files (resident weights, version 1 layer files)
and expert-major layer files (version 2).

The safetensors library writes a whole dict at once; the converter must write tensor by tensor
so memory does not grow with model size. The header only needs names, dtypes and shapes, which
are known before any data is computed. Files written here are read back by `safetensors`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

from edge0.store.format import ALIGN, EXPERT_MAJOR, expert_file, sha256_file
from edge0.store.stripes import PART_FORMAT, StripeDirs, mark_file, part_file, row_parts
from edge0.units import tensor_nbytes

# Start of each tensor inside an expert row: keeps every tensor aligned for any dtype view.
ROW_ALIGN = 64


def _header(entries: list[tuple[str, str, tuple]], metadata: dict | None, align: int) -> tuple[bytes, dict]:
    """(length prefix + JSON header padded so the data starts `align`-aligned, {name: relative offset})."""
    header, pos = {}, 0
    for name, st_dtype, shape in entries:
        n = tensor_nbytes(st_dtype, shape)
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % align)
    return struct.pack("<Q", len(blob)) + blob, {
        k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"
    }


class SafetensorsWriter:
    """Write tensors in the declared order; `offsets[name]` is each tensor's absolute byte offset."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple]], metadata: dict | None = None):
        self.path = Path(path)
        head, rel = _header(entries, metadata, 8)
        self.sizes = {name: tensor_nbytes(dt, shape) for name, dt, shape in entries}
        self.data_start = len(head)
        self.offsets = {k: self.data_start + v for k, v in rel.items()}
        self._order = [e[0] for e in entries]
        self._sha = hashlib.sha256()
        self.crc32 = 0  # of the whole file: the resident weights are checked with it at load
        self._fh = open(self.path, "wb")
        self._put(head)

    def _put(self, b) -> None:
        self._fh.write(b)
        self._sha.update(b)
        self.crc32 = zlib.crc32(b, self.crc32)

    def write(self, name: str, data: memoryview | bytes) -> None:
        """Append the raw bytes of the next tensor."""
        expected = self._order[0] if self._order else None
        if name != expected:
            raise ValueError(f"tensor {name!r} written out of order (expected {expected!r})")
        n = len(memoryview(data).cast("B"))
        if n != self.sizes[name]:
            raise ValueError(f"tensor {name!r}: {n} bytes, header says {self.sizes[name]}")
        self._order.pop(0)
        self._put(data)

    def close(self) -> dict:
        """Finish the file; returns {"size", "sha256"} for the manifest."""
        if self._order:
            raise ValueError(f"{self.path}: tensors never written: {self._order[:3]}")
        self._fh.close()
        return {"size": self.path.stat().st_size, "sha256": self._sha.hexdigest()}


def expert_major_layout(module: str, tensors: list[tuple[str, str, tuple]]) -> tuple[int, int, dict]:
    """(num_experts, expert_stride, {relative name: dtype, shape, expert_offset, expert_nbytes})
    of an expert-major row holding `tensors` (full names under `module`, stacked shapes [E, ...])."""
    num = int(tensors[0][2][0])
    out, pos = {}, 0
    for name, st_dtype, shape in tensors:
        if not name.startswith(module + ".") or int(shape[0]) != num:
            raise ValueError(f"{name} {tuple(shape)}: not a stacked tensor of {module} with {num} experts")
        pos += -pos % ROW_ALIGN
        n = tensor_nbytes(st_dtype, shape[1:])
        out[name[len(module) + 1 :]] = {
            "dtype": st_dtype,
            "shape": [int(d) for d in shape],
            "expert_offset": pos,
            "expert_nbytes": n,
        }
        pos += n
    return num, pos + (-pos % ALIGN), out


def write_expert_layer(path, module: str, tensors: list[tuple[str, str, tuple]], get_bytes) -> tuple[dict, dict]:
    """Write one MoE layer as an expert-major file (store format version 2).

    `tensors`: [(full name, safetensors dtype, stacked shape [E, ...])] in tensor-major write
    order; `get_bytes(name)` returns the raw bytes of that stacked tensor and is called once per
    tensor, in order, so at most one stacked tensor is held at a time. The file is one safetensors
    tensor `{module}.experts` uint8 [E, expert_stride] whose data starts 4 KiB-aligned; row e holds
    expert e's tensors at their `expert_offset`s, padded with zeros to a multiple of 4 KiB.
    Written to a temporary file beside `path` and renamed. Returns ({"size", "sha256"} of the
    file, the manifest layer entry's layout fields), where `tensor_major` is the size and sha256
    of the tensor-major file the same tensors would make (the store's identity; see
    format.manifest_hash)."""
    infos, fields = write_expert_parts([path], module, tensors, get_bytes)
    return infos[0], fields


def write_expert_parts(paths: list, module: str, tensors: list[tuple[str, str, tuple]], get_bytes) -> tuple[list, dict]:
    """`write_expert_layer` with each row cut into `len(paths)` parts (stripes.row_parts), part k
    in `paths[k]` as the safetensors tensor `{module}.experts.part-K` uint8 [E, row bytes]; one
    path writes the plain layer file. Returns ([{"size", "sha256"}] per file, the layout fields,
    with "parts": [{"offset", "row_start", "row_bytes"}] when cut)."""
    paths = [Path(p) for p in paths]
    num, stride, layout = expert_major_layout(module, tensors)
    table = json.dumps(layout, separators=(",", ":"))
    cuts = row_parts(stride, len(paths)) if len(paths) > 1 else [(0, stride)]
    heads = []
    for k, (start, size) in enumerate(cuts):
        if len(paths) == 1:
            heads.append(
                _header(
                    [(f"{module}.experts", "U8", (num, stride))],
                    {"format": "edge0-expert-major", "tensors": table},
                    ALIGN,
                )[0]
            )
        else:
            meta = {
                "format": PART_FORMAT,
                "part": str(k),
                "parts": str(len(paths)),
                "row_start": str(start),
                "tensors": table,
            }
            heads.append(_header([(f"{module}.experts.part-{k}", "U8", (num, size))], meta, ALIGN)[0])
    tm_head, _ = _header(tensors, {"format": "mlx"}, 8)  # what SafetensorsWriter would write
    tm_sha, tm_size = hashlib.sha256(tm_head), len(tm_head)
    tmps = [p.with_name(f".{p.name}.partial-{os.getpid()}") for p in paths]
    crcs = [0] * num  # per expert: crc32 of its tensors' bytes in this order, checked when first read
    try:
        handles = [open(t, "wb") for t in tmps]
        try:
            for fh, head, (_, size) in zip(handles, heads, cuts):
                fh.write(head)
                fh.truncate(len(head) + num * size)  # the padding reads back as zeros
            for name, _, _ in tensors:
                t = layout[name[len(module) + 1 :]]
                n = t["expert_nbytes"]
                data = memoryview(get_bytes(name)).cast("B")
                if len(data) != num * n:
                    raise ValueError(f"tensor {name!r}: {len(data)} bytes, expected {num * n}")
                tm_sha.update(data)
                tm_size += len(data)
                for e in range(num):
                    one = data[e * n : (e + 1) * n]
                    pos = t["expert_offset"]
                    for fh, head, (start, size) in zip(handles, heads, cuts):
                        lo, hi = max(pos, start), min(pos + n, start + size)
                        if lo < hi:  # the part of this tensor that falls in this part of the row
                            fh.seek(len(head) + e * size + lo - start)
                            fh.write(one[lo - pos : hi - pos])
                    crcs[e] = zlib.crc32(one, crcs[e])
                del data
        finally:
            for fh in handles:
                fh.close()
        infos = [{"size": t.stat().st_size, "sha256": sha256_file(t)} for t in tmps]
        for t, p in zip(tmps, paths):
            os.replace(t, p)
    except BaseException:
        for t in tmps:
            t.unlink(missing_ok=True)
        raise
    fields = {
        "num_experts": num,
        "layout": EXPERT_MAJOR,
        **({"offset": len(heads[0])} if len(paths) == 1 else {}),
        "expert_stride": stride,
        "tensors": layout,
        "tensor_major": {"size": tm_size, "sha256": tm_sha.hexdigest()},
        "expert_crc32": crcs,
    }
    if len(paths) == 1:
        return infos, fields
    parts = [{"offset": len(h), "row_start": start, "row_bytes": size} for h, (start, size) in zip(heads, cuts)]
    return infos, {**fields, "parts": parts}


def write_layer(tmp: Path, dirs: StripeDirs, files: dict, layer: int, module: str, tensors: list, get_bytes) -> dict:
    """Write one MoE layer's experts (into `tmp`, the store's partial directory, and cut over the
    stripe directories if there are any); add its files to `files`; returns its manifest entry."""
    rel = expert_file(layer)
    if not dirs.final:
        infos, fields = write_expert_parts([tmp / rel], module, tensors, get_bytes)
        files[rel] = infos[0]
        return {"layer": layer, "module": module, "file": rel, **fields}
    rels = [part_file(layer, k) for k in range(dirs.count)]
    infos, fields = write_expert_parts([dirs.path(tmp, k) / r for k, r in enumerate(rels)], module, tensors, get_bytes)
    for k, (r, info) in enumerate(zip(rels, infos)):
        files[r] = {**info, "dir": k} if k else info
    for k in range(1, dirs.count):
        f = dirs.path(tmp, k) / mark_file(k)
        files[mark_file(k)] = {"size": f.stat().st_size, "sha256": sha256_file(f), "dir": k}
    parts = [{"dir": k, "file": r, **p} for k, (r, p) in enumerate(zip(rels, fields.pop("parts")))]
    return {"layer": layer, "module": module, "file": rel, **fields, "parts": parts}
