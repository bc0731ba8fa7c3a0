"""Routing policies: pure functions (lengths, sample_ids, devices, settings, memory_model) -> Assignment.

They decide only which device computes which samples and in how many micro-batches; the global batch itself
is fixed by the sampler. Every sample position lands in exactly one micro-batch of exactly one device. Inside,
a `PlanInputs` (the batch, the devices, the settings) is what the helpers read.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

from .memory_model import MemoryModel
from .packing import UNLIMITED, Batch, pack_by_length, pack_in_order, pack_rows, sample_costs
from .partition import partition
from .types import POLICY_NAMES, Assignment, DeviceState, RouterSettings

# Default affinity buckets: powers of two, so bucket edges never depend on the batch (no quantiles).
DEFAULT_AFFINITY_BOUNDARIES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_MIN_SPEED = 1e-9
_AFFINITY_SLACK = 0.05  # how far above an even share affinity lets a pinned group be

Policy = Callable[
    [Sequence[int], Sequence[int], Sequence[DeviceState], RouterSettings, "MemoryModel | None"], Assignment
]


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What a policy plans from: the global batch (ids, lengths, costs, memory model), the devices, the settings."""

    batch: Batch
    devices: Sequence[DeviceState]
    settings: RouterSettings

    @classmethod
    def of(
        cls,
        lengths: Sequence[int],
        sample_ids: Sequence[int],
        devices: Sequence[DeviceState],
        settings: RouterSettings,
        memory_model: MemoryModel | None,
    ) -> PlanInputs:
        """A policy's arguments, checked, with each sample's cost (packing.sample_costs)."""
        if len(lengths) != len(sample_ids):
            raise ValueError(f"{len(sample_ids)} sample ids but {len(lengths)} lengths: pass one length per sample")
        if not devices:
            raise ValueError("no devices: a job needs at least one device to route to")
        return cls(Batch(sample_ids, lengths, sample_costs(lengths, settings), memory_model), devices, settings)


def _item_fits(inputs: PlanInputs) -> list[int] | None:
    """Per device, the longest sample it can compute alone; None when nothing limits any device."""
    devices, settings, memory_model = inputs.devices, inputs.settings, inputs.batch.memory_model
    cap = settings.max_tokens_per_microbatch
    with_mem = memory_model is not None and any(d.mem_budget_bytes is not None for d in devices)
    if cap is None and not with_mem:
        return None
    fits = []
    for d in devices:
        limit = cap if cap is not None else UNLIMITED
        if with_mem and d.mem_budget_bytes is not None:
            limit = min(limit, cast(MemoryModel, memory_model).max_len_alone(d.mem_budget_bytes))
        fits.append(limit)
    return fits


def _row_fixed_cost(settings: RouterSettings) -> float:
    """What a device pays once it computes anything: a packed row's fixed cost (padded micro-batches: none here,
    microbatch_overhead_tokens is their padding threshold)."""
    return float(settings.microbatch_overhead_tokens) if settings.packed else 0.0


def _partition_costs(inputs: PlanInputs) -> Sequence[float]:
    """The costs the partition balances. Packed rows that a token cap or the memory budget limits: a device's
    share of T tokens needs about T / R rows of R tokens beyond its first, so each sample also carries
    fixed * len / R (R: the smallest device's row, by the cap and the memory model at the batch's mean length).
    The first row's fixed cost is the partition's `fixed`. Otherwise the samples' own costs."""
    costs, lengths, memory_model = inputs.batch.costs, inputs.batch.lengths, inputs.batch.memory_model
    devices, settings = inputs.devices, inputs.settings
    fixed = _row_fixed_cost(settings)
    if fixed <= 0 or not lengths:
        return costs
    mean_len = sum(lengths) / len(lengths)
    row = float(settings.max_tokens_per_microbatch or UNLIMITED)
    if memory_model is not None:
        (f, a, b), scale = memory_model.coef, memory_model.scale
        for d in devices:
            if d.mem_budget_bytes is not None and a + b * mean_len > 0:
                row = min(row, max(mean_len, (d.mem_budget_bytes / scale - f) / (a + b * mean_len)))
    if row >= UNLIMITED:
        return costs
    per_token = fixed / row
    return [c + per_token * n for c, n in zip(costs, lengths)]


