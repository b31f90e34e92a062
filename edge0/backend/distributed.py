"""mx.distributed behind narrow functions: the group of ranks started by `mlx.launch` (ring
backend), point-to-point messages between pipeline stages, an all-gather of short byte strings,
and the pipeline setup of an mlx-lm model (which layers, embedding, norm and head a stage holds)."""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import stat
import threading
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.pipeline import PipelineMixin

from edge0.errors import Edge0Error

LAUNCH = "mlx.launch -n N --backend ring --hostfile HOSTS.json -- edge0 ..."


def launched() -> bool:
    """True in a process that mlx.launch started."""
    return "MLX_RANK" in os.environ


def _hosts() -> list:
    """The ring's addresses from the hostfile mlx.launch wrote ([] for a single process)."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return []
    try:
        text = open(path).read().strip()
        return json.loads(text) if text else []
    except (OSError, ValueError) as e:
        raise Edge0Error(
            f"MLX_HOSTFILE {path}: unreadable ring hostfile ({e}); start the ranks with {LAUNCH}"
        ) from None


def init_group(timeout: float):
    """The group of all ranks (ring backend; None when mlx.launch started only one), or an
    Edge0Error when the peers cannot be reached.

    MLX's ring set-up blocks in accept() with the GIL held, so a Python thread cannot time it
    out; SIGALRM interrupts the accept instead. A rank that connects rather than accepts gives up
    after MLX's own retries (about 31 s), whatever `timeout` says."""
    if not os.environ.get("MLX_HOSTFILE"):
        raise Edge0Error("edge0 runs across machines with MLX's ring backend only; start the ranks with " + LAUNCH)
    hosts = _hosts()
    if len(hosts) < 2:
        return None
    rank = int(os.environ["MLX_RANK"])
    if threading.current_thread() is not threading.main_thread():
        raise Edge0Error("a distributed engine is loaded from the main thread (its peer timeout uses SIGALRM)")
    t0 = time.monotonic()
    previous = signal.signal(signal.SIGALRM, lambda *_: None)  # the signal only interrupts accept()
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as e:
        peers = ", ".join(a for r, addrs in enumerate(hosts) if r != rank for a in addrs)
        raise Edge0Error(
            f"rank {rank} of {len(hosts)}: could not reach its peers at {peers} in "
            f"{time.monotonic() - t0:.0f} s ({e}); "
            f"start every rank ({LAUNCH}) and check the hostfile's addresses"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def ring_sockets() -> list[int]:
    """File descriptors of the ring's connections (TCP sockets to or from a hostfile address).
    MLX's ring receive busy-polls, a full core per waiting rank; a rank that expects a message
    blocks in select() on these first and then receives it (MLX still carries every byte)."""
    addrs = set()
    for rank in _hosts():
        for a in rank:
            ip, _, port = a.rpartition(":")
            addrs.add((ip, int(port)))
    fds = []
    for fd in range(3, min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 4096)):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as s:
                ends = {s.getsockname()[:2], s.getpeername()[:2]}
        except OSError:  # not open, or a socket that is not connected (the ring's listener)
            continue
        if ends & addrs:
            fds.append(fd)
    return fds


def wait_for_message(fds: list[int]) -> None:
    """Block (without using the CPU) until one of the ring's connections has data."""
    select.select(fds, [], [])


def all_gather_bytes(group, data: bytes) -> list[bytes]:
    """Every rank's `data` (all the same length), in rank order."""
    out = mx.distributed.all_gather(mx.array(np.frombuffer(data, dtype=np.uint8)), group=group)
    flat = bytes(np.array(deliver(out)))
    return [flat[i * len(data) : (i + 1) * len(data)] for i in range(group.size())]


def deliver(x):
    """Evaluate messages (sends, receives, collectives); a lost peer becomes an Edge0Error."""
    try:
        mx.eval(x)
    except RuntimeError as e:
        if "[ring]" in str(e):
            raise Edge0Error(
                f"lost a peer rank ({e}): another rank exited or its machine is unreachable; its own output says why"
            ) from None
        raise
    return x


def send(x, dst: int, group):
    """Send `x` to rank `dst` now (returns when it is handed to the transport)."""
    deliver(mx.distributed.send(x, dst, group=group))


def recv(shape, dtype: str, src: int, group):
    """Receive an array of `shape` and `dtype` from rank `src` (blocks until it arrives)."""
    return deliver(mx.distributed.recv(tuple(shape), getattr(mx, dtype), src, group=group))


