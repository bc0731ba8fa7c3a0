"""One process per device: computes its share of every global batch, all-reduces token-weighted gradients and
takes the same optimizer step as every other replica (docs/design/router.md, "The router's invariant").

The router runs on every worker over the same all-gathered state (StepStats), so all workers get the same
assignment without a dispatcher round trip. Routing changes speed and memory, never the math: each worker
sums token losses, gradients are summed across workers and divided by the global batch's token count.

A step, in the Worker's named parts: plan (the router splits the global batch), run micro-batches
(microbatch.py: forward/backward, OOM halving), sync (gradients and loss all-reduced), learn (optimizer
step), observe (every device's StepStats gathered; the router learns), then evaluate and checkpoint when due.
"""

from __future__ import annotations

import math
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from slurm_router.router import MicroBatch
from slurm_router.rundir import events as ev
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.spec import TaskSpec
from slurm_router.train.optim import lr_at
from slurm_router.worker import state as train_state
from slurm_router.worker.decisions import RunDecisions
from slurm_router.worker.microbatch import DeviceStep, batch_tensors, loss_sum
from slurm_router.worker.profile import profile_step, profiled
from slurm_router.worker.prune import Pruned
from slurm_router.worker.setup import COLLECTIVE_TIMEOUT_S  # noqa: F401  (COLLECTIVE_TIMEOUT_S: read from here)
from slurm_router.worker.step_stats import StepPlan, StepStats, plan_digest, step_row


def train(
    spec: TaskSpec, rank: int, world: int, master: str, resume: str | None = None
) -> dict | train_state.Stopped | None:
    """Train spec's task as rank `rank` of `world`, from checkpoint `resume` if given. Returns the result (rank 0),
    None (other ranks), or Stopped after a stop signal (checkpoint saved at a step end, every rank agreeing)."""
    return Worker(spec, rank, world, master, resume).run()


def allreduce_grads(params: list[torch.nn.Parameter], total_tokens: int) -> None:
    """Sum every replica's token-summed gradients in one flat buffer, then divide by the global token count."""
    for p in params:
        if p.grad is None:  # a device that got no samples this step still joins the sum
            p.grad = torch.zeros_like(p)
    flat = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat.div_(total_tokens)
    offset = 0
    for p in params:
        cast(torch.Tensor, p.grad).copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


class Diverged(Exception):
    """The global loss went non-finite at `step` (the lr is the peak lr the task was given). A variant's
    divergence is its result; a base stage's is a failure of the task (raised, one line)."""

    def __init__(self, step: int, loss: float, lr: float, key: str = "train.lr"):
        self.step, self.loss, self.lr = step, loss, lr
        self.message = f"diverged at step {step} (loss {loss}, lr {lr:g})"
        super().__init__(f"{self.message}: lower {key}")


