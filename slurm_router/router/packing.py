"""Sample costs, and turning one device's share of samples into micro-batches.

Samples are handled by *position* in the global batch (0..n-1) inside the router; ids only appear when a
MicroBatch is built. Positions keep every tie-break well defined even if a caller passes repeated lengths. A
`Batch` carries what every packer reads by position: ids, lengths, costs and the memory model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Mapping, Sequence, cast

from .memory_model import MemoryModel
from .types import MicroBatch, RouterSettings

UNLIMITED = 1 << 40


def sample_costs(lengths: Sequence[int], settings: RouterSettings) -> list[float]:
    """cost(n) = n, or n + attention_weight * n^2 / attention_ref_len with cost="tokens_attention"."""
    if settings.cost == "tokens_attention" and settings.attention_weight > 0:
        w = settings.attention_weight / settings.attention_ref_len
        return [n + w * n * n for n in lengths]
    return [float(n) for n in lengths]


@dataclass(frozen=True, slots=True)
class Batch:
    """A global batch by position (0..n-1): each sample's id, length in tokens and cost (sample_costs), and the
    memory model that predicts a micro-batch's peak (None: no model)."""

    sample_ids: Sequence[int]
    lengths: Sequence[int]
    costs: Sequence[float]
    memory_model: MemoryModel | None = None


def build_microbatch(positions: list[int], batch: Batch) -> MicroBatch:
    sample_ids, lengths, costs, memory_model = batch.sample_ids, batch.lengths, batch.costs, batch.memory_model
    n = len(positions)
    if n == 1:  # the common case with long-tailed lengths: skip the generic path (this is the hot loop)
        p = positions[0]
        n_tok = lengths[p]
        mem = memory_model.predict(n_tok, 1, n_tok) if memory_model is not None else None
        return MicroBatch((sample_ids[p],), n_tok, n_tok, costs[p], mem)
    positions = sorted(positions)  # global-batch order inside a micro-batch, whatever the grouping
    max_len = max(map(lengths.__getitem__, positions))
    padded = max_len * n
    mem = memory_model.predict(padded, n, max_len) if memory_model is not None else None
    return MicroBatch(
        tuple(map(sample_ids.__getitem__, positions)),
        sum(map(lengths.__getitem__, positions)),
        padded,
        sum(map(costs.__getitem__, positions)),
        mem,
    )


def build_microbatches(groups: list[list[int]], batch: Batch) -> tuple[MicroBatch, ...]:
    """build_microbatch over groups that each come longest first (pack_by_length's), with the memory model's
    coefficients read once: a big plan's hot loop builds hundreds of micro-batches. Same values as
    build_microbatch (tests check); tuple.__new__ skips NamedTuple's Python-level __new__."""
    memory_model = batch.memory_model
    if memory_model is None:
        return tuple([build_microbatch(g, batch) for g in groups])
    sample_ids, lengths, costs = batch.sample_ids, batch.lengths, batch.costs
    (f, a, b), scale, ceil = memory_model.coef, memory_model.scale, math.ceil
    new, mb_type, out = tuple.__new__, MicroBatch, []
    for g in groups:
        p = g[0]
        max_len = lengths[p]
        if len(g) == 1:
            out.append(
                new(
                    mb_type,
                    (
                        (sample_ids[p],),
                        max_len,
                        max_len,
                        costs[p],
                        ceil(scale * (f + a * max_len + b * max_len * max_len)),
                    ),
                )
            )
            continue
        n = len(g)
        get = itemgetter(*sorted(g))  # n >= 2: a getter returns a tuple, in C
        padded = max_len * n
        out.append(
            new(
                mb_type,
                (
                    get(sample_ids),
                    sum(get(lengths)),
                    padded,
                    sum(get(costs)),
                    ceil(scale * (f + a * padded + b * n * max_len * max_len)),
                ),
            )
        )
    return tuple(out)