def int_array(values) -> mx.array:
    return mx.array(np.asarray(values, dtype=np.int32))


# -- the pipeline setup of an mlx-lm model ---------------------------------------------------------
class _Ranks:
    """What PipelineMixin.pipeline reads from a group."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class StageEmbedding(nn.Module):
    """The embedding position of a pipeline stage. The first stage embeds token ids; the others
    return the hidden state `source(inputs)` from the previous stage. `as_linear` is the tied
    head on the last stage and passes the hidden state through elsewhere."""

    def __init__(self, embedding, embeds: bool, heads: bool, source):
        super().__init__()
        if embeds or heads:
            self.embedding = embedding
        object.__setattr__(self, "embeds", embeds)
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "source", source)

    def __call__(self, inputs):
        return self.embedding(inputs) if self.embeds else self.source(inputs)

    def as_linear(self, x):
        return self.embedding.as_linear(x) if self.heads else x


class PassThrough(nn.Module):
    """Stands in for the final norm and the head on a stage that is not the last: its output is
    the hidden state for the next stage."""

    def __call__(self, x):
        return x


def _pipeline_module(model) -> tuple[str, nn.Module]:
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, PipelineMixin)]
    if len(found) != 1 or not all(hasattr(found[0][1], a) for a in ("embed_tokens", "norm", "layers")):
        raise Edge0Error(
            f"model_type {getattr(model, 'model_type', '?')!r}: mlx-lm has no pipeline support for "
            "this family (no PipelineMixin model with embed_tokens, layers and norm); run it in one process"
        )
    return found[0]


def num_layers(model) -> int:
    """Decoder layers of a pipeline-capable mlx-lm model (an Edge0Error for other families):
    mlx-lm pipelines it, and every layer's cache is a KV cache whose offset says how many tokens
    it holds (what the stage exchange keeps in step across ranks)."""
    n = len(_pipeline_module(model)[1].layers)
    if not all(hasattr(c, "offset") for c in make_prompt_cache(model)):
        raise Edge0Error(
            f"model_type {getattr(model, 'model_type', '?')!r}: some layers keep state other than a KV "
            "cache (linear attention), which the stage exchange does not keep in step across ranks; "
            "run it in one process"
        )
    return n


def _ends(model):
    """(the PipelineMixin module, the module that holds lm_head, their parameter-name prefixes,
    whether the head is tied to the embedding)."""
    path, inner = _pipeline_module(model)
    parent = path.rpartition(".")[0]
    owner = dict(model.named_modules())[parent] if parent else model
    return inner, owner, (f"{path}." if path else ""), (f"{parent}." if parent else ""), "lm_head" not in owner


def keep_stage_layers(model, rank: int, size: int, split: list[int], first: bool, last: bool) -> set[str]:
    """Keep the layers of `rank` with mlx-lm's PipelineMixin bookkeeping (rank 0 runs the last
    `split[0]` layers; a family's own adjustments run too), with mlx-lm's exchange off: the stage
    exchange replaces it. Returns the parameter-name prefixes of the ends this stage does not
    hold (embedding, final norm, head), whose weights are not loaded."""
    inner, _, pre, head_pre, tied = _ends(model)
    inner.pipeline(_Ranks(rank, size), split)
    inner.pipeline_rank, inner.pipeline_size = 0, 1
    skip = set()
    if not first and not (last and tied):
        skip.add(f"{pre}embed_tokens.")
    if not last:
        skip.add(f"{pre}norm.")
        if not tied:
            skip.add(f"{head_pre}lm_head.")
    return skip


def replace_stage_ends(model, first: bool, last: bool) -> None:
    """After loading: give the stage its StageEmbedding (taking the hidden state as the model's
    input until `set_stage_source`), and a PassThrough for the final norm and head unless it is
    the last stage."""
    inner, owner, _, _, tied = _ends(model)
    inner.embed_tokens = StageEmbedding(inner.embed_tokens, first, last and tied, lambda h: h)
    if not last:
        inner.norm = PassThrough()
        if not tied:
            owner.lm_head = PassThrough()


def set_stage_source(model, source) -> None:
    """Where a stage that does not embed gets its hidden state: `source(inputs)`, called when the
    model runs (rank 0 receives it from the previous stage there)."""
    object.__setattr__(_pipeline_module(model)[1].embed_tokens, "source", source)
