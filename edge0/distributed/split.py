"""Which layers each rank runs.

The decoder layers are cut into contiguous stages in layer order. As in mlx-lm's PipelineMixin,
rank 0 runs the *last* stage (it holds the final norm and the head, samples and returns text)
and rank N-1 the first (it holds the embedding); a split is written per rank, rank 0 first. By
default the cut balances bytes: each stage's layers' resident weights plus their routed experts
(plus the embedding on the first stage, the norm and head on the last) are made as equal as
possible, so that with the same --expert-cache on every rank each caches about the same share of
its experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from edge0.errors import Edge0Error
from edge0.store.headers import read_header

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Stage:
    """One rank's place in the pipeline."""

    rank: int
    size: int
    split: tuple[int, ...]  # layers per rank, rank 0 first
    moe_layers: tuple[int, ...]  # every MoE layer of the store, on any rank

    @property
    def start(self) -> int:
        return sum(self.split[self.rank + 1 :])

    @property
    def end(self) -> int:
        return self.start + self.split[self.rank]

    @property
    def first(self) -> bool:
        """Runs the first layers (embeds the tokens)."""
        return self.rank == self.size - 1

    @property
    def last(self) -> bool:
        """Runs the last layers and the head (rank 0: samples and returns text)."""
        return self.rank == 0

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def restrict(self, manifest: dict) -> dict:
        """`manifest` with only this stage's MoE layers: its ExpertStore opens only their files."""
        return {**manifest, "expert_layers": [l for l in manifest["expert_layers"] if self.holds(int(l["layer"]))]}

    def describe(self) -> str:
        ends = [e for e, held in (("embedding", self.first), ("norm and head", self.last)) if held]
        return (
            f"rank {self.rank} of {self.size}: layers {self.start}-{self.end - 1}"
            f"{' + ' + ' + '.join(ends) if ends else ''}"
        )


def _starts(groups: tuple[int, ...] | None, num_layers: int) -> set[int]:
    """The layers a stage may start at: the first of each group (every layer without groups)."""
    if groups is None:
        return set(range(num_layers + 1))
    starts, at = {0}, 0
    for g in groups:
        at += g
        starts.add(at)
    return starts


def _runs(groups: tuple[int, ...]) -> str:
    """The groups of more than one layer, as 'a-b' ranges."""
    out, at = [], 0
    for g in groups:
        if g > 1:
            out.append(f"{at}-{at + g - 1}")
        at += g
    return ", ".join(out)


def check_split(split: tuple[int, ...], num_layers: int, ranks: int, groups: tuple[int, ...] | None = None) -> None:
    """A split must give every rank layers and cover every layer once, each of `groups` (runs of
    layers, in order, that share KV) whole on one stage."""
    given = ",".join(map(str, split))
    if len(split) != ranks:
        run = "this process runs alone" if ranks == 1 else f"{ranks} ranks were launched"
        raise Edge0Error(
            f"--pipeline-split {given}: {len(split)} counts, but {run}; give one count per rank "
            f"(start {len(split)} ranks with mlx.launch -n {len(split)}, or drop the flag)"
        )
    if sum(split) != num_layers:
        raise Edge0Error(
            f"--pipeline-split {given}: covers {sum(split)} layer{'s' if sum(split) > 1 else ''}, but the model has "
            f"{num_layers} "
            f"(layers 0-{num_layers - 1}); the counts (rank 0 first, rank 0 runs the last layers) "
            f"must sum to {num_layers}"
        )
    starts = _starts(groups, num_layers)
    at, cut = 0, []
    for n in reversed(split):  # the last rank runs the first stage
        at += n
        cut.append(at)
    bad = [c for c in cut if c not in starts]
    if bad:
        raise Edge0Error(
            f"--pipeline-split {given}: starts a stage at layer {bad[0]}, inside layers that share KV "
            f"({_runs(groups)}: a later layer attends with an earlier one's KV), which one stage must hold whole; "
            f"start stages only at layers {', '.join(map(str, sorted(starts - {0, num_layers})))}"
        )


def balanced_split(
    costs: list[int], ranks: int, first_extra: int = 0, last_extra: int = 0, groups: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Contiguous stages minimising the largest stage's cost (per-layer `costs`, plus
    `first_extra` on the first stage and `last_extra` on the last), as layers per rank, rank 0
    (the last stage) first; each of `groups` (runs of layers, in order) whole on one stage."""
    if groups is not None:  # plan over the groups, then count their layers
        bounds = [0]
        for g in groups:
            bounds.append(bounds[-1] + g)
        if ranks > len(groups):
            raise Edge0Error(
                f"{ranks} ranks for a model of {len(costs)} layers where layers {_runs(groups)} share KV (a later "
                f"layer attends with an earlier one's KV) and stay on one stage: {len(groups)} runs of layers to "
                f"give out; launch at most {len(groups)} ranks"
            )
        summed = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        per = balanced_split(summed, ranks, first_extra, last_extra)
        out, at = [], len(groups)
        for n in per:  # rank 0 (the last groups) first
            out.append(sum(groups[at - n : at]))
            at -= n
        return tuple(out)
    n = len(costs)
    if ranks > n:
        raise Edge0Error(
            f"{ranks} ranks for a model of {n} layers: every rank needs at least one layer; launch at most {n} ranks"
        )
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (first_extra if stage == 0 else 0) + (last_extra if stage == ranks - 1 else 0)

    # best[s][i]: the least possible largest cost of stages 0..s covering layers [0, i)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(ranks)]
    cut = [[0] * (n + 1) for _ in range(ranks)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for s in range(1, ranks):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                v = max(best[s - 1][j], cost(s, j, i))
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    bounds, i = [n], n
    for s in range(ranks - 1, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.append(0)
    stages = [bounds[k] - bounds[k + 1] for k in range(ranks)]  # last stage first = rank 0 first
    return tuple(stages)


def layer_costs(root: Path, resident_file: str, manifest: dict, num_layers: int) -> tuple[list[int], int, int]:
    """(bytes of each layer: resident weights + routed experts; embedding bytes; final norm and
    head bytes, the embedding's when the head is tied), from the resident file's header."""
    sizes = read_header(root / resident_file).nbytes()
    costs = [0] * num_layers
    embed = head = 0
    for name, n in sizes.items():
        m = LAYER.search(name)
        if m:
            costs[int(m.group(1))] += n
        elif "embed_tokens" in name:
            embed += n
        else:
            head += n
    if not any(name.startswith("lm_head") or ".lm_head." in name for name in sizes):
        head += embed
    for layer in manifest["expert_layers"]:
        costs[int(layer["layer"])] += sum(t["expert_nbytes"] for t in layer["tensors"].values()) * int(
            layer["num_experts"]
        )
    return costs, embed, head


def plan_split(
    root: Path,
    resident_file: str,
    manifest: dict,
    num_layers: int,
    ranks: int,
    explicit,
    groups: tuple[int, ...] | None = None,
) -> tuple[int, ...]:
    """The split to run: `explicit` (validated LoadOptions.pipeline_split, checked against the
    model here), or the byte-balanced one; each of `groups` (layers that share KV) on one stage."""
    if explicit is not None:
        split = tuple(explicit)
        check_split(split, num_layers, ranks, groups)
        return split
    costs, embed, head = layer_costs(root, resident_file, manifest, num_layers)
    return balanced_split(costs, ranks, embed, head, groups)
