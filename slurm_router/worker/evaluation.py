"""Held-out evaluation (docs/design/data-flow.md, "Data flow"): every member still in the group on the same held-out
batches, each batch's samples spread over the task's ranks and their sums all-reduced; then eval.metrics, each
member scored alone; each member's eval row in its own events. A task alone takes each batch as one packed row
(right-padded if it trains padded, train.packing); a fused group one packed row of its members' samples side by
side through the shared model, in one forward each batch. Loss sums and target counts are kept per eval batch:
the verdict's unit (docs/design/pruning.md)."""

from __future__ import annotations

import time
from typing import Any, Callable, cast

import torch

from slurm_router.rundir import events as ev
from slurm_router.rundir.layout import TaskPaths
from slurm_router.train.fused_lora import fused_loss, fused_packed_batch
from slurm_router.train.packed import packed_tensors
from slurm_router.worker.members import Group
from slurm_router.worker.microbatch import autocast, batch_tensors, loss_sum


def held_out_sums(group: Group, split, eval_ids: list[list[int]], pad_id: int, cfg, device, rank: int, world: int):
    """This rank's (K, 2B) float64 sums: per member k and eval batch b, [loss sum, target tokens] of its share of
    the batch (rank r: samples r, r + world, ...); the caller all-reduces them. Members that left get zeros."""
    k_all, live = len(group.members), {m.k for m in group.alive}
    sums = torch.zeros(k_all, 2 * len(eval_ids), dtype=torch.float64, device=device)
    group.model.eval()
    with torch.inference_mode():  # no autograd state at all: 10-15% faster than no_grad on CPU
        for b, ids in enumerate(eval_ids):
            mine = ids[rank::world]
            if not mine:
                continue
            if group.fused is None:  # one member: one packed row, or right-padded if it trains padded
                *tensors, kwargs = (
                    packed_tensors(split, mine, device)
                    if group.packed
                    else (*batch_tensors(split, mine, pad_id, device), None)
                )
                loss, n = loss_sum(group.model, *cast("tuple[Any, Any, Any, Any]", tensors), cfg, device, kwargs)
                sums[0, 2 * b] += loss.double()
                sums[0, 2 * b + 1] += n
                continue
            batch = fused_packed_batch(split, [mine if k in live else [] for k in range(k_all)], device)
            with autocast(cfg, device):
                _, loss_sums = fused_loss(group.fused, batch, [1.0] * k_all, as_tensor=True)
            sums[:, 2 * b] += loss_sums.double()
            sums[:, 2 * b + 1] += torch.tensor(batch.n_targets, dtype=torch.float64, device=device)
    group.model.train()
    return sums


def eval_row(
    step: int, sums: torch.Tensor, sources: list, metrics: dict, metric_s: float, t0: float
) -> tuple[ev.EvalRow, tuple[list[float], list[int]], float]:
    """One member's gathered eval sums ([loss sum, tokens] per eval batch) and eval.metrics' scores as its eval row:
    (the row, (loss sums, tokens), held-out loss). t0: when the evaluation began."""
    s = sums.cpu().tolist()
    loss_sums, tokens = s[0::2], [int(t) for t in s[1::2]]
    val_loss = sum(loss_sums) / max(1, sum(tokens))
    row = ev.EvalRow(
        step=step,
        val_loss=val_loss,
        val_tokens=sum(tokens),
        batch_loss_sums=loss_sums,
        batch_tokens=tokens,
        batch_sources=sources,
        metrics=metrics or ev.OMIT,
        t_metrics_s=metric_s if metrics else ev.OMIT,
        t_eval_s=time.time() - t0,
    )
    return row, (loss_sums, tokens), val_loss


def judged(cfg, metrics: dict) -> tuple[str, float] | None:
    """(eval.primary, its mean score at the evaluation, signed so that lower is better): what adapter-best/ keeps
    the best of when the run judges by a task metric; None: by held-out loss."""
    primary = str((cfg.get("eval") or {}).get("primary") or "loss")
    m = metrics.get(primary)
    if not m:
        return None
    mean = sum(m["scores"]) / max(1, len(m["scores"]))
    return primary, -mean if m["higher_is_better"] else mean


def eval_missing(
    step: int, cfg, steps: int, tasks: list[TaskPaths], rank: int, gather: Callable[[list[float]], list[list[float]]]
) -> bool:
    """resume= from a checkpoint at an evaluation step whose evaluation no task of `tasks` recorded (eval.metrics
    failed there): rank 0 reads their events, every rank learns it (collective). An evaluation counts once."""
    every = cfg.train.eval_every
    if not (step == 0 or (every and step % every == 0 and step < steps)):
        return False
    missing = 0.0
    if rank == 0:
        for paths in tasks:
            try:
                rows = ev.scan_events(paths.events(0))[0]
            except OSError:
                rows = []
            if not any(r.get(ev.EVENT) == ev.EvalRow.KIND and r.get("step") == step for r in rows):
                missing = 1.0
    return bool(gather([missing])[0][0])
