"""Array operations and device facts for Edge0's core logic.

Core modules (routing, executors, engine) call these names instead of importing mlx, so the
backend stays behind one narrow interface.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

import mlx.core as mx
import numpy as np

from edge0.units import SAFETENSORS_DTYPES

Array = mx.array

# glibc keeps freed buffers in the C heap; its malloc_trim gives their pages back (musl, macOS: none).
_libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_malloc_trim = getattr(_libc, "malloc_trim", None)
_mallopt = getattr(_libc, "mallopt", None)
M_ARENA_MAX = -8  # glibc's malloc.h

# Ops used by routing; they are mlx's own so results stay bit-identical to mlx-lm.
softmax = mx.softmax
sigmoid = mx.sigmoid
argpartition = mx.argpartition
take_along_axis = mx.take_along_axis
put_along_axis = mx.put_along_axis
topk = mx.topk
unflatten = mx.unflatten
flatten = mx.flatten
stop_gradient = mx.stop_gradient
compile = mx.compile
float32 = mx.float32
uint32 = mx.uint32
eval = mx.eval
async_eval = mx.async_eval
argmax = mx.argmax
concatenate = mx.concatenate
stack = mx.stack
take = mx.take
where = mx.where
zeros = mx.zeros
zeros_like = mx.zeros_like
# Ops used by the features' losses and samplers (edge0/lora, edge0/prerouter).
logsumexp = mx.logsumexp
exp = mx.exp
log = mx.log
maximum = mx.maximum
random_key = mx.random.key
random_split = mx.random.split
categorical = mx.random.categorical

# Names of the safetensors dtypes that mlx has (edge0.units holds the one table).
_DTYPES = {name: getattr(mx, name) for name, _ in SAFETENSORS_DTYPES.values() if hasattr(mx, name)}
ST_DTYPES = {label: name for label, (name, _) in SAFETENSORS_DTYPES.items()}


def dtype(name: str):
    """The backend dtype for a name like 'float32' (or the dtype itself)."""
    if not isinstance(name, str):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dt) -> str:
    return str(dt).split(".")[-1]


def array(x, dt=None) -> mx.array:
    return mx.array(x, dtype=dtype(dt) if dt is not None else None)


def from_raw(buf: np.ndarray, st_dtype: str, shape) -> mx.array:
    """Build a device array from raw little-endian bytes of safetensors dtype `st_dtype`."""
    name = ST_DTYPES[st_dtype]
    if name == "bfloat16":
        return mx.array(buf.view(np.uint16).reshape(shape)).view(mx.bfloat16)
    return mx.array(buf.view(np.dtype(name)).reshape(shape))


def writable_view(a: mx.array) -> np.ndarray | None:
    """A numpy view of evaluated array `a`'s own memory, for rewriting rows in place (CPU and
    unified memory), or None where there is none: a dtype numpy cannot view (bfloat16) or a
    backend that hands out a copy, which a probe write detects. A write through the view changes
    `a` under every graph that reads it, so it is only safe while no launched computation does."""
    mx.eval(a)
    try:
        view = np.asarray(memoryview(a))
    except (TypeError, ValueError, BufferError):
        return None
    if not view.flags.writeable or view.size == 0:
        return None
    flat = view.reshape(-1)
    old = flat[0].copy()
    flat[0] = old + 1
    seen = np.array(a.reshape(-1)[:1])[0]
    flat[0] = old
    return view if seen == old + 1 and np.array(a.reshape(-1)[:1])[0] == old else None


def to_numpy(a: mx.array) -> np.ndarray:
    """Copy an array to the host (a sync point)."""
    return np.array(a, copy=True)


def default_device() -> str:
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def pick_compute_dtype(requested: str | None, checkpoint_dtype: str) -> str:
    """Choose the compute dtype: `requested` if given, else float32 on CPU (quantized matmuls are
    9-30x slower in bf16/fp16 there, see docs/dtype.md) and the checkpoint's dtype on a GPU."""
    if requested not in (None, "auto"):
        dtype(requested)
        return requested
    return "float32" if default_device() == "cpu" else checkpoint_dtype


def active_memory() -> int:
    """Bytes the MLX allocator holds in live arrays."""
    return mx.get_active_memory()


def release_cached_memory() -> None:
    """Give the buffers MLX keeps for reuse back to the OS (after large arrays were dropped); with
    glibc also the free pages of the C heap, where freed buffers stay otherwise (measured: a
    further 30 MiB of 109 MiB freed, docs/server.md)."""
    mx.clear_cache()
    trim_heap()


def one_heap() -> bool:
    """Have glibc serve every thread from one heap (arena). By default each thread that allocates
    (the expert readers) gets its own, and each keeps what was freed in it to its own high-water
    mark: a batch of four on the quick bench model peaked at 290 MiB RSS instead of 260, at the
    same speed (docs/benchmarks.md). Skipped when the user tunes glibc's malloc themselves
    (MALLOC_ARENA_MAX, GLIBC_TUNABLES); True if set."""
    if _mallopt is None or "MALLOC_ARENA_MAX" in os.environ or "GLIBC_TUNABLES" in os.environ:
        return False
    return bool(_mallopt(M_ARENA_MAX, 1))


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc; elsewhere nothing): a large Python or
    tokenizer allocation that was freed stays in the heap otherwise."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def peak_memory() -> int:
    """MLX allocator peak in bytes since the last reset."""
    return mx.get_peak_memory()


def reset_peak_memory() -> None:
    mx.reset_peak_memory()


def peak_rss() -> int:
    """Process peak resident set size in bytes (Linux: VmHWM, which unlike ru_maxrss is not
    inherited from the parent across fork/exec)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def seed(s: int) -> None:
    mx.random.seed(s)
