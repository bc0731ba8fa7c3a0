"""One device's share of a step: its micro-batches' forward and backward, with the out-of-memory retry.

A plain task's micro-batch is a right-padded batch or one packed row through its model; a fused task's
(FusedMicroBatches) is one packed row of its members' samples side by side, or one row per member, through the
shared model (docs/design/fused.md, "The fused worker").

On an out-of-memory error the micro-batch is halved and both halves are queued again: no sample is lost or
computed twice, and the gradients accumulate all or nothing (a failed backward leaves none behind). Losses
and timings are read once, after the last micro-batch: one host-device sync a step, not one each.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from slurm_router.router import MemoryModel, MicroBatch
from slurm_router.rundir.events import MicroRow
from slurm_router.train.fused_lora import FusedModel, fused_loss, fused_packed_batch
from slurm_router.train.loss import target_positions, token_loss_sum
from slurm_router.train.packed import packed_tensors


class SimulatedOOM(RuntimeError):
    """A CPU worker's stand-in for torch.cuda.OutOfMemoryError (SLURM_ROUTER_TEST_CPU_MEMORY_CAP_BYTES)."""


class CpuMemorySim:
    """Testing aid (SLURM_ROUTER_TEST_CPU_MEMORY_CAP_BYTES, config/testing_aids.py): a CPU worker acts as a device of `cap` bytes whose true peak
    per micro-batch is TRUE_SCALE x the router's initial estimate. The router starts optimistic and has to
    learn from out-of-memory errors and observed peaks, as it does on a GPU."""

    TRUE_SCALE = 1.5

    def __init__(self, cap_bytes: int, truth: MemoryModel):
        self.cap_bytes, self.truth = cap_bytes, truth

    def peak_bytes(self, mb: MicroBatch) -> int:
        n = len(mb.sample_ids)
        return int(self.TRUE_SCALE * self.truth.predict(mb.n_padded_tokens, n, mb.n_padded_tokens // max(1, n)))

    def check(self, mb: MicroBatch) -> None:
        if self.peak_bytes(mb) > self.cap_bytes:
            raise SimulatedOOM(
                f"micro-batch of {mb.n_padded_tokens} padded tokens needs {self.peak_bytes(mb)} "
                f"bytes > the simulated {self.cap_bytes} (SLURM_ROUTER_TEST_CPU_MEMORY_CAP_BYTES)"
            )


def autocast(cfg, device: torch.device):
    p = cfg.train.precision
    bf16 = p == "bf16" or (p == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def loss_sum(
    model, inputs, labels, n_targets, target_index, cfg, device, model_kwargs: dict | None = None
) -> tuple[torch.Tensor, int]:
    with autocast(cfg, device):
        return token_loss_sum(model, inputs, labels, cfg.train.loss_chunk_tokens, n_targets, target_index, model_kwargs)


def batch_tensors(split, ids, pad_id: int, device: torch.device, pad_to_multiple: int = 1):
    """Right-padded inputs and labels (-100 wherever a token is not a target: padding, a prompt, a user turn;
    split.target_mask), the number of targets and their flat positions: everything the loss needs, on the host."""
    seqs = [split.sample(i) for i in ids]
    masks = [split.target_mask(i) for i in ids]
    width = -(-max(len(s) for s in seqs) // pad_to_multiple) * pad_to_multiple
    inputs = np.full((len(seqs), width), pad_id, dtype=np.int64)
    labels = np.full((len(seqs), width), -100, dtype=np.int64)
    for r, (s, m) in enumerate(zip(seqs, masks)):
        inputs[r, : len(s)] = s
        labels[r, : len(s)] = np.where(m, s, -100)
    n_targets, index = target_positions([len(s) for s in seqs], width, masks)
    tensors = [torch.from_numpy(inputs), torch.from_numpy(labels), index]
    if device.type == "cuda":  # pinned host memory: the copy overlaps with compute
        tensors = [t.pin_memory() for t in tensors]
    inputs_t, labels_t, index_t = (t.to(device, non_blocking=True) for t in tensors)
    return inputs_t, labels_t, n_targets, index_t


class Loader:
    """Builds a micro-batch's tensors; with prefetch, the next one is built on a thread while this one computes
    (numpy padding and the pinned host-to-device copy release the GIL)."""

    _pool = None

    def __init__(self, build, prefetch: bool):
        self.pending: dict[Any, Any]
        self.build, self.pending = build, {}
        if prefetch and Loader._pool is None:
            Loader._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self.pool = Loader._pool if prefetch else None

    def prefetch(self, ids) -> None:
        if self.pool is not None and ids not in self.pending:
            self.pending[ids] = self.pool.submit(self.build, ids)

    def get(self, ids):
        future = self.pending.pop(ids, None)
        return future.result() if future is not None else self.build(ids)


class ComputeTimer:
    """Forward+backward time of one micro-batch. On a GPU, CUDA events read once the step's work is done, so
    the host never waits between micro-batches (it queues the next one while this one runs); on CPU, the
    wall clock around the (synchronous) computation."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.t0 = time.time()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.time()

    def seconds(self) -> float:
        """After torch.cuda.synchronize (GPU)."""
        return self.begin.elapsed_time(self.end) / 1000.0 if self.cuda else self.t1 - self.t0


def accumulate(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    """loss.backward(), all or nothing: the micro-batch's gradients are computed apart and added only once
    all exist, so an out-of-memory error halfway through a backward leaves no partial gradient behind for
    the retried halves to add again (backward() accumulates layer by layer as it goes)."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:  # in the parameter's own layout, as backward() would leave it (fused AdamW)
            p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
        else:
            p.grad.add_(g)


@dataclass
class _Ran:
    """A micro-batch whose forward and backward are queued; its loss and time are read after the sync."""

    mb: MicroBatch
    t_start: float
    t_data_s: float
    timer: ComputeTimer
    loss: torch.Tensor
    n_targets: int
    peak_bytes: int
    oom_retries: int


@dataclass
class DeviceStep:
    """What this device did in one step."""

    done: list = field(default_factory=list)  # the micro-batches computed (after any OOM halving)
    loss_sum: float = 0.0  # summed token loss
    compute_s: float = 0.0
    peak_bytes: int = 0
    oom_count: int = 0
    oom_mb: tuple[int, int] = (0, 0)  # (padded tokens, samples) of the largest that did not fit
    member_sums: Any = None  # (K,) float64 on the device: each member's token-loss sum, all-reduced by the worker
    n_pad_tokens: int = 0  # padding computed (a task alone's step row reports it)


class MicroBatchRunner:
    """Runs one device's micro-batches of each step (a worker holds one for the whole run). Its losses are token
    sums: the worker divides the gradients by the global target count after their all-reduce."""

    divides_in_loss = False  # True: each member's loss is already divided by its own global target count

    def __init__(
        self,
        model,
        params,
        split,
        cfg,
        device,
        pad_id: int,
        telemetry,
        mem_sim,
        router,
        events,
        slowdown: float = 1.0,
        packed: bool = False,
    ):
        self.model, self.params, self.split, self.cfg, self.device = model, params, split, cfg, device
        self.pad_id, self.telemetry, self.mem_sim, self.router = pad_id, telemetry, mem_sim, router
        self.events, self.slowdown, self.packed = events, slowdown, packed

    def _build(self, ids):
        """(inputs, labels, n_targets, target_index, model kwargs): one packed row, or a right-padded batch."""
        if self.packed:
            return packed_tensors(self.split, ids, self.device)
        return (*batch_tensors(self.split, ids, self.pad_id, self.device, self.cfg.train.pad_to_multiple), None)

    def begin_step(self, params: list[torch.nn.Parameter], targets: dict[int, int], n_members: int) -> None:
        """A step's trainable weights (the members still in the group) and each member's global target count."""
        self.params = params

    def member_sums(self, out: DeviceStep) -> torch.Tensor:
        return torch.tensor([out.loss_sum], dtype=torch.float64, device=self.device)

    def pad_tokens(self, out: DeviceStep) -> int:
        return sum(mb.n_padded_tokens - mb.n_tokens for mb in out.done)

    def forward_backward(self, batch) -> tuple[torch.Tensor, int]:
        """One micro-batch's summed token loss and its targets; its gradients accumulated (all or nothing)."""
        loss, n_tok = loss_sum(
            self.model, *cast("tuple[Any, Any, Any, Any]", batch[:4]), self.cfg, self.device, model_kwargs=batch[4]
        )
        accumulate(loss, self.params)
        return loss, n_tok

    def run(self, mbs: list[MicroBatch], step: int, lr: float) -> DeviceStep:
        """Forward/backward every micro-batch; on OOM halve and retry (no sample lost or repeated)."""
        queue, out, ran = list(mbs), DeviceStep(), []
        loader = Loader(self._build, self.cfg.train.prefetch)
        while queue:
            mb = queue.pop(0)
            t0 = time.time()
            batch = loader.get(mb.sample_ids)
            if queue:
                loader.prefetch(queue[0].sample_ids)
            t_data = time.time() - t0
            self.telemetry.reset_peak()
            try:
                if self.mem_sim is not None:
                    self.mem_sim.check(mb)
                timer = ComputeTimer(self.device)
                loss, n_tok = self.forward_backward(batch)
                timer.stop()
            except (torch.cuda.OutOfMemoryError, SimulatedOOM):
                if len(mb.sample_ids) <= 1:
                    raise
                del batch
                queue[:0] = self._halve(mb, out)
                continue
            # the allocator's peak is known on the host as soon as the work is queued: no sync needed
            mb_peak = self.mem_sim.peak_bytes(mb) if self.mem_sim is not None else self.telemetry.peak_bytes()
            out.peak_bytes = max(out.peak_bytes, mb_peak)
            ran.append(_Ran(mb, t0, t_data, timer, loss.detach(), n_tok, mb_peak, out.oom_count))
            out.done.append(mb)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._report(ran, out, step, lr)
        out.member_sums, out.n_pad_tokens = self.member_sums(out), self.pad_tokens(out)
        return out

    def _halve(self, mb: MicroBatch, out: DeviceStep) -> list[MicroBatch]:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        out.oom_count += 1
        out.oom_mb = max(out.oom_mb, (mb.n_padded_tokens, len(mb.sample_ids)))  # the largest that failed
        lengths = {i: self.length(i) for i in mb.sample_ids}
        return list(self.router.split_for_oom(mb, lengths))

    def length(self, sample_id: int) -> int:
        return int(self.split.lengths[sample_id])

    def _report(self, ran: list[_Ran], out: DeviceStep, step: int, lr: float) -> None:
        """After the step's one sync: read losses and times, write a micro row each."""
        for micro, r in enumerate(ran):
            t_compute = r.timer.seconds()
            if (
                self.slowdown != 1.0
            ):  # SLURM_ROUTER_TEST_DEVICE_SLOWDOWN: make this device look slower, in proportion to its work
                time.sleep(t_compute * (self.slowdown - 1.0))
                t_compute *= self.slowdown
            out.compute_s += t_compute
            loss = float(r.loss)
            out.loss_sum += loss
            mb = r.mb
            self.events.write(
                MicroRow(
                    step=step,
                    micro=micro,
                    sample_ids=cast(Any, mb.sample_ids),
                    n_samples=len(mb.sample_ids),
                    n_tokens=mb.n_tokens,
                    n_pad_tokens=mb.n_padded_tokens - mb.n_tokens,
                    cost=mb.cost,
                    t_start=r.t_start,
                    t_data_s=r.t_data_s,
                    t_compute_s=t_compute,
                    mem_peak_bytes=r.peak_bytes,
                    mem_predicted_bytes=mb.predicted_mem_bytes,
                    loss=loss / max(1, r.n_targets),
                    lr=lr,
                    oom_retries=r.oom_retries,
                )
            )


class FusedMicroBatches(MicroBatchRunner):
    """A fused task's runner over keyed samples (k * N + id: member k, N training samples). A micro-batch is one
    fused packed row of its members' samples (train.fused_layout row), or one row per member through the shared
    model (per_variant); either way its gradients are added only once every row's exist (all or nothing, as
    accumulate). Each member's loss is divided by its own global target count in the loss itself, so one backward
    gives each member its separate run's gradients."""

    divides_in_loss = True
    fused: FusedModel
    per_variant: bool
    divide_by: list[float]  # each member's global target count this step
    variant_sums: torch.Tensor  # (K,) this device's token-loss sums this step, read after the step's sync

    def begin_step(self, params: list[torch.nn.Parameter], targets: dict[int, int], n_members: int) -> None:
        self.params = params
        self.divide_by = [float(targets.get(k, 1)) for k in range(n_members)]
        self.variant_sums = torch.zeros(n_members, dtype=torch.float64, device=self.device)

    def member_sums(self, out: DeviceStep) -> torch.Tensor:
        return self.variant_sums

    def pad_tokens(self, out: DeviceStep) -> int:
        return 0  # packed rows of the members' samples side by side: no member's padding

    def key(self, key: int) -> tuple[int, int]:
        return divmod(key, len(self.split.lengths))

    def length(self, sample_id: int) -> int:
        return int(self.split.lengths[self.key(sample_id)[1]])

    def _build(self, keys):
        per_variant: list[list[int]] = [[] for _ in self.fused.members]
        for key in keys:
            k, i = self.key(key)
            per_variant[k].append(i)
        if not self.per_variant:
            return [fused_packed_batch(self.split, per_variant, self.device)]
        alone = [[ids if j == k else [] for j in range(len(per_variant))] for k, ids in enumerate(per_variant) if ids]
        return [fused_packed_batch(self.split, rows, self.device) for rows in alone]

    def forward_backward(self, batches) -> tuple[torch.Tensor, int]:
        """Every row's forward and backward, then their gradients added in row order (all or nothing)."""
        done = [self._row(batch) for batch in batches]
        sums = torch.stack([row_sums for _, row_sums in done]).sum(0)
        for row_grads, _ in done:
            for p, g in zip(self.params, row_grads):
                if g is not None:
                    p.grad = torch.empty_like(p).copy_(g) if p.grad is None else p.grad.add_(g)
        self.variant_sums += sums
        return sums.sum(), sum(sum(b.n_targets) for b in batches)

    def _row(self, batch) -> tuple[tuple, torch.Tensor]:
        """One row's gradients of the trainable weights (None where unused) and its per-member loss sums."""
        with autocast(self.cfg, self.device):
            total, row_sums = fused_loss(self.fused, batch, self.divide_by, as_tensor=True)
        return torch.autograd.grad(total, self.params, allow_unused=True), row_sums.detach()