class Worker(RunDecisions):
    """One rank of one task: setup (setup.py), then per step plan -> run micro-batches -> sync -> learn ->
    observe, with evaluate and checkpoint when due."""

    def __init__(self, spec: TaskSpec, rank: int, world: int, master: str, resume: str | None = None):
        self.spec, self.rank, self.world, self.master, self.resume = spec, rank, world, master, resume
        self.paths = TaskPaths(spec.task_dir)
        self.cfg = OmegaConf.create(spec.config)
        self.train_losses: list[float] = []
        self.first_step = 0

    def start(self) -> None:
        """The start row, then the checkpoint to resume from, or the step-0 held-out loss."""
        self.events.write(self.start_row(self.spec, self.n_trainable))
        if self.resume:
            from slurm_router.worker.checkpoint import load_checkpoint

            t0 = time.time()
            self.first_step, self.train_losses = train_state.restore(
                load_checkpoint(self.resume, self.device),
                self.model,
                self.optimizer,
                self.router,
                self.rank,
                self.device,
                self.ckpt_identity,
            )
            self.events.write(ev.CheckpointLoadedRow(step=self.first_step, path=self.resume, t_load_s=time.time() - t0))
            if self.eval_missing([self.paths]):  # an evaluation that failed (eval.metrics) is done again
                self.evaluate(self.first_step)
        else:  # a resumed task measured its step-0 held-out loss in its first attempt
            self.evaluate(0)

    # ---- the loop ----------------------------------------------------------------------------------------
    def run(self) -> dict | train_state.Stopped | None:
        train_state.install_stop_handlers()
        self.setup()
        stopped = self.stopped_in_setup()
        if stopped is not None:
            return stopped
        self.start()
        self.looks = self.watch_looks()
        pruned = self.prune(self.first_step, evaluated=False)  # its variant lost before it started: end at once
        if pruned is not None:
            return pruned.result
        to_profile = profile_step() if self.rank == 0 else None
        for step in range(self.first_step, self.spec.steps):
            ended = (
                profiled(self.train_step, step, self.device, self.spec.task_dir)
                if step == to_profile
                else self.train_step(step)
            )
            if isinstance(ended, Diverged):
                return self.diverged(ended)
            if isinstance(ended, Pruned):
                return ended.result
            if ended is not None:
                return ended
        return self.finish()

    def train_step(self, step: int) -> train_state.Stopped | Diverged | Pruned | None:
        t_step0 = time.time()
        lr = lr_at(step, self.spec.steps, self.spec.lr, self.cfg.train.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        plan = self.plan(step)
        mine = self.micro.run(plan.mine, step, lr)
        busy_s = time.time() - t_step0
        t_sync0 = time.time()
        global_loss_sum = self.sync(mine.loss_sum, plan.target_tokens)
        t_sync = time.time() - t_sync0
        self.learn()
        stats = self.observe(plan, mine, busy_s)
        loss = global_loss_sum / plan.target_tokens
        self.train_losses.append(loss)
        self.events.write(
            step_row(
                plan,
                mine,
                self.telemetry,
                step=step,
                loss=loss,
                n_tokens=sum(plan.lengths),
                n_target_tokens=plan.target_tokens,
                n_samples=len(plan.ids),
                t_step_s=time.time() - t_step0,
                t_sync_wait_s=t_sync,
                lr=lr,
                busy_s=busy_s,
                busy_s_all=[s.busy_s for s in stats],
                n_pad_tokens=sum(mb.n_padded_tokens - mb.n_tokens for mb in mine.done),
            )
        )
        if not math.isfinite(loss):  # the same all-reduced loss on every rank: all of them end here
            return Diverged(step, loss, self.spec.lr)
        every_eval = self.cfg.train.eval_every
        due = every_eval and (step + 1) % every_eval == 0 and step + 1 < self.spec.steps
        if due:
            self.keep_best(step + 1, self.evaluate(step + 1))
        if due or self.look_taken(step, stats):  # an evaluation, or another task's look
            pruned = self.prune(step + 1, evaluated=bool(due))
            if pruned is not None:
                return pruned
        signum = max(s.stop for s in stats)
        stop = signum and step + 1 < self.spec.steps  # a stop during the last step: finishing is quicker
        every = self.cfg.train.checkpoint_every
        if stop or (every and (step + 1) % every == 0):
            self.checkpoint(step + 1, "signal" if stop else "periodic")
        if stop:
            dist.barrier()  # the checkpoint is on disk before any rank exits (srun kills the step then)
            self.close()
            return train_state.Stopped(step + 1, signum)
        return None

    def plan(self, step: int) -> StepPlan:
        """The step's global batch (seeded, the same for any routing) and the router's split of it."""
        ids = self.sampler.batch(step)
        lengths = [int(self.corpus.train.lengths[i]) for i in ids]
        speeds = [d.speed for d in self.router.device_states()]
        assignment = self.router.plan(ids, lengths)  # the router's cost counts every token (lengths)
        return StepPlan(
            ids,
            lengths,
            speeds,
            assignment,
            list(assignment.per_device[self.rank]),
            self.corpus.train.count_targets(ids),
        )

    def sync(self, local_loss_sum: float, total_tokens: int) -> float:
        """Gradients summed over replicas and divided by the global token count; the global loss sum."""
        allreduce_grads(self.params, total_tokens)
        loss_t = torch.tensor([local_loss_sum], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss_t)
        return float(loss_t)

    def learn(self) -> None:
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def observe(self, plan: StepPlan, mine: DeviceStep, busy_s: float) -> list[StepStats]:
        """Every device's StepStats, gathered; the router learns speeds, peaks, OOMs and free memory from them.
        The stop flag rides with them: every rank sees every flag, so all stop after the same step."""
        own = StepStats(
            busy_s=busy_s,
            compute_s=mine.compute_s,
            cost=sum(mb.cost for mb in plan.mine),
            peak_bytes=mine.peak_bytes,
            free_bytes=self.telemetry.free_bytes(),
            oom_count=mine.oom_count,
            oom_padded=mine.oom_mb[0],
            oom_n=mine.oom_mb[1],
            stop=train_state.stop_requested(),
            new_look=int(self.looks.new_look()) if self.looks else 0,
            plan_digest=plan_digest(plan.assignment.per_device),
        )
        stats = [StepStats.unpack(row) for row in self.gather(own.pack())]
        if len({s.plan_digest for s in stats}) > 1:  # never train on: a sample would be lost or doubled
            raise RuntimeError(f"{self.spec.name}: the ranks planned this step differently (a bug: please report it)")
        for d, s in enumerate(stats):
            self.router.observe_step(d, s.cost, s.compute_s, s.peak_bytes or None, list(plan.assignment.per_device[d]))
            if s.oom_count > 0:  # the memory model learns that this size did not fit this device
                self.router.observe_oom(d, MicroBatch(tuple(range(s.oom_n)), 0, s.oom_padded, 0.0, None))
            self.router.set_device_memory(d, self.totals[d], s.free_bytes)
        return stats

    # ---- evaluate, checkpoint, finish --------------------------------------------------------------------
    def evaluate(self, step: int) -> float:
        """Held-out token-weighted loss; each eval batch's samples are spread over the workers."""
        batches, self.eval_t0 = self.eval_ids, time.time()  # t0: the eval row's t_eval_s
        sums = torch.zeros(2 * len(batches), dtype=torch.float64, device=self.device)
        self.model.eval()
        with torch.no_grad():
            for b, ids in enumerate(batches):
                mine = ids[self.rank :: self.world]
                if mine:
                    loss, n = loss_sum(
                        self.model,
                        *cast(
                            "tuple[Any, Any, Any, Any]",
                            batch_tensors(self.corpus.val, mine, self.tokenizer.pad_id, self.device),
                        ),
                        self.cfg,
                        self.device,
                    )
                    sums[2 * b] += loss.double()
                    sums[2 * b + 1] += n
        self.model.train()
        dist.all_reduce(sums)
        self.last_metrics = self.score_metrics(self.model, step)
        self.last_eval, val_loss = self.record_eval(self.events, step, sums, self.last_metrics)
        return val_loss

    def record_eval(self, events, step: int, sums, metrics=None) -> tuple[tuple[list[float], list[int]], float]:
        """One variant's gathered eval sums ([loss sum, tokens] per eval batch) and eval.metrics' scores as its eval
        row, written to events: ((loss sums, tokens), held-out loss). The fused worker records each variant's."""
        s = sums.cpu().tolist()
        loss_sums, tokens = s[0::2], [int(t) for t in s[1::2]]
        val_loss = sum(loss_sums) / max(1, sum(tokens))
        events.write(
            ev.EvalRow(
                step=step,
                val_loss=val_loss,
                val_tokens=sum(tokens),
                batch_loss_sums=loss_sums,
                batch_tokens=tokens,
                batch_sources=self.eval_sources,
                metrics=metrics or ev.OMIT,
                t_metrics_s=self.metric_set.seconds if metrics else ev.OMIT,
                t_eval_s=time.time() - self.eval_t0,
            )
        )
        return (loss_sums, tokens), val_loss

    def checkpoint(self, next_step: int, reason: str) -> None:
        """Collective; rank 0 writes (replicas are identical, only the RNG states differ and are gathered)."""
        from slurm_router.worker.checkpoint import save_checkpoint

        t0 = time.time()
        state = train_state.capture(
            self.model,
            self.optimizer,
            self.router,
            self.train_losses,
            next_step,
            self.world,
            self.device,
            self.ckpt_identity,
        )
        if self.rank == 0:
            assert state is not None
            meta = save_checkpoint(self.paths.checkpoints, next_step, state, self.cfg.train.keep_checkpoints)
            self.events.write(
                ev.CheckpointSavedRow(
                    step=next_step,
                    path=meta["path"],
                    bytes=meta["bytes"],
                    sha256=meta["sha256"],
                    reason=reason,
                    t_save_s=time.time() - t0,
                )
            )

    def finish(self) -> dict | None:
        """The final held-out loss; rank 0's result (and the base weights, for a base stage)."""
        val_loss = self.evaluate(self.spec.steps)
        result, saved = None, {}
        if self.rank == 0:
            tail = self.train_losses[-max(1, len(self.train_losses) // 10) :]
            result = {"val_loss": val_loss, "train_loss": sum(tail) / len(tail), "steps": self.spec.steps}
            if self.spec.save_weights:
                from slurm_router.artifacts import base_cache
                from slurm_router.train.byte_tokenizer import to_transformers

                base_cache.save(
                    self.model,
                    self.spec.save_weights,
                    result,
                    to_transformers(self.tokenizer, self.cfg.model.get("n_positions")),
                )
            else:  # the variant's adapter (adapters.py); the result names it
                saved = self.adapters.final(self.model, self.spec.steps, val_loss, self.judged(self.last_metrics))
        self.events.write(ev.EndRow(exit_state="completed", **cast("dict[str, Any]", result or {})))
        self.close()
        return {**result, **saved} if result is not None else None

    @property
    def adapters(self):
        """Rank 0 of a variant: what saves its adapters (adapters.AdapterSaver), made on first use."""
        if getattr(self, "_adapters", None) is None:
            from slurm_router.artifacts.adapters import AdapterSaver

            self._adapters = AdapterSaver(self.spec, self.cfg, self.tokenizer)
        return self._adapters

    def keep_best(self, step: int, val_loss: float) -> None:
        """After an in-training evaluation: rank 0 of a variant saves adapter-best/ if this one improves it."""
        if self.rank == 0 and not self.spec.save_weights:
            self.adapters.after_eval(self.model, step, val_loss, self.judged(self.last_metrics))

    def diverged(self, d: Diverged) -> dict | None:
        """The loss went non-finite: a variant's result says so (the run goes on, the report lists it as
        diverged at step N with its lr); a base stage fails, since its variants would start from it."""
        self.events.write(ev.EndRow(exit_state="diverged", step=d.step, detail=f"loss {d.loss}"))
        self.close()
        if self.spec.save_weights:
            raise Diverged(d.step, d.loss, d.lr, "base.lr")
        return (
            {"exit_state": "diverged", "step": d.step, "loss": str(d.loss), "lr": d.lr, "message": d.message}
            if self.rank == 0
            else None
        )
