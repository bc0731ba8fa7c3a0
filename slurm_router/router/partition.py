"""Speed-weighted cost partition: LPT, then a pairwise move/swap pass.

Goal: minimise the step time max_d load_d / speed_d. LPT (longest processing time first, each item to the
device that would finish it earliest) is within 4/3 of optimal and usually within a few percent; the
improvement pass then repeatedly takes the slowest device and moves one item to, or swaps one pair with, a
faster-finishing device when that lowers the slower of the two. With 8+ items per device this reaches the
1.02 target on long-tailed lengths; the pass stops early when the step time is already within 1% of the
best possible (mean load, or the pigeonhole lower bound on equal devices).

Pure Python on purpose: inputs are 10-10^4 items, where numpy's per-call overhead costs more than it saves.
Every tie breaks on the lower device index or the lower position, so the result depends only on the inputs.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from typing import Sequence, cast

_GOOD_ENOUGH = 0.01  # stop improving when max time <= best possible * (1 + this); the target is 1.02
_SPEED_CLASS_STEP = 0.02  # devices whose speeds differ < 2% share one heap (the pass fixes the residue)
_MAX_RECEIVERS = 16  # devices tried per improvement round
_MAX_ROUNDS = 512  # improvement rounds at most (each is O(D)): bounds the plan time on 1000+ devices


def partition(
    items: Sequence[int],
    costs: Sequence[float],
    speeds: Sequence[float],
    item_fits: Sequence[int] | None = None,
    lengths: Sequence[int] | None = None,
    max_rounds: int | None = None,
    fixed: float = 0.0,
) -> list[list[int]]:
    """Split `items` (positions) over len(speeds) devices; returns one list of positions per device, each
    sorted by cost descending (= length descending), which the packer relies on.

    item_fits[d] = longest length device d can take alone (memory budget / token cap), with `lengths`;
    None = any device takes any item. An item that fits nowhere goes to the device with the largest limit
    (the packer flags it). fixed: what a device pays once it computes anything (a packed row's fixed cost):
    every device starts at it, and one left idle pays nothing, so a slow device gets samples only where that
    finishes them sooner than the others would.
    """
    n_dev = len(speeds)
    bins: list[list[int]] = [[] for _ in range(n_dev)]
    if n_dev == 0 or not items:
        return bins
    loads = [float(fixed)] * n_dev
    # stable: equal costs keep the input order (callers pass positions ascending)
    order = sorted(items, key=costs.__getitem__, reverse=True)

    restricted: list[int] = []
    free = order
    if item_fits is not None and lengths is not None and max(lengths) > min(item_fits):
        limit_all = min(item_fits)
        restricted = [p for p in order if lengths[p] > limit_all]
        free = [p for p in order if lengths[p] <= limit_all]
    # Items only some devices can take go first, by linear scan (rare, and they are the longest anyway).
    if restricted:
        biggest = max(range(n_dev), key=lambda d: (cast("Sequence[int]", item_fits)[d], -d))
        for p in restricted:
            c = costs[p]
            best, best_t = -1, math.inf
            for d in range(n_dev):
                if cast("Sequence[int]", lengths)[p] <= cast("Sequence[int]", item_fits)[d]:
                    t = (loads[d] + c) / speeds[d]
                    if t < best_t:
                        best, best_t = d, t
            if best < 0:
                best = biggest
            bins[best].append(p)
            loads[best] += c

    _lpt(free, costs, speeds, loads, bins)
    for d in range(n_dev):
        if not bins[d]:
            loads[d] = 0.0  # idle: no row, no fixed cost
    # with equal speeds the pigeonhole bound tells when the remaining imbalance is granularity, not the search
    floor = _sorted_lower_bound([costs[p] for p in order], n_dev) + fixed if min(speeds) == max(speeds) else 0.0
    touched = _improve(
        bins,
        loads,
        costs,
        speeds,
        item_fits,
        lengths,
        max_rounds if max_rounds is not None else min(4 * n_dev + 16, _MAX_ROUNDS),
        floor / speeds[0],
        fixed,
    )
    for d in sorted(touched):  # LPT appends longest first; only bins the pass changed need re-sorting
        bins[d].sort(key=lambda p: (-costs[p], p))
    return bins


def _lpt(
    order: list[int], costs: Sequence[float], speeds: Sequence[float], loads: list[float], bins: list[list[int]]
) -> None:
    """Each item to the device that finishes it earliest. One heap per speed class keeps this O(n log D)."""
    if min(speeds) == max(speeds):  # equal speeds: plain LPT on loads
        if all(map(float.is_integer, map(float, costs))) and all(map(float.is_integer, map(float, loads))):
            _lpt_integer(order, costs, loads, bins)
            return
        h = [(loads[d], d) for d in range(len(speeds))]
        heapq.heapify(h)
        for p in order:
            d = h[0][1]
            loads[d] += costs[p]
            bins[d].append(p)
            heapq.heapreplace(h, (loads[d], d))
        return
    classes: dict[int, list[int]] = {}
    for d, s in enumerate(speeds):
        classes.setdefault(round(math.log(s) / math.log1p(_SPEED_CLASS_STEP)), []).append(d)
    heaps = [[(loads[d] / speeds[d], d) for d in devs] for _, devs in sorted(classes.items())]
    for h in heaps:
        heapq.heapify(h)
    if len(heaps) == 1:
        h = heaps[0]
        for p in order:
            c = costs[p]
            d = h[0][1]
            loads[d] += c
            bins[d].append(p)
            heapq.heapreplace(h, (loads[d] / speeds[d], d))
        return
    for p in order:
        c = costs[p]
        best_h, best_key = None, None
        for h in heaps:
            d = h[0][1]
            key = ((loads[d] + c) / speeds[d], d)
            if best_key is None or key < best_key:
                best_h, best_key = h, key
        d = cast("tuple[float, int]", best_key)[1]
        loads[d] += c
        bins[d].append(p)
        heapq.heapreplace(cast("list[tuple[float, int]]", best_h), (loads[d] / speeds[d], d))


def _lpt_integer(order: list[int], costs: Sequence[float], loads: list[float], bins: list[list[int]]) -> None:
    """The same LPT (same ties: lower device index) when every cost is a whole number, the default token
    cost: each heap entry is one int, load << shift | device, which heapq compares 20% faster than tuples."""
    n_dev = len(loads)
    shift = n_dev.bit_length()
    mask = (1 << shift) - 1
    h = [(int(loads[d]) << shift) | d for d in range(n_dev)]
    heapq.heapify(h)
    replace = heapq.heapreplace
    add = [b.append for b in bins]
    step = [int(c) << shift for c in costs]
    for p in order:
        key = h[0]
        replace(h, key + step[p])
        add[key & mask](p)
    for key in h:
        loads[key & mask] = float(key >> shift)


def _improve(
    bins: list[list[int]],
    loads: list[float],
    costs: Sequence[float],
    speeds: Sequence[float],
    item_fits: Sequence[int] | None,
    lengths: Sequence[int] | None,
    max_rounds: int,
    floor_time: float = 0.0,
    fixed: float = 0.0,
) -> set[int]:
    """floor_time: a known lower bound on the best step time (stop once within _GOOD_ENOUGH of it); fixed: what a
    device pays once it computes anything (partition's). Returns the devices whose bins changed."""
    n_dev = len(bins)
    touched: set[int] = set()
    if n_dev < 2:
        return touched
    stop_at = max(sum(loads) / sum(speeds), floor_time) * (1 + _GOOD_ENOUGH)
    times = [loads[d] / speeds[d] for d in range(n_dev)]
    for _ in range(max_rounds):
        hi = max(range(n_dev), key=lambda d: (times[d], -d))
        t_hi = times[hi]
        if t_hi <= stop_at:
            return touched
        # the least loaded receivers are where a move or swap most likely fits; capping their number bounds
        # the cost of a round on big jobs (the next round starts again from the new slowest device)
        receivers = heapq.nsmallest(
            _MAX_RECEIVERS, (d for d in range(n_dev) if d != hi and times[d] < t_hi), key=lambda d: (times[d], d)
        )
        hi_items = sorted(bins[hi], key=lambda p: (costs[p], p))
        for lo in receivers:
            if _best_exchange(hi, lo, hi_items, bins, loads, costs, speeds, item_fits, lengths, t_hi, fixed):
                touched.update((hi, lo))
                times[hi] = loads[hi] / speeds[hi]
                times[lo] = loads[lo] / speeds[lo]
                break
        else:
            return touched  # no single move or swap lowers the slowest device: local optimum
    return touched


def _best_exchange(
    hi: int,
    lo: int,
    hi_items: list[int],
    bins: list[list[int]],
    loads: list[float],
    costs: Sequence[float],
    speeds: Sequence[float],
    item_fits: Sequence[int] | None,
    lengths: Sequence[int] | None,
    t_hi: float,
    fixed: float = 0.0,
) -> bool:
    """Best single move (hi -> lo) or swap between hi and lo; applies it and returns True if it helps. An idle lo
    starts paying `fixed` with its first item; hi giving its last one away pays nothing."""
    s_hi, s_lo = speeds[hi], speeds[lo]
    l_hi, l_lo = loads[hi], loads[lo] if bins[lo] else fixed
    last = len(bins[hi]) == 1
    # Moving delta cost from hi to lo equalises their finish times at this delta:
    target = (l_hi * s_lo - l_lo * s_hi) / (s_hi + s_lo)
    if target <= 0:
        return False
    check = item_fits is not None and lengths is not None
    lo_items = sorted(bins[lo], key=lambda p: (costs[p], p))
    lo_costs = [costs[p] for p in lo_items]
    best = None  # (new max time, a position in hi, b position in lo or -1)
    for a in hi_items:
        ca = costs[a]
        if check and cast("Sequence[int]", lengths)[a] > cast("Sequence[int]", item_fits)[lo]:
            continue
        # plain move of a
        if ca < 2 * target + 1e-12:
            t = max(0.0 if last else (l_hi - ca) / s_hi, (l_lo + ca) / s_lo)
            if best is None or t < best[0]:
                best = (t, a, -1)
        # swap a <-> b: want ca - cb close to target, i.e. cb close to ca - target
        i = bisect_left(lo_costs, ca - target)
        for j in (i - 1, i):
            if 0 <= j < len(lo_items):
                b = lo_items[j]
                delta = ca - costs[b]
                if delta <= 0 or (check and cast("Sequence[int]", lengths)[b] > cast("Sequence[int]", item_fits)[hi]):
                    continue
                t = max((l_hi - delta) / s_hi, (l_lo + delta) / s_lo)
                if best is None or t < best[0]:
                    best = (t, a, b)
    if best is None or best[0] >= t_hi * (1 - 1e-12):
        return False
    _, a, b = best
    bins[hi].remove(a)
    bins[lo].append(a)
    loads[hi] -= costs[a]
    loads[lo] = l_lo + costs[a]
    if b >= 0:
        bins[lo].remove(b)
        bins[hi].append(b)
        loads[lo] -= costs[b]
        loads[hi] += costs[b]
    if not bins[hi]:
        loads[hi] = 0.0
    return True


def lower_bound(costs: Sequence[float], n_devices: int) -> float:
    """A lower bound on the best possible max load over n_devices equal devices (for tests and benchmarks).

    max(mean, largest item, and for every k: some device holds k+1 of the k*D+1 largest items, so at least the
    sum of the k+1 smallest of them). The last term is what makes spiky distributions (many samples cut at
    the same max length) unable to reach a ratio of 1.0 at few samples per device.
    """
    return _sorted_lower_bound(sorted(costs, reverse=True), n_devices)


def _sorted_lower_bound(s: Sequence[float], n_devices: int) -> float:
    if not s or n_devices < 1:
        return 0.0
    bound = max(sum(s) / n_devices, s[0])
    k = 1
    while k * n_devices + 1 <= len(s):
        bound = max(bound, sum(s[k * n_devices - k : k * n_devices + 1]))
        k += 1
    return bound
