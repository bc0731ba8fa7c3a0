"""A fused task's worker (docs/design/fused.md, "Fused variants"): K LoRA variants of one base, one forward and
backward a step over all their samples, each variant exactly as if alone.

Per step: every variant still in the group draws its own global batch (its own sampler and seed); the router
splits the union of their samples across the task's devices (a sample's key is k * N + its id: variant k, N
training samples), as it splits one variant's; each micro-batch is one packed row with the variants' samples
side by side (fused_lora.fused_packed_batch), or one row per variant (train.fused_layout); the loss gives each variant its token losses over its own global
target count, so one backward gives each its separate run's gradients; gradients are summed across devices; each
variant clips and steps its own optimizer. Each variant writes its own events, evaluations, adapters and result
in its own task directory. A variant that diverges or is pruned leaves the group at that step (a step where one
diverges is computed again without it: its non-finite activations must not reach the others); the task ends
when the last one does. The group's checkpoint (leader's checkpoints/) holds every variant's state.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, cast

import torch
import torch.distributed as dist

from slurm_router.rundir import events as ev
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.spec import TaskSpec
from slurm_router.train.fused_lora import fused_loss, fused_packed_batch
from slurm_router.train.packed import choose_packing
from slurm_router.worker import state as train_state
from slurm_router.worker.fused_variants import (
    FusedMicroBatches,
    MemberAdapter,
    Variant,
    build_fused,
    make_variants,
    restore_variant,
    variant_state,
)
from slurm_router.worker.microbatch import autocast
from slurm_router.worker.profile import profile_step, profiled
from slurm_router.worker.step_stats import StepPlan, step_row
from slurm_router.worker.worker import Worker, allreduce_grads


class FusedWorker(Worker):
    """Worker's loop (run, stop handling, observe) over a group of variants; train_step, evaluate, checkpoint
    and finish act on each variant."""

    runner_class = FusedMicroBatches

    def _build(self) -> None:
        cfg = self.cfg
        self._build_data()
        self.specs = self.spec.group_specs()
        self.fused, cfgs = build_fused(
            self.specs, cfg.model.vocab_size, cfg.seed, self.device, cfg.train.gradient_checkpointing
        )
        self.model = self.fused.model.to(self.device)
        if not choose_packing(self.model, cfg.train, False):
            raise RuntimeError(
                f"{self.spec.name}: fused variants train packed rows, and this model cannot take them "
                "(train.packing): set resources.fuse_variants=1"
            )
        self.variants = make_variants(self.fused, self.specs, cfgs, len(self.corpus.train), self.device)
        self.params = [p for v in self.variants for p in v.params]
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.packed = True  # the fused rows are packed
        self._build_router()
        self.ckpt_identity = {"task": self.spec.name, "members": [s.name for s in self.specs], "fused": True}

    def setup(self) -> None:
        """WorkerSetup.setup (its events file is the leader's), then every other variant's events and the fused runner."""
        super().setup()
        self.variants[0].events = self.events
        for v in self.variants[1:]:
            v.events = self.events_writer(v.spec)
        runner = cast(FusedMicroBatches, self.micro)
        runner.fused = self.fused
        layout = str(self.cfg.train.fused_layout)
        runner.per_variant = layout == "per_variant" or (layout == "auto" and self.device.type == "cpu")

    @property
    def alive(self) -> list[Variant]:
        return [v for v in self.variants if v.ended is None]

    def start(self) -> None:
        for v in self.variants:
            cast(ev.EventWriter, v.events).write(self.start_row(v.spec, sum(p.numel() for p in v.params)))
        if self.resume:
            self._restore()
            if self.eval_missing([TaskPaths(v.spec.task_dir) for v in self.alive]):  # a failed evaluation, again
                self.evaluate(self.first_step)
        else:
            self.evaluate(0)

    # ---- a step ---------------------------------------------------------------------------------------------
    def train_step(self, step: int) -> train_state.Stopped | None:
        t_step0 = time.time()
        alive = self.alive
        lrs = {v.k: v.set_lr(step) for v in alive}
        batches = {v.k: v.sampler.batch(step) for v in alive}
        plan = self.plan_fused(batches)
        runner = cast(FusedMicroBatches, self.micro)
        runner.params = [p for v in alive for p in v.params]
        targets = {v.k: self.corpus.train.count_targets(batches[v.k]) for v in alive}
        runner.divide_by = [float(targets.get(k, 1)) for k in range(len(self.variants))]
        runner.variant_sums = torch.zeros(len(self.variants), dtype=torch.float64, device=self.device)
        runner.events = alive[0].events  # the micro rows: the first variant still in the group
        mine = self.micro.run(plan.mine, step, lrs[alive[0].k])
        busy_s = time.time() - t_step0
        t_sync0 = time.time()
        allreduce_grads(runner.params, 1)  # the fused loss divided each variant by its own global targets
        sums = runner.variant_sums.clone()
        dist.all_reduce(sums)
        t_sync = time.time() - t_sync0
        losses = {v.k: float(sums[v.k]) / max(1, targets[v.k]) for v in alive}
        diverged = [v for v in alive if not math.isfinite(losses[v.k])]
        if diverged:  # it leaves now; the others' step is computed again without its activations
            busy_all = [row[0] for row in self.gather([busy_s])]
            for v in diverged:  # its step row first, non-finite loss and all, as a task alone records it
                row = self._step_row(v, step, batches[v.k], targets[v.k], losses[v.k], lrs[v.k], plan, mine)
                cast(ev.EventWriter, v.events).write(
                    row(t_step_s=time.time() - t_step0, t_sync_wait_s=t_sync, busy_s=busy_s, busy_s_all=busy_all)
                )
                self._leave(v, "diverged", step, detail=f"loss {losses[v.k]}", extra={"loss": str(losses[v.k])})
            for v in self.variants:
                v.optimizer.zero_grad(set_to_none=True)
            return self.train_step(step) if self.alive else None
        for v in alive:
            v.learn()
        stats = self.observe(plan, mine, busy_s)
        t_step = time.time() - t_step0
        for v in alive:
            v.train_losses.append(losses[v.k])
            row = self._step_row(v, step, batches[v.k], targets[v.k], losses[v.k], lrs[v.k], plan, mine)
            cast(ev.EventWriter, v.events).write(
                row(t_step_s=t_step, t_sync_wait_s=t_sync, busy_s=busy_s, busy_s_all=[s.busy_s for s in stats])
            )
        return self._after_step(step, stats)

    def _step_row(self, v: Variant, step: int, batch: list[int], targets: int, loss: float, lr: float, plan, mine):
        """A variant's step row, less its times (given when the step's are known)."""
        return functools.partial(
            step_row,
            plan,
            mine,
            self.telemetry,
            step=step,
            loss=loss,
            n_tokens=sum(int(self.corpus.train.lengths[i]) for i in batch),
            n_target_tokens=targets,
            n_samples=len(batch),
            lr=lr,
            n_pad_tokens=0,
        )

    def plan_fused(self, batches: dict[int, list[int]]) -> StepPlan:
        n = len(self.corpus.train)
        keys = [k * n + i for k, ids in batches.items() for i in ids]
        lengths = [int(self.corpus.train.lengths[i]) for ids in batches.values() for i in ids]
        speeds = [d.speed for d in self.router.device_states()]
        assignment = self.router.plan(keys, lengths)
        return StepPlan(keys, lengths, speeds, assignment, list(assignment.per_device[self.rank]), 0)

    def _after_step(self, step: int, stats) -> train_state.Stopped | None:
        """Evaluation (adapter-best, prune) when due; the checkpoint when due or on a stop signal."""
        every_eval = self.cfg.train.eval_every
        if every_eval and (step + 1) % every_eval == 0 and step + 1 < self.spec.steps:
            self.evaluate(step + 1)
            if self.rank == 0:
                for v in self.alive:
                    member, judged = MemberAdapter(v.member), self.judged(v.last_metrics)
                    v.adapters(self.tokenizer).after_eval(member, step + 1, self._last_val[v.k], judged)
            self._prune(step + 1)
        elif self.look_taken(step, stats):  # another task's look
            self._prune(step + 1, evaluated=False)
        signum = max(s.stop for s in stats)
        stop = signum and step + 1 < self.spec.steps
        every = self.cfg.train.checkpoint_every
        if self.alive and (stop or (every and (step + 1) % every == 0)):
            self.checkpoint(step + 1, "signal" if stop else "periodic")
        if stop:
            dist.barrier()
            self.close()
            return train_state.Stopped(step + 1, signum)
        return None

    # ---- leaving the group, evaluating, checkpointing, finishing -------------------------------------------
    def _leave(self, v: Variant, exit_state: str, step: int, detail: str | None, extra: dict) -> None:
        cast(ev.EventWriter, v.events).write(ev.EndRow(exit_state=exit_state, step=step, detail=detail))
        v.ended = {"exit_state": exit_state, "step": step, **extra, "steps": v.spec.steps}
        if exit_state == "diverged":
            v.ended["lr"] = v.spec.lr
            v.ended["message"] = f"diverged at step {step} ({detail}, lr {v.spec.lr:g})"
        if self.rank == 0:
            v.write_result(v.ended)

    def _prune(self, step: int, evaluated: bool = True) -> None:
        if not self.cfg.get("prune"):
            return
        from slurm_router.worker.prune import decide_after, decided, record, run_schedule

        alive = self.alive
        decisions: list[Any] = [None] * len(alive)
        if self.rank == 0 and not evaluated:
            decisions = [decided(v.spec, step) for v in alive]
        elif self.rank == 0:  # every variant's evaluation is recorded before any is decided
            for v in alive:
                seed = cast(int, v.spec.seed)
                record(v.spec.task_dir, step, v.spec.variant, seed, *v.last_eval, self.eval_sources, v.last_metrics)
            schedule = run_schedule(self.spec.run_dir)  # the run's, as its plan fixed it: one for every member
            for i, v in enumerate(alive):
                decisions[i] = decide_after(v.spec, step, schedule)
        flags = self.gather([1.0 if d else 0.0 for d in decisions])[0]
        for v, flag, d in zip(alive, flags, decisions):
            if flag:
                if self.rank == 0:
                    print(d.reason, flush=True)
                self._leave(v, "pruned", step, d.reason if d else None, d.as_dict() if d else {})

    def evaluate(self, step: int) -> float:
        """Every variant still in the group on the same held-out batches, side by side in one forward each."""
        self.eval_t0 = time.time()  # each variant's eval row: t_eval_s since the group's evaluation began
        alive, batches = self.alive, self.eval_ids
        k_all = len(self.variants)
        sums = torch.zeros(k_all, 2 * len(batches), dtype=torch.float64, device=self.device)
        live = {v.k for v in alive}
        self.model.eval()
        with torch.no_grad():
            for b, ids in enumerate(batches):
                mine = ids[self.rank :: self.world]
                if not mine:
                    continue
                batch = fused_packed_batch(
                    self.corpus.val, [mine if k in live else [] for k in range(k_all)], self.device
                )
                with autocast(self.cfg, self.device):
                    _, loss_sums = fused_loss(self.fused, batch, [1.0] * k_all, as_tensor=True)
                sums[:, 2 * b] += loss_sums.double()
                sums[:, 2 * b + 1] += torch.tensor(batch.n_targets, dtype=torch.float64, device=self.device)
        self.model.train()
        dist.all_reduce(sums)
        self._last_val = {}
        for v in alive:  # eval.metrics: each variant through the shared model with its own adapter alone
            self.fused.segments.only = v.k
            try:
                v.last_metrics = self.score_metrics(self.model, step)
            finally:
                self.fused.segments.only = None
            v.last_eval, self._last_val[v.k] = self.record_eval(v.events, step, sums[v.k], v.last_metrics)
        return self._last_val[alive[0].k] if alive else float("nan")

    def checkpoint(self, next_step: int, reason: str) -> None:
        from slurm_router.worker.checkpoint import save_checkpoint

        t0 = time.time()
        state = train_state.capture_around(
            lambda: {"variants": {v.spec.name: variant_state(v) for v in self.variants}},
            self.router,
            next_step,
            self.world,
            self.device,
            self.ckpt_identity,
        )
        if state is None:  # not rank 0
            return
        meta = save_checkpoint(self.paths.checkpoints, next_step, state, self.cfg.train.keep_checkpoints)
        for v in self.alive:
            cast(ev.EventWriter, v.events).write(
                ev.CheckpointSavedRow(
                    step=next_step,
                    path=meta["path"],
                    bytes=meta["bytes"],
                    sha256=meta["sha256"],
                    reason=reason,
                    t_save_s=time.time() - t0,
                )
            )

    def _restore(self) -> None:
        from slurm_router.worker.checkpoint import load_checkpoint

        t0 = time.time()
        state = load_checkpoint(cast(str, self.resume), self.device)

        def load(state: dict) -> None:
            for v in self.variants:
                restore_variant(v, state["variants"][v.spec.name], self.device)

        self.first_step = train_state.restore_around(
            state, load, self.router, self.rank, self.device, self.ckpt_identity
        )
        for v in self.alive:
            cast(ev.EventWriter, v.events).write(
                ev.CheckpointLoadedRow(step=self.first_step, path=cast(str, self.resume), t_load_s=time.time() - t0)
            )

    def run(self) -> dict | train_state.Stopped | None:
        train_state.install_stop_handlers()
        self.setup()
        stopped = self.stopped_in_setup()
        if stopped is not None:
            return stopped
        self.start()
        self.looks = self.watch_looks()
        self._prune(self.first_step, evaluated=False)  # members whose variant lost before the group started
        to_profile = profile_step() if self.rank == 0 else None  # SLURM_ROUTER_PROFILE_STEP (profile.py)
        for step in range(self.first_step, self.spec.steps):
            if not self.alive:
                break
            ended = (
                profiled(self.train_step, step, self.device, self.spec.task_dir)
                if step == to_profile
                else self.train_step(step)
            )
            if ended is not None:
                return ended
        return self.finish()

    def finish(self) -> dict | None:
        """The final held-out loss of every variant still in the group; each one's adapter, end row and result."""
        alive = self.alive
        if alive:
            self.evaluate(self.spec.steps)
        for v in alive:
            val_loss = self._last_val[v.k]
            result: dict[str, Any] | None = None
            if self.rank == 0:
                tail = v.train_losses[-max(1, len(v.train_losses) // 10) :]
                result = {"val_loss": val_loss, "train_loss": sum(tail) / max(1, len(tail)), "steps": v.spec.steps}
            cast(ev.EventWriter, v.events).write(ev.EndRow(exit_state="completed", **(result or {})))
            if result is not None:
                member, judged = MemberAdapter(v.member), self.judged(v.last_metrics)
                result.update(v.adapters(self.tokenizer).final(member, v.spec.steps, val_loss, judged))
                v.write_result(result)
            v.ended = result or {"exit_state": "completed"}
        self.close()
        return self.variants[0].ended if self.rank == 0 else None

    def close(self) -> None:
        for v in self.variants[1:]:
            if v.events is not None:
                v.events.close()
        super().close()


def train_fused(spec: TaskSpec, rank: int, world: int, master: str, resume: str | None = None):
    return FusedWorker(spec, rank, world, master, resume).run()