def _finish(inputs: PlanInputs, bins: list[list[int]], by_length: bool = True) -> Assignment:
    oversize: list[int] = []
    devices, settings = inputs.devices, inputs.settings
    pack = pack_rows if settings.packed else pack_by_length if by_length else pack_in_order
    # by_length callers hand over bins sorted longest first (partition output, least_loaded's order)
    per_device = tuple(
        pack(bins[d], inputs.batch, devices[d].mem_budget_bytes, settings, oversize, by_length)
        for d in range(len(devices))
    )
    return Assignment(per_device, tuple(inputs.batch.sample_ids[p] for p in sorted(oversize)))


def round_robin(
    lengths: Sequence[int],
    sample_ids: Sequence[int],
    devices: Sequence[DeviceState],
    settings: RouterSettings,
    memory_model: MemoryModel | None = None,
) -> Assignment:
    """Sample i of the global batch -> device i % D (DistributedSampler's split). Ignores speed and cost."""
    inputs = PlanInputs.of(lengths, sample_ids, devices, settings, memory_model)
    n_dev = len(devices)
    bins = [list(range(d, len(sample_ids), n_dev)) for d in range(n_dev)]
    return _finish(inputs, bins, by_length=False)


def balanced(
    lengths: Sequence[int],
    sample_ids: Sequence[int],
    devices: Sequence[DeviceState],
    settings: RouterSettings,
    memory_model: MemoryModel | None = None,
) -> Assignment:
    """Cost partition weighted by device speed (LPT + moves/swaps), memory-capped; micro-batches by length."""
    inputs = PlanInputs.of(lengths, sample_ids, devices, settings, memory_model)
    speeds = [max(d.speed, _MIN_SPEED) for d in devices]
    bins = partition(
        range(len(sample_ids)),
        _partition_costs(inputs),
        speeds,
        _item_fits(inputs),
        lengths,
        fixed=_row_fixed_cost(settings),
    )
    return _finish(inputs, bins)


def least_loaded(
    lengths: Sequence[int],
    sample_ids: Sequence[int],
    devices: Sequence[DeviceState],
    settings: RouterSettings,
    memory_model: MemoryModel | None = None,
) -> Assignment:
    """Longest sample first, each to the device with the most memory left.

    'Memory left' = min(last free reading, budget) minus what this plan already gave the device, predicted by
    the memory model (the classic 'send it to the least loaded GPU', but from the telemetry the workers
    all-gathered, never from a GPU poll per decision). A device with neither reading nor budget counts as
    unlimited. Without a memory model, bytes per token are taken as if the batch filled the mean usable
    memory, which shares the batch in proportion to free memory. If no device reports anything at all, this
    falls back to least assigned cost / speed.
    """
    inputs = PlanInputs.of(lengths, sample_ids, devices, settings, memory_model)
    n, n_dev, costs = len(sample_ids), len(devices), inputs.batch.costs
    usable = []
    d: Any
    for d in devices:
        known = [v for v in (d.mem_free_bytes, d.mem_budget_bytes) if v is not None]
        usable.append(float(min(known)) if known else float(UNLIMITED))
    bins: list[list[int]] = [[] for _ in range(n_dev)]
    order = sorted(range(n), key=lambda p: (-lengths[p], p))
    if all(u >= UNLIMITED for u in usable):
        speeds = [max(d.speed, _MIN_SPEED) for d in devices]
        heap = [(0.0, d) for d in range(n_dev)]
        loads = [0.0] * n_dev
        for p in order:
            d = heap[0][1]
            loads[d] += costs[p]
            bins[d].append(p)
            heapq.heapreplace(heap, (loads[d] / speeds[d], d))
    else:
        if memory_model is not None:
            need = [memory_model.sample_bytes(n_tok) for n_tok in lengths]
        else:
            finite = [u for u in usable if u < UNLIMITED]
            per_token = (sum(finite) / len(finite)) / max(1, sum(lengths))
            need = [n_tok * per_token for n_tok in lengths]
        heap = [(-usable[d], d) for d in range(n_dev)]  # max-heap on memory left, ties -> lower index
        heapq.heapify(heap)
        for p in order:
            left, d = heap[0]
            bins[d].append(p)
            heapq.heapreplace(heap, (left + need[p], d))
    return _finish(inputs, bins)


