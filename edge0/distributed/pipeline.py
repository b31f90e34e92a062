"""The stage exchange: how rank 0 drives the other ranks, and what travels between stages.

Every message goes to the rank's left neighbour in the ring (rank r -> r-1, rank 0 -> N-1), the
direction the hidden state flows, since rank 0 runs the last layers:

    rank 0 --header + token ids--> rank N-1 --header + hidden--> ... rank 1 --header + hidden--> rank 0

Each op is one trip around the ring, started by rank 0 and ending back at it:

- FORWARD (a prefill chunk, step -1, or a decode step >= 0; one row or a batch's rows): the first
  stage embeds the token ids, every stage runs its layers on the hidden state it received and
  sends the result on; rank 0 finishes the token with its layers and the head, and samples. The
  header names the prompt cache the forward runs on (each rank holds its layers' share of every
  prompt cache of rank 0, mirror.py) and the step number, so every stage runs the same StepHooks
  at the same points (the pre-router's stager reads and swaps experts as it does in one process;
  a batch's step also carries which row each row was, and which rows end; a prefill while rows
  decode says so, and no stage then seeds its decode slots from it).
  Pre-router heads whose consumer layer is on a later stage send their logits with the hidden
  state; the consumer's stage routes them (with its own router bias) before its layers run.
- START / FINISH: a generation begins / ends (hooks.start / hooks.finish on every stage); FINISH
  collects every rank's statistics.
- RESTORE: rank 0 restored a prompt cache from its disk tier; each other rank restores its share
  of the same file (mirror.py) and the answers come back.
- STOP: rank 0 is closing; the others return from `follow`.

Any message may carry the prompt-cache ops rank 0 did since its last one (mirror.py), which every
other rank applies, in order, before it acts on the message.

Only rank 0 samples: the sampled token reaches the first stage as the next FORWARD's token ids,
which is the only place it is needed.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from contextlib import contextmanager

import numpy as np

from edge0.backend import core as B
from edge0.backend import distributed as bdist
from edge0.backend import kvcache as bkv
from edge0.backend import stages as bstages
from edge0.distributed.leader import LeaderHooks
from edge0.distributed.mirror import Journal, Replica, held_tokens
from edge0.distributed.stats import merged_stats, rank_stats
from edge0.engine.parts import Parts
from edge0.errors import Edge0Error, PeerLost

FORWARD, START, FINISH, STOP, RESTORE = 1, 2, 3, 4, 5
OPS = {FORWARD: "forward", START: "start", FINISH: "finish", STOP: "stop", RESTORE: "restore"}
# header fields (int32)
OP, TOKENS, HIDDEN, OFFSET, STEP, N_PRED, EXPERTS, PAYLOAD, SEQ, ROWS, CACHE, OPS_BYTES = range(12)
HEADER = 12


class Pipeline:
    """One rank's end of the stage exchange (`engine.pipeline`): it runs the engine's `parts`;
    `layer_stats()` is the engine's stats (a follower reports its layers' rows to rank 0)."""

    def __init__(self, group, stage, parts: Parts, layer_stats, peer_timeout: float = 60.0):
        self.group, self.stage, self.parts, self.layer_stats = group, stage, parts, layer_stats
        self.to = (stage.rank - 1) % stage.size  # where this rank's messages go
        self.frm = (stage.rank + 1) % stage.size  # where they come from
        self.dtype = parts.compute_dtype
        self.outgoing = dict  # fn() -> {consumer layer: head logits [1, 1, E]}, set by the pre-router
        self.incoming = None  # fn(consumer layer, head logits), set by the pre-router
        self.generating = False
        self.closed = False
        self.lost: PeerLost | None = None  # an exchange failed (a lost peer): nothing more is sent
        self.lock = threading.Lock()  # rank 0: one op at a time (the server's engine thread, shutdown)
        self.step = -1  # rank 0: the step whose forward runs next (-1: a prefill chunk)
        self.seq = 0
        self.send_s = self.wait_s = 0.0
        self.compute_s = 0.0  # decode steps: input received -> output sent (rank 0: -> token sampled)
        self.received_at = 0.0
        self.bytes_sent = 0
        self.forwards = 0
        self.ranks: list[dict] = []  # rank 0: the other ranks' statistics, from the last FINISH
        self.journal = Journal() if self.leads else None  # rank 0: its prompt caches' ops, for the others
        self.replica = None if self.leads else Replica(parts.kv, stage.rank)  # the others: their share of them
        self.cache = None  # rank 0: the prompt cache of the forward running now (watch_forwards)
        # rank 0: this step's rows and which of them end (StepHooks.rows, last_step), for the others' hooks
        self.previous, self.last, self.ending = None, False, None
        # rank 0: a verify's kept position (StepHooks.kept), for the others' hooks with the next message
        self.kept: list[int] | None = None
        # the others: bytes of their share of rank 0's prompt caches they want freed (their memory
        # watcher), told with the next FINISH; rank 0: what it will free before the next generation
        self.free_wanted = 0
        self.freed_for_others = 0  # rank 0: bytes of its pool freed at the other ranks' request
        self.between: deque = deque()  # the others: work for their own thread between generations (run_between)
        # what every rank's share of a prompt cache allows together (setup.cache_traits, at join)
        self.traits = {"rewind_problem": None, "replays": False, "drop_tails": True}
        # where a rank waits for the next message without spinning (see bdist.ring_sockets); none
        # found means MLX's spinning receive, reported in the stats
        self.sockets = bdist.ring_sockets()
        self.keepalive = bdist.keep_alive(self.sockets, peer_timeout)  # a silent peer machine fails the wait
        # a peer process stopped or stuck (its machine still up) fails the wait too
        self.heartbeat, self.heartbeat_note = None, "off: no ring connections found to wait on"
        if self.sockets:
            try:
                self.heartbeat, self.heartbeat_note = bdist.Heartbeat(peer_timeout), "on"
            except OSError as e:
                self.heartbeat_note = f"off ({e}): a stopped or stuck peer is not detected"

    @property
    def leads(self) -> bool:
        """Rank 0: generates; the other ranks follow."""
        return self.stage.last

    # -- messages --------------------------------------------------------------------------------
    def _send(self, x) -> None:
        t0 = time.perf_counter()
        try:
            bdist.send(x, self.to, self.group)
        except Edge0Error as e:
            raise self._lost(e) from None
        self.send_s += time.perf_counter() - t0
        self.bytes_sent += x.nbytes

    def _send_header(
        self,
        op: int,
        tokens: int = 0,
        hidden: int = 0,
        offset: int = 0,
        step: int = -1,
        n_pred: int = 0,
        experts: int = 0,
        payload: int = 0,
        rows: int = 1,
        cache: int = 0,
        blob: bytes = b"",
    ) -> None:
        """A header, then `blob` (the JSON of prompt-cache ops and step details, mirror.py) if any."""
        fields = [op, tokens, hidden, offset, step, n_pred, experts, payload, self.seq, rows, cache, len(blob)]
        self._send(bdist.int_array(fields))
        if blob:
            self._send(B.array(np.frombuffer(blob, dtype=np.uint8)))

    def _blob(self, step: dict | None = None, restore: dict | None = None) -> bytes:
        """Rank 0: the prompt-cache ops since the last message, `step`'s details and a RESTORE's
        request, as JSON."""
        ops, kept, self.kept = self.journal.take(), self.kept, None
        if not ops and step is None and kept is None and restore is None:
            return b""
        return json.dumps({"ops": ops, "step": step, "kept": kept, "restore": restore}).encode()

    def _recv_blob(self, h: list[int]) -> bytes:
        if not h[OPS_BYTES]:
            return b""
        return bytes(B.to_numpy(self._recv((h[OPS_BYTES],), "uint8")))

    def _recv(self, shape, dtype: str):
        try:
            if self.sockets:  # every piece: a peer stopped between a header and its payload is found too
                bdist.wait_for_message(self.sockets, self.heartbeat)
            return bdist.recv(shape, dtype, self.frm, self.group)
        except Edge0Error as e:
            raise self._lost(e) from None

    def _lost(self, error: Edge0Error) -> PeerLost:
        """A failed exchange (a lost peer): nothing more is sent; the error names this rank."""
        if self.lost is None:
            self.lost = PeerLost(f"rank {self.stage.rank} of {self.stage.size}: {error}")
        return PeerLost(str(self.lost))

    def _recv_header(self) -> list[int]:
        """The next op's header; its payload follows at once, but the header itself may be a
        token's whole trip (or an idle server's pause) away: `_recv` waits for it without spinning."""
        return B.to_numpy(self._recv((HEADER,), "int32")).tolist()

    def _send_predictions(self, preds: dict) -> None:
        """Head logits by consumer layer, each [rows, T, E] as the forward's tokens are."""
        if preds:
            layers = sorted(preds)
            self._send(bdist.int_array(layers))
            self._send(B.stack([preds[l].astype(B.float32) for l in layers]))

    def _recv_predictions(self, h: list[int]) -> dict:
        if not h[N_PRED]:
            return {}
        layers = B.to_numpy(self._recv((h[N_PRED],), "int32")).tolist()
        logits = self._recv((h[N_PRED], h[ROWS], h[TOKENS], h[EXPERTS]), "float32")
        return {l: logits[i] for i, l in enumerate(layers)}

    def _route_predictions(self, preds: dict) -> dict:
        """Hand this stage's consumers their predictions; the rest travel on."""
        here = {l: p for l, p in preds.items() if self.stage.holds(l)}
        for layer, logits in here.items():
            self.incoming(layer, logits)
        return {l: p for l, p in preds.items() if l not in here}

    def _expect(self, h: list[int], op: int) -> None:
        if h[OP] != op or h[SEQ] != self.seq:
            raise Edge0Error(
                f"rank {self.stage.rank}: the stage exchange is out of step (expected {OPS[op]} #{self.seq}, "
                f"got {OPS.get(h[OP], h[OP])} #{h[SEQ]}); restart every rank"
            )

    # -- rank 0 --------------------------------------------------------------------------------
    def source(self, inputs):
        """Rank 0's hidden state for a forward of token ids `inputs` [B, T] on the prompt cache
        `watch_forwards` saw: the ids go to the first stage, the hidden state comes back from
        rank 1 (StageEmbedding calls this)."""
        if not self.generating:
            raise Edge0Error(
                "a distributed engine runs generations only (generate, stream_generate, chat, "
                "decode_logits); logits, prerouted_logits and traces run in one process"
            )
        rows, t = int(inputs.shape[0]), int(inputs.shape[-1])
        name = self.journal.name(self.cache)
        step = None
        if self.step >= 0:
            step = {"previous": self.previous, "last": self.last, "ending": self.ending}
        elif not self.parts.streaming.seeding:  # a prefill while rows decode: no stage seeds its slots
            step = {"seed": False}
        with self._op():
            self._send_header(
                FORWARD,
                tokens=t,
                offset=held_tokens(self.cache),
                step=self.step,
                rows=rows,
                cache=name,
                blob=self._blob(step),
            )
            self._send(inputs.reshape(-1).astype(B.dtype("int32")))
            t0 = time.perf_counter()
            h = self._recv_header()
            self._expect(h, FORWARD)
            preds = self._recv_predictions(h)
            hidden = self._recv((rows, t, h[HIDDEN]), self.dtype)
            self.received_at = time.perf_counter()
            self.wait_s += self.received_at - t0
        self.forwards += 1
        self._route_predictions(preds)
        return hidden

    def _seen(self, cache) -> None:
        """Rank 0: the prompt cache of the forward about to run (its StageEmbedding asks `source`)."""
        self.cache = cache

    @contextmanager
    def _op(self):
        """One op of rank 0's, numbered, while no other op is in flight."""
        with self.lock:
            if self.closed:
                raise Edge0Error("the ranks' pipeline is closed")
            if self.lost is not None:  # the same line however many ops find the pipeline broken
                raise PeerLost(str(self.lost))
            self.seq += 1
            yield

    def _round_trip(self, op: int, restore: dict | None = None) -> list:
        """Send `op` around the ring and wait for it to come back (with the ranks' statistics
        for FINISH, their answers for RESTORE)."""
        with self._op():
            self._send_header(op, blob=self._blob(restore=restore))
            h = self._recv_header()
            self._expect(h, op)
            if not h[PAYLOAD]:
                return []
            return json.loads(bytes(B.to_numpy(self._recv((h[PAYLOAD],), "uint8"))))

    def start(self) -> None:
        if self.free_wanted:  # between generations: the pool gives way for another rank's memory
            self.freed_for_others += self.parts.kv.evict(self.free_wanted)
            self.free_wanted = 0
        self._round_trip(START)
        self.generating = True

    def ask_to_free(self, nbytes: int) -> None:
        """A rank other than 0, low on memory: rank 0 is to free `nbytes` of this rank's share of
        its prompt caches (the least recently used conversations leave every rank)."""
        self.free_wanted = max(self.free_wanted, int(nbytes))

    def _free_for(self, ranks: list[dict]) -> None:
        """Rank 0, after FINISH: the bytes of its own pool that free what the other ranks asked
        for, each rank's share scaled to rank 0's by their sizes."""
        mine = self.parts.kv.pool.bytes
        for r in ranks:
            want, share = r.get("kv_free_wanted", 0), r.get("kv_share_bytes", 0)
            if want and share:
                self.free_wanted = max(self.free_wanted, -(-want * mine // share))

    def saved(self, cache, tokens: list[int], namespace: str, prompt_end: int) -> None:
        """Rank 0 saves `cache` to its disk tier: the others save their share of it (with the next
        message, before they act on it)."""
        self.journal.saved(cache, tokens, namespace, prompt_end)

    def restore_shares(self, cache, namespace: str, tokens: list[int], n: int) -> list[str]:
        """Rank 0 restored `cache` from the file of `tokens` in `namespace`, cut to `n` tokens: each
        other rank restores its share of that file as the same cache; their answers ("rank R: ok",
        "... missing", "... declined": mirror.Replica.restore)."""
        request = {"name": self.journal.name(cache), "namespace": namespace, "tokens": list(tokens), "n": int(n)}
        return self._round_trip(RESTORE, restore=request)

    def finish(self) -> None:
        self.generating = False
        self.ranks = self._round_trip(FINISH)
        self._free_for(self.ranks)

    def close(self) -> None:
        """Rank 0: release the other ranks (they return from `follow`). A rank that is gone needs
        no release (it reported why itself, and the others stop on the lost peer), so losing one
        here is not an error: close runs while a Ctrl-C or another error unwinds."""
        try:
            if self.leads and not self.closed and self.lost is None:
                self._round_trip(STOP)
                self.closed = True
        except Edge0Error:
            pass
        finally:
            if self.heartbeat is not None:  # its port is free for the next engine of this process
                self.heartbeat.stop()
                self.heartbeat = None

    def lead(self) -> None:
        """Rank 0: wrap the stepper's hooks so that generations start, step and end on every rank,
        and take the hidden state from the exchange."""
        if not bkv.counts_tokens(self.parts.kv.make()):  # what each forward's header tells the others
            raise Edge0Error(
                f"rank 0 of {self.stage.size}: its layers ({self.stage.describe()}) keep only recurrent state "
                "(linear attention or SSM), no cache that counts the tokens the ranks keep in step; give rank 0 "
                "an attention layer with --pipeline-split"
            )
        stepper = self.parts.stepper
        stepper.hooks = LeaderHooks(stepper.hooks, self)
        stepper.replays = self.traits["replays"]  # as one process of every rank's layers would
        self.parts.kv.ranks = self  # the disk tier's saves and restores reach the other ranks
        bstages.set_stage_source(self.parts.model, self.source)
        bstages.watch_forwards(self.parts.model, self._seen)
        bkv.watch(self.journal)

    # -- every rank ------------------------------------------------------------------------------
    def own_stats(self) -> dict:
        """This rank's summary (rank 0's FINISH gathers everyone's)."""
        return rank_stats(self)

    def merge_stats(self, out: dict) -> dict:
        """Rank 0's Engine.stats() with every rank (distributed/stats.py)."""
        return merged_stats(self, out)

    # -- the other ranks -------------------------------------------------------------------------
    def run_between(self, fn) -> None:
        """A rank other than 0: run `fn()` on the thread that follows, when a generation starts or
        ends (a memory watcher's resize of this rank's own expert cache; server/memory.py)."""
        self.between.append(fn)

    def follow(self) -> None:
        """Run the ops rank 0 sends until it closes the pipeline."""
        hooks = self.parts.stepper.hooks
        while True:
            t0 = time.perf_counter()
            h = self._recv_header()
            self.seq = h[SEQ]
            op = h[OP]
            blob = self._recv_blob(h)
            detail = json.loads(blob) if blob else {}
            self.replica.apply(detail.get("ops", []))
            if detail.get("kept") is not None:  # the verify before this message kept its inputs up to there
                self.parts.stepper.kept_after(*detail["kept"])
            on = blob if self.to != 0 else b""  # the next rank needs them too, unless it is rank 0
            while op in (START, FINISH) and self.between:  # nothing of a generation in flight here
                self.between.popleft()()
            if op == FORWARD:
                self.wait_s += time.perf_counter() - t0
                self._forward(h, detail.get("step"), on)
            elif op == START:
                hooks.start()
                B.reset_peak_memory()
                self._send_header(START, blob=on)
            elif op == FINISH:
                hooks.finish()
                ranks = json.loads(bytes(B.to_numpy(self._recv((h[PAYLOAD],), "uint8")))) if h[PAYLOAD] else []
                stats = json.dumps(ranks + [self.own_stats()]).encode()
                self.free_wanted = 0  # told rank 0
                self._send_header(FINISH, payload=len(stats), blob=on)
                self._send(B.array(np.frombuffer(stats, dtype=np.uint8)))
            elif op == RESTORE:
                answers = json.loads(bytes(B.to_numpy(self._recv((h[PAYLOAD],), "uint8")))) if h[PAYLOAD] else []
                payload = json.dumps(answers + [self.replica.restore(**detail["restore"])]).encode()
                self._send_header(RESTORE, payload=len(payload), blob=on)
                self._send(B.array(np.frombuffer(payload, dtype=np.uint8)))
            elif op == STOP:
                self._send_header(STOP, blob=on)
                self.closed = True
                return
            else:
                raise Edge0Error(f"rank {self.stage.rank}: unknown op {op} from rank {self.frm}; restart every rank")

    def _forward(self, h: list[int], step_detail: dict | None, on: bytes) -> None:
        """One FORWARD on a follower: the same step as rank 0's (edge0/engine/step.py), on this
        rank's share of the prompt cache rank 0's forward runs on."""
        model, step, t, rows = self.parts.model, h[STEP], h[TOKENS], h[ROWS]
        t0 = time.perf_counter()
        if self.stage.first:
            preds = {}
            x = self._recv((rows, t), "int32")
        else:
            preds = self._recv_predictions(h)
            x = self._recv((rows, t, h[HIDDEN]), self.dtype)
        received = time.perf_counter()
        self.wait_s += received - t0
        self.forwards += 1
        cache = self.replica.get(h[CACHE])
        held = held_tokens(cache)
        if h[OFFSET] >= 0 and held >= 0 and held != h[OFFSET]:
            raise Edge0Error(
                f"this stage's KV cache holds {held} tokens, rank 0's {h[OFFSET]}: the ranks are out of step; "
                "restart every rank"
            )
        routed = {}

        def forward():
            routed.update(self._route_predictions(preds))
            out = bstages.stage_output(model, model(x, cache=cache))
            routed.update(self.outgoing())
            return out

        def send(out):
            if step >= 0:
                self.compute_s += time.perf_counter() - received
            self._send_header(
                FORWARD,
                tokens=t,
                hidden=int(out.shape[-1]),
                offset=h[OFFSET],
                step=step,
                n_pred=len(routed),
                experts=int(next(iter(routed.values())).shape[-1]) if routed else 0,
                rows=rows,
                cache=h[CACHE],
                blob=on,
            )
            self._send_predictions(routed)
            self._send(out)

        if step >= 0:  # the same step as rank 0's (edge0/engine/step.py)
            detail = step_detail or {}
            ending = detail.get("ending")
            self.parts.stepper.follow(
                step,
                rows * t,
                forward,
                send,
                cache,
                per_row=t if rows > 1 else 0,
                previous=detail.get("previous"),
                last=detail.get("last", False),
                ending=ending or (),
            )
            return
        # a prefill span or chunk: not a step, no hooks; layer by layer where this stage can
        self.parts.streaming.seeding = (step_detail or {}).get("seed", True)  # as rank 0's (Streaming.seeding)
        prefiller = self.parts.prefiller
        if prefiller.layerwise:
            routed.update(self._route_predictions(preds))
            out = prefiller.stage_span(x, cache)
        else:
            out = forward()
        B.eval(out, [c.state for c in cache])
        send(out)
