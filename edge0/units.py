"""Byte sizes: one parser and one formatter for every option that takes a size, and the one table of
safetensors dtypes (their names and bytes per element)."""

from __future__ import annotations

import re

from edge0.errors import Edge0Error

# Decimal units (KB = 1000) as disks and `df -H` count; binary ones spelled out (KiB = 1024).
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text, field: str = "--expert-cache") -> int:
    """'2GB', '512MiB', '1.5G', '64k' or a plain byte count -> bytes. `field` names the option in
    the error."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else ""
    unit = unit + "B" if unit in ("K", "M", "G", "T") else unit
    if not m or unit not in _UNITS:
        raise Edge0Error(f"{field} {text!r}: not a size; use e.g. 2GB, 512MB or 1.5GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_rate(text, field: str = "--read-limit") -> int:
    """'200MB/s' (or '200MB', or bytes/s as a number) -> bytes per second, at least 1 MB/s (reads
    slower than that never finish a step); an Edge0Error naming `field`."""
    t = str(text).strip()
    try:
        rate = parse_size(t[:-2] if t.lower().endswith("/s") else t, field)
    except Edge0Error:
        raise Edge0Error(f"{field} {text!r}: not a rate; use e.g. 200MB/s") from None
    if rate < 10**6:
        raise Edge0Error(f"{field} {text}: at least 1MB/s (reads slower than that never finish a step)")
    return rate


def format_size(n: int) -> str:
    """Bytes as a short decimal size: '2.25 GB'."""
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n} B"


# safetensors dtype label -> (numpy / mlx dtype name, bytes per element).
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U32": ("uint32", 4),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


def tensor_nbytes(st_dtype: str, shape) -> int:
    """Bytes of a tensor of safetensors dtype `st_dtype` and `shape`."""
    n = SAFETENSORS_DTYPES[st_dtype][1]
    for d in shape:
        n *= int(d)
    return n