def build_packed(positions: Sequence[int], batch: Batch, fixed: float = 0.0) -> MicroBatch:
    """One packed row of these samples, in global-batch order: what it computes is its real tokens; its cost is
    its samples' plus the fixed cost of a row."""
    sample_ids, lengths, costs, memory_model = batch.sample_ids, batch.lengths, batch.costs, batch.memory_model
    positions = sorted(positions)
    n_tok = sum(map(lengths.__getitem__, positions))
    mem = memory_model.predict(n_tok, len(positions), n_tok // len(positions)) if memory_model is not None else None
    return MicroBatch(
        tuple(map(sample_ids.__getitem__, positions)), n_tok, n_tok, sum(map(costs.__getitem__, positions)) + fixed, mem
    )


def pack_rows(
    positions: Sequence[int],
    batch: Batch,
    budget_bytes: int | None,
    settings: RouterSettings,
    oversize: list[int],
    presorted: bool = False,
) -> tuple[MicroBatch, ...]:
    """Packed mode: the device's share in the fewest packed rows (micro-batches) that each fit the token cap
    (router.max_tokens_per_microbatch) and the memory budget: first-fit decreasing by length. With nothing
    limiting it, the whole share is one row. A sample that does not fit even alone is put alone, in oversize.
    Each row's cost adds microbatch_overhead_tokens (fitted: router/cost_model.py).

    The memory model sees a row as its real tokens over its samples (padded = real): the attention term uses
    the row's mean sample length, since each sample attends only within itself."""
    if not positions:
        return ()
    lengths, memory_model = batch.lengths, batch.memory_model
    order = positions if presorted else sorted(positions, key=lengths.__getitem__, reverse=True)
    cap = settings.max_tokens_per_microbatch if settings.max_tokens_per_microbatch is not None else UNLIMITED
    use_mem = memory_model is not None and budget_bytes is not None

    def fits(tokens: int, n: int) -> bool:
        return tokens <= cap and (
            not use_mem or cast(MemoryModel, memory_model).predict(tokens, n, tokens // n) <= cast(int, budget_bytes)
        )

    fixed = float(settings.microbatch_overhead_tokens)
    total = sum(map(lengths.__getitem__, order))
    if fits(total, len(order)):
        return (build_packed(order, batch, fixed),)
    rows: list[list[int]] = []
    tokens: list[int] = []
    for p in order:
        n = lengths[p]
        for r, row in enumerate(rows):
            if fits(tokens[r] + n, len(row) + 1):
                row.append(p)
                tokens[r] += n
                break
        else:
            if not fits(n, 1):
                oversize.append(p)
            rows.append([p])
            tokens.append(n)
    return tuple(build_packed(row, batch, fixed) for row in rows)


def max_samples_fn(budget_bytes: int | None, settings: RouterSettings, memory_model: MemoryModel | None):
    """k(max_len): how many samples padded to max_len one micro-batch may hold (memory budget and token cap)."""
    cap = settings.max_tokens_per_microbatch
    use_mem = memory_model is not None and budget_bytes is not None

    def k_max(max_len: int) -> int:
        k = UNLIMITED
        if cap is not None:
            k = cap // max_len if max_len > 0 else UNLIMITED
        if use_mem:
            k = min(k, cast(MemoryModel, memory_model).max_samples(max_len, budget_bytes))
        return k

    return k_max


def pack_by_length(
    positions: Sequence[int],
    batch: Batch,
    budget_bytes: int | None,
    settings: RouterSettings,
    oversize: list[int],
    presorted: bool = False,
) -> tuple[MicroBatch, ...]:
    """Group a device's share into micro-batches of similar length, longest first.
    presorted: positions already come longest first (the partition's output), skip the sort.

    Walking the share longest-first, a sample joins the open micro-batch (padded to that micro-batch's first,
    longest sample) unless the padding it would add exceeds settings.microbatch_overhead_tokens (one more
    micro-batch is cheaper than that much padding), or the micro-batch would break the token cap or the
    memory budget: then a new micro-batch starts, i.e. a share that does not fit is split (gradient
    accumulation), never dropped. A sample that does not fit even alone is put alone and reported in oversize.
    """
    if not positions:
        return ()
    lengths, memory_model = batch.lengths, batch.memory_model
    # stable sort on the length alone: equal lengths keep the caller's (deterministic) order
    order = positions if presorted else sorted(positions, key=lengths.__getitem__, reverse=True)
    overhead = settings.microbatch_overhead_tokens
    groups: list[list[int]] = []
    group: list[int] = []
    cut = 1 << 62  # a sample joins the open micro-batch iff its length >= cut = head length - overhead
    limited = settings.max_tokens_per_microbatch is not None or (memory_model is not None and budget_bytes is not None)
    if limited:
        k_max = max_samples_fn(budget_bytes, settings, memory_model)
        # the whole share padded to its longest sample fits: then no shorter micro-batch can break a limit
        limited = k_max(lengths[order[0]]) < len(order)
    if not limited:
        # nothing caps a micro-batch: only the padding rule splits (the hot path of big plans, kept lean)
        for p in order:
            n = lengths[p]
            if n >= cut:
                group.append(p)
            else:
                group = [p]
                groups.append(group)
                cut = n - overhead
    else:
        group_cap = 0
        for p in order:
            n = lengths[p]
            if n >= cut and len(group) < group_cap:
                group.append(p)
                continue
            group = [p]
            groups.append(group)
            cut = n - overhead
            group_cap = k_max(n)
            if group_cap < 1:
                oversize.append(p)
                group_cap = 1  # alone, never dropped
    return build_microbatches(groups, batch)


def pack_in_order(
    positions: Sequence[int],
    batch: Batch,
    budget_bytes: int | None,
    settings: RouterSettings,
    oversize: list[int],
    presorted: bool = False,
) -> tuple[MicroBatch, ...]:
    """round_robin's packing: one micro-batch, or the fewest equal consecutive chunks that all fit.

    This is the static baseline (what DistributedSampler + a fixed gradient-accumulation count does): no
    sorting by length, so it pays the padding that balanced avoids."""
    n = len(positions)
    if n == 0:
        return ()
    lengths = batch.lengths
    k_max = max_samples_fn(budget_bytes, settings, batch.memory_model)
    for n_chunks in range(1, n + 1):
        chunks = _equal_chunks(positions, n_chunks)
        if all(len(c) <= k_max(max(lengths[p] for p in c)) for c in chunks):
            break
    for c in chunks:
        if len(c) == 1 and k_max(lengths[c[0]]) < 1:
            oversize.append(c[0])
    return tuple(build_microbatch(c, batch) for c in chunks)


def _equal_chunks(items: Sequence[int], n_chunks: int) -> list[list[int]]:
    q, r = divmod(len(items), n_chunks)
    out, start = [], 0
    for i in range(n_chunks):
        size = q + (1 if i < r else 0)
        out.append(list(items[start : start + size]))
        start += size
    return out


def split_for_oom(
    mb: MicroBatch,
    lengths_by_id: Mapping[int, int] | Sequence[int],
    settings: RouterSettings | None = None,
    memory_model: MemoryModel | None = None,
) -> tuple[MicroBatch, MicroBatch]:
    """Halve a micro-batch that ran out of memory: (longest half, shortest half), each in the original order.

    Splitting by length (not by position) shrinks the padded size of both halves the most. Costs are
    recomputed with `settings` when given, else shared in proportion to real tokens. Together the halves hold
    exactly the samples of `mb`, so no sample is lost or computed twice.
    """
    n = len(mb.sample_ids)
    if n < 2:
        raise ValueError(
            f"micro-batch with {n} sample(s) cannot be halved; the sample alone exceeds memory: "
            "lower data.max_len or use a device with more memory"
        )
    ids = list(mb.sample_ids)
    lengths = [int(lengths_by_id[sid]) for sid in ids]
    if settings is not None:
        costs = sample_costs(lengths, settings)
    else:
        per_token = mb.cost / mb.n_tokens if mb.n_tokens else 0.0
        costs = [n_tok * per_token for n_tok in lengths]
    by_len = sorted(range(n), key=lambda i: (-lengths[i], i))
    batch = Batch(ids, lengths, costs, memory_model)
    if settings is not None and settings.packed:  # halve the row's tokens, not its padded width
        halves: tuple[list[int], list[int]] = ([], [])
        half_tokens = [0, 0]
        for i in by_len:
            side = 0 if half_tokens[0] <= half_tokens[1] else 1
            halves[side].append(i)
            half_tokens[side] += lengths[i]
        fixed = float(settings.microbatch_overhead_tokens)
        return (
            build_packed(halves[0], batch, fixed),
            build_packed(halves[1], batch, fixed),
        )
    long_half, short_half = by_len[: n // 2], by_len[n // 2 :]
    return (
        build_microbatch(long_half, batch),
        build_microbatch(short_half, batch),
    )