def affinity(
    lengths: Sequence[int],
    sample_ids: Sequence[int],
    devices: Sequence[DeviceState],
    settings: RouterSettings,
    memory_model: MemoryModel | None = None,
) -> Assignment:
    """Length buckets pinned to device groups: the longest bucket to the devices with the largest budget.

    Devices are ranked by (budget, speed) descending; non-empty buckets, longest first, take consecutive
    groups of that ranking, sized so that the busiest group's cost per device is smallest (at least one device
    each). With more non-empty buckets than devices, the cheapest neighbouring buckets merge first. Inside a
    group: balanced partition. The price of pinning is granularity: a bucket gets whole devices.
    Each device therefore sees a narrow band of lengths (little padding, stable shapes).
    """
    inputs = PlanInputs.of(lengths, sample_ids, devices, settings, memory_model)
    n, n_dev, costs = len(sample_ids), len(devices), inputs.batch.costs
    edges = settings.affinity_boundaries or DEFAULT_AFFINITY_BOUNDARIES
    buckets: dict[int, list[int]] = {}
    for p in range(n):
        buckets.setdefault(bisect_right(edges, lengths[p]), []).append(p)
    keys = sorted(buckets, reverse=True)  # longest bucket first
    ranked = sorted(
        range(n_dev),
        key=lambda d: (
            -cast(int, devices[d].mem_budget_bytes if devices[d].mem_budget_bytes is not None else UNLIMITED),
            -devices[d].speed,
            d,
        ),
    )
    groups_items = [buckets[k] for k in keys]
    group_cost = [sum(costs[p] for p in g) for g in groups_items]
    # A bucket gets whole devices, so a small bucket on its own device can leave a big one crowded: merge
    # neighbouring buckets while there are more buckets than devices, or while the busiest group is more than
    # _AFFINITY_SLACK above an even share and a merge lowers it. The slack is the balance affinity trades for
    # locality (each device sees a narrow band of lengths); without it every bucket would merge into one.
    fair = sum(group_cost) / n_dev
    while len(groups_items) > 1:
        if len(groups_items) > n_dev:
            best_i = min(range(len(groups_items) - 1), key=lambda i: (group_cost[i] + group_cost[i + 1], i))
        else:
            best_i, best_obj = -1, _busiest(group_cost, n_dev)
            if best_obj <= fair * (1 + _AFFINITY_SLACK):
                break
            for i in range(len(groups_items) - 1):
                obj = _busiest(group_cost[:i] + [group_cost[i] + group_cost[i + 1]] + group_cost[i + 2 :], n_dev)
                if obj < best_obj * (1 - 1e-9):
                    best_i, best_obj = i, obj
            if best_i < 0:
                break
        groups_items[best_i : best_i + 2] = [groups_items[best_i] + groups_items[best_i + 1]]
        group_cost[best_i : best_i + 2] = [group_cost[best_i] + group_cost[best_i + 1]]
    group_sizes = _apportion(group_cost, n_dev)
    item_fits = _item_fits(inputs)
    part_costs = _partition_costs(inputs)
    bins: list[list[int]] = [[] for _ in range(n_dev)]
    start = 0
    for items, size in zip(groups_items, group_sizes):
        group = ranked[start : start + size]
        start += size
        fits = [item_fits[d] for d in group] if item_fits is not None else None
        speeds = [max(devices[d].speed, _MIN_SPEED) for d in group]
        sub = partition(items, part_costs, speeds, fits, lengths, fixed=_row_fixed_cost(settings))
        for d, share in zip(group, sub):
            bins[d].extend(share)
    return _finish(inputs, bins)


def _apportion(weights: list[float], total: int) -> list[int]:
    """`total` devices over groups (len(weights) <= total), each at least 1, minimising the largest
    weight / devices: start from the proportional floor, then settle the remainder one device at a time."""
    if not weights:
        return []
    w_sum = sum(weights) or 1.0
    sizes = [max(1, int(w * total / w_sum)) for w in weights]
    while sum(sizes) > total:  # the max(1, .) floors can overshoot: take from whoever misses it least
        i = min((i for i in range(len(sizes)) if sizes[i] > 1), key=lambda i: (weights[i] / (sizes[i] - 1), i))
        sizes[i] -= 1
    while sum(sizes) < total:
        i = max(range(len(sizes)), key=lambda i: (weights[i] / sizes[i], -i))
        sizes[i] += 1
    return sizes


def _busiest(weights: list[float], total: int) -> float:
    if len(weights) > total:
        return math.inf
    return max(w / s for w, s in zip(weights, _apportion(weights, total)))


# router.policy's choices: each name in types.POLICY_NAMES (the one list, in order) is the function of that name here
POLICIES: dict[str, Policy] = {name: globals()[name] for name in POLICY_NAMES}
