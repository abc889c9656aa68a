"""The sets of candidate pipelines of the fleet planner (fleet.py, part 2 of its search).

Sets of candidates within the pools' GPU counts (at most M pipelines: each needs a
micro-batch). Starts: for the candidates on each class of links (pools with at most a given
latency and at least a given bandwidth; the sync is paced by the slowest link, so a good set
often leaves a class out) a greedy that adds the candidate giving the best step and a fill
that adds candidates fastest-per-GPU first; a fill that starts with as many copies of each
candidate as fit; every prefix priced. Then local moves (add, drop or swap a pipeline, drop
every pipeline on a pool) while the step improves. Then a depth-first branch and bound over
every multiset of candidates (fastest per GPU first) bounds a set and everything that extends
it by its sync (which only grows as pipelines are added) plus ``(M + fill) / rate``: a valid
set's slowest pipeline takes at least ``(M + sum(f / b)) / sum(1 / b)``, each pipeline's
step of m micro-batches played out being at least its lane's line ``f + m * b`` (b its beat:
`shares.Lane`), and the GPUs left add at most their pool's best gain per GPU
(:meth:`Combiner._gains`). A set's step is its slowest pipeline's, played out for its share
of the micro-batches (`shares.split_fast`, exact), plus its sync. When it finishes within
``SET_BUDGET`` sets looked at, the choice is exact over the candidates ("exhaustive");
otherwise it is the best found ("heuristic").
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from relaytrain_operator.domain.planner.cost import Collective
from relaytrain_operator.domain.planner.fleet_candidates import Pipe
from relaytrain_operator.domain.planner.shares import slowest_seconds, split_fast
from relaytrain_operator.domain.planner.sync import Sync, fold_rounds, sync_seconds, top_two

#: Sets of pipelines the branch and bound may look at before it stops ("heuristic").
SET_BUDGET = 2_000


class Combiner:
    """Chooses the set of candidate pipelines with the smallest step (see the module doc)."""

    def __init__(
        self,
        pipes: Sequence[Pipe],
        gpus: Sequence[int],
        links: Sequence[tuple[float, float]],
        *,
        micro_batches: int,
        sync: Sync,
        collective: Collective = "all-gather",
        adapters: bool = False,
        replicas: int | None = None,
        budget: int = SET_BUDGET,
    ) -> None:
        # Fastest per GPU first: good sets are found early and bound the rest.
        self.pipes = sorted(pipes, key=lambda p: (-p.rate / p.stages, p.stages, p.counts))
        self.gpus = tuple(gpus)
        self.links = tuple(links)
        """Per pool: (one-way latency s, bandwidth B/s) of its links."""
        self.m = micro_batches
        self.sync = sync
        self.collective = collective
        self.adapters = adapters
        """Whether the gradients are adapters' (added in micro-batch order: `sync.fold_rounds`)."""
        self.replicas = replicas
        self.limit = min(replicas or micro_batches, micro_batches)
        self.budget = budget
        self.evaluated = 0
        """Sets priced so far."""
        self._gains_for: float | None = None
        self._gain: list[float] = []
        self.best: tuple[float, int, int] | None = None
        self.best_set: list[Pipe] | None = None

    def sync_seconds(self, chosen: Sequence[Pipe], shares: Sequence[int] | None = None) -> float:
        """Sync per step of a set of pipelines given ``shares`` (None: a lower bound for any
        shares)."""
        if len(chosen) < 2:
            return 0.0
        load = max(p.load for p in chosen)
        hop = top_two([p.latency for p in chosen])
        rounds = (
            0 if shares is None else fold_rounds(self.sync, self.collective, self.adapters, shares)
        )
        return self._sync_seconds(len(chosen), load, hop, rounds)

    def _sync_seconds(self, pipelines: int, load: float, hop: float, rounds: int = 0) -> float:
        moved, latency = sync_seconds(
            self.sync, self.collective, pipelines, load, hop, rounds=rounds
        )
        return (moved + latency) / self.sync.every

    def value(self, chosen: Sequence[Pipe]) -> float | None:
        """Step time of a set; None when a pipeline would get no micro-batch (a subset wins)."""
        self.evaluated += 1
        lanes = [p.lane for p in chosen]
        shares = split_fast(lanes, self.m)
        if min(shares) == 0:
            return None
        return slowest_seconds(lanes, shares) + self.sync_seconds(chosen, shares)

    def _wanted(self, size: int) -> bool:
        return size >= 2 and (self.replicas is None or size == self.replicas)

    def _offer(self, chosen: Sequence[Pipe], value: float | None) -> bool:
        """Keep ``chosen`` if it is the best so far; whether it was."""
        if value is None or not self._wanted(len(chosen)):
            return False
        key = (value, len(chosen), sum(p.stages for p in chosen))
        if self.best is None or _better(key, self.best):
            self.best, self.best_set = key, list(chosen)
            return True
        return False

    @staticmethod
    def _fits(p: Pipe, left: Sequence[int]) -> bool:
        return all(c <= x for c, x in zip(p.counts, left, strict=True))

    def _left(self, chosen: Sequence[Pipe]) -> list[int]:
        left = list(self.gpus)
        for p in chosen:
            left = [x - c for x, c in zip(left, p.counts, strict=True)]
        return left

    def most_pipelines(self) -> int:
        """How many candidates fit side by side (greedily, shortest first)."""
        left, n = list(self.gpus), 0
        for p in sorted(self.pipes, key=lambda p: (p.stages, p.counts)):
            while self._fits(p, left):
                left = [x - c for x, c in zip(left, p.counts, strict=True)]
                n += 1
        return n

    def classes(self) -> list[list[Pipe]]:
        """The candidates, and those on the pools whose links are at least so good: for each
        latency and bandwidth among the pools, the pipelines on pools with no more latency and
        no less bandwidth. The sync is paced by the slowest link of a set, so a good set often
        leaves a whole class of pools out."""
        out: list[list[Pipe]] = []
        seen: set[tuple[int, ...]] = set()
        latencies = sorted({lat for lat, _ in self.links})
        floors = sorted({bw for _, bw in self.links})
        for latency, floor in itertools.product(latencies, floors):
            allowed = {
                i for i, (lat, bw) in enumerate(self.links) if lat <= latency and bw >= floor
            }
            key = tuple(sorted(allowed))
            if not allowed or key in seen:
                continue
            seen.add(key)
            out.append(
                [
                    p
                    for p in self.pipes
                    if all(n == 0 or i in allowed for i, n in enumerate(p.counts))
                ]
            )
        return out

    def greedy(self, pipes: Sequence[Pipe]) -> None:
        """Add the candidate that gives the best step, one at a time, while any fits."""
        chosen: list[Pipe] = []
        left = list(self.gpus)
        while len(chosen) < self.limit:
            options = [p for p in pipes if self._fits(p, left)]
            nothing = [0] * len(left)
            bounds = sorted((self._bound([*chosen, p], nothing), k) for k, p in enumerate(options))
            pick: tuple[float, Pipe] | None = None
            for bound, k in bounds:
                if pick is not None and bound >= pick[0]:
                    break
                value = self.value([*chosen, options[k]])
                if value is not None and (pick is None or value < pick[0]):
                    pick = (value, options[k])
            if pick is None:
                return
            chosen.append(pick[1])
            left = [x - c for x, c in zip(left, pick[1].counts, strict=True)]
            self._offer(chosen, pick[0])

    def fill(self, pipes: Sequence[Pipe], first: Pipe | None = None) -> None:
        """Add candidates fastest-per-GPU first (``first`` before them), each as often as it
        fits; every prefix is a set."""
        chosen: list[Pipe] = []
        left = list(self.gpus)
        for p in [first, *pipes] if first is not None else pipes:
            while len(chosen) < self.limit and self._fits(p, left):
                chosen.append(p)
                left = [x - c for x, c in zip(left, p.counts, strict=True)]
                self._offer(chosen, self.value(chosen))

    def improve(self) -> None:
        """From the best set: add a pipeline, drop one, swap one for another, or drop every
        pipeline on a pool, while the step improves (first improvement; at most ``budget``
        sets)."""
        start = self.evaluated
        improved = True
        while improved and self.best_set is not None and self.evaluated - start < self.budget:
            improved = False
            current = self.best_set
            left = self._left(current)
            kinds = list(dict.fromkeys(current))
            moves: list[list[Pipe]] = [[*current, p] for p in self.pipes if self._fits(p, left)]
            for out in kinds:
                rest = list(current)
                rest.remove(out)
                freed = [x + c for x, c in zip(left, out.counts, strict=True)]
                moves.append(rest)
                moves += [[*rest, p] for p in self.pipes if p != out and self._fits(p, freed)]
            for i in range(len(self.gpus)):
                moves.append([p for p in current if not p.counts[i]])
            for move in moves:
                if len(move) <= self.limit and move and self._offer(move, self.value(move)):
                    improved = True
                    break

    def _gains(self) -> list[float]:
        """Per pool, the most any of its GPUs can add to a set that beats the best step B:
        max over candidates using the pool of (rate - fill / B) / stages, at least 0 (fill:
        its lane's fill in beats, `Lane.fill_beats`). A set S extended by X steps at least
        (M + fill) / rate over S and X (module doc); X beats B only if the sum over X of
        (rate - fill / B) exceeds what S lacks, and that sum is at most the GPUs left times
        these gains."""
        best = self.best[0] if self.best is not None else float("inf")
        if self._gains_for != best:
            self._gains_for = best
            self._gain = [
                max(
                    (
                        (p.rate - p.lane.fill_beats / best) / p.stages
                        for p in self.pipes
                        if p.counts[i]
                    ),
                    default=0.0,
                )
                for i in range(len(self.gpus))
            ]
            self._gain = [max(g, 0.0) for g in self._gain]
        return self._gain

    def _bound(self, chosen: Sequence[Pipe], left: Sequence[int]) -> float:
        """Lower bound on the step of ``chosen`` and of every set that extends it with the
        GPUs ``left`` while it could still beat the best (see :meth:`_gains`)."""
        rate = sum(p.rate for p in chosen)
        fill = sum(p.lane.fill_beats for p in chosen)
        if len(chosen) < self.limit:
            rate += sum(n * g for n, g in zip(left, self._gains(), strict=True))
        return self.sync_seconds(chosen) + (self.m + fill) / rate

    def search(self) -> bool:
        """Branch and bound over every multiset of candidates; False if it ran out of budget."""
        m, limit = self.m, self.limit
        visited = 0

        def visit(start: int, chosen: list[Pipe], left: list[int], agg: tuple[float, ...]) -> bool:
            nonlocal visited
            rate, fill, load, lat1, lat2 = agg
            for j in range(start, len(self.pipes)):
                p = self.pipes[j]
                if not self._fits(p, left):
                    continue
                visited += 1
                if visited > self.budget:
                    return False
                r = len(chosen) + 1
                rest = [x - c for x, c in zip(left, p.counts, strict=True)]
                g_rate, g_fill = rate + p.rate, fill + p.lane.fill_beats
                g_load = max(load, p.load)
                g_lat1, g_lat2 = (
                    (p.latency, lat1) if p.latency > lat1 else (lat1, max(lat2, p.latency))
                )
                sync = self._sync_seconds(r, g_load, g_lat1 + g_lat2)
                best = self.best[0] if self.best is not None else float("inf")
                more = 0.0
                if r < limit:
                    more = sum(n * g for n, g in zip(rest, self._gains(), strict=True))
                if sync + (m + g_fill) / (g_rate + more) >= best:
                    continue
                grown = [*chosen, p]
                if self._wanted(r) and sync + (m + g_fill) / g_rate < best:
                    self._offer(grown, self.value(grown))
                agg = (g_rate, g_fill, g_load, g_lat1, g_lat2)
                if r < limit and not visit(j, grown, rest, agg):
                    return False
            return True

        return visit(0, [], list(self.gpus), (0.0, 0.0, 0.0, 0.0, 0.0))

    def run(self, single_seconds: float | None) -> tuple[list[Pipe] | None, bool]:
        """The best set (empty: the single pipeline wins; None: nothing fits) and whether
        the search was exhaustive over the candidates."""
        if single_seconds is not None:
            self.best = (single_seconds, 1, 0)
        for pipes in self.classes():
            self.greedy(pipes)
            self.fill(pipes)
        for p in self.pipes:  # as many copies of one shape as fit, then the rest
            self.fill(self.pipes, first=p)
        self.improve()
        exact = self.search()
        if self.best_set is None:
            return ([] if single_seconds is not None else None), exact
        return self.best_set, exact


def _better(a: tuple[float, int, int], b: tuple[float, int, int]) -> bool:
    """Smaller step (beyond rounding), then fewer pipelines, then fewer GPUs."""
    if a[0] < b[0] * (1 - 1e-9):
        return True
    if a[0] > b[0] * (1 + 1e-9):
        return False
    return a[1:] < b[1:]
