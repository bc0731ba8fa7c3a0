"""One process per device: computes its share of every global batch, all-reduces token-weighted gradients and
takes the same optimizer step as every other replica (docs/design/router.md, "The router's invariant").

The router runs on every worker over the same all-gathered state (StepStats), so all workers get the same
assignment without a dispatcher round trip. Routing changes speed and memory, never the math: each worker
sums token losses, gradients are summed across workers and divided by the global batch's token count.

A task trains a group of members (docs/design/fused.md, "The fused worker"): one for a plain task, K LoRA variants
over one shared base for a fused one. There is one loop for both. A step, in the Worker's named parts: plan (each
member still in the group draws its own global batch; the router splits their union), run micro-batches
(forward/backward, OOM halving), sync (gradients and each member's loss all-reduced), learn (each member's own
schedule, clipping and optimizer step), observe (every device's StepStats gathered; the router learns), then
evaluate, the run's decisions and the checkpoint when due. A member leaves the group when its loss goes non-finite
(the step is computed again without it) or the run prunes it; the task ends when the last one does.
"""

from __future__ import annotations

import math
import time
from typing import cast

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from slurm_router.router import MicroBatch
from slurm_router.rundir import events as ev
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.spec import TaskSpec
from slurm_router.worker import decisions
from slurm_router.worker import state as train_state
from slurm_router.worker.evaluation import eval_missing, eval_row, held_out_sums, judged
from slurm_router.worker.members import Member
from slurm_router.worker.microbatch import DeviceStep
from slurm_router.worker.profile import profile_step, profiled
from slurm_router.worker.setup import COLLECTIVE_TIMEOUT_S, WorkerSetup  # noqa: F401  (COLLECTIVE_TIMEOUT_S: read here)
from slurm_router.worker.step_stats import StepPlan, StepStats, plan_digest, step_row


def train(
    spec: TaskSpec, rank: int, world: int, master: str, resume: str | None = None
) -> dict | train_state.Stopped | None:
    """Train spec's task (and its fused members) as rank `rank` of `world`, from checkpoint `resume` if given.
    Returns the task's result (rank 0), None (other ranks), or Stopped after a stop signal (checkpoint saved at a
    step end, every rank agreeing)."""
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


class Worker(WorkerSetup):
    """One rank of one task: setup (the start-up), then per step plan -> run micro-batches -> sync -> learn ->
    observe, with evaluate, the run's decisions and checkpoint when due, over the members still in the group."""

    def __init__(self, spec: TaskSpec, rank: int, world: int, master: str, resume: str | None = None):
        self.spec, self.rank, self.world, self.master, self.resume = spec, rank, world, master, resume
        self.paths = TaskPaths(spec.task_dir)
        self.cfg = OmegaConf.create(spec.config)
        self.first_step = 0

    # ---- the loop ----------------------------------------------------------------------------------------
    def run(self) -> dict | train_state.Stopped | None:
        train_state.install_stop_handlers()
        self.setup()
        stopped = self.stopped_in_setup()
        if stopped is not None:
            return stopped
        self.start()
        self.looks = decisions.watch_looks(self.cfg, self.spec, self.rank)
        self.decide(self.first_step, evaluated=False)  # members whose variant lost before the task started
        to_profile = profile_step() if self.rank == 0 else None  # SLURM_ROUTER_PROFILE_STEP: one profiled step
        for step in range(self.first_step, self.spec.steps):
            if not self.alive:
                break
            stopped = (
                profiled(self.train_step, step, self.device, self.spec.task_dir)
                if step == to_profile
                else self.train_step(step)
            )
            if stopped is not None:
                return stopped
        return self.finish()

    def start(self) -> None:
        """Each member's start row, then the checkpoint to resume from, or the step-0 held-out loss."""
        for m in self.members:
            m.writer.write(self.start_row(m.spec, m.n_trainable))
        if self.resume:
            self.restore(self.resume)
            tasks = [TaskPaths(m.spec.task_dir) for m in self.alive]
            if eval_missing(self.first_step, self.cfg, self.spec.steps, tasks, self.rank, self.gather):
                self.evaluate(self.first_step)  # an evaluation that failed (eval.metrics) is done again
        else:  # a resumed task measured its step-0 held-out loss in its first attempt
            self.evaluate(0)

    def train_step(self, step: int) -> train_state.Stopped | None:
        t_step0 = time.time()
        alive = self.alive
        lrs = {m.k: m.set_lr(step) for m in alive}  # each member's own schedule
        plan = self.plan(step, alive)
        batches, targets = plan.batches, plan.targets
        self.micro.begin_step([p for m in alive for p in m.params], targets, len(self.members))
        self.micro.events = alive[0].events  # the micro rows: the first member still in the group
        mine = self.micro.run(plan.mine, step, lrs[alive[0].k])
        busy_s = time.time() - t_step0
        t_sync0 = time.time()
        sums = self.sync(mine, plan.target_tokens)
        t_sync = time.time() - t_sync0
        losses = {m.k: float(sums[m.k]) / max(1, targets[m.k]) for m in alive}

        def row(m: Member, t_step_s: float, busy_s_all: list[float]) -> ev.StepRow:
            return step_row(
                plan,
                mine,
                self.telemetry,
                step=step,
                loss=losses[m.k],
                n_tokens=sum(int(self.corpus.train.lengths[i]) for i in batches[m.k]),
                n_target_tokens=targets[m.k],
                n_samples=len(batches[m.k]),
                t_step_s=t_step_s,
                t_sync_wait_s=t_sync,
                lr=lrs[m.k],
                busy_s=busy_s,
                busy_s_all=busy_s_all,
                n_pad_tokens=mine.n_pad_tokens,
            )

        diverged = [m for m in alive if not math.isfinite(losses[m.k])]  # the same all-reduced loss on every rank
        if diverged:  # it leaves now; the others' step is computed again without its activations
            busy_all = [r[0] for r in self.gather([busy_s])]
            for m in diverged:  # its step row first, non-finite loss and all
                m.writer.write(row(m, time.time() - t_step0, busy_all))
                self.leave_diverged(m, step, losses[m.k])
            for m in self.members:
                m.optimizer.zero_grad(set_to_none=True)
            return self.train_step(step) if self.alive else None
        self.learn(alive)
        stats = self.observe(plan, mine, busy_s)
        t_step = time.time() - t_step0
        for m in alive:
            m.train_losses.append(losses[m.k])
            m.writer.write(row(m, t_step, [s.busy_s for s in stats]))
        return self.after_step(step, stats)

    def plan(self, step: int, alive: list[Member]) -> StepPlan:
        """Each member's global batch (seeded, the same for any routing) and the router's split of their union: a
        sample's key is k * N + its id (member k, N training samples; a task alone's keys are its ids)."""
        batches = {m.k: m.sampler.batch(step) for m in alive}
        n = len(self.corpus.train)
        keys = [k * n + i for k, ids in batches.items() for i in ids]
        lengths = [int(self.corpus.train.lengths[i]) for ids in batches.values() for i in ids]
        speeds = [d.speed for d in self.router.device_states()]
        assignment = self.router.plan(keys, lengths)  # the router's cost counts every token (lengths)
        targets = {k: self.corpus.train.count_targets(ids) for k, ids in batches.items()}
        mine = list(assignment.per_device[self.rank])
        return StepPlan(keys, lengths, speeds, assignment, mine, batches, targets)

    def sync(self, mine: DeviceStep, total_tokens: int) -> torch.Tensor:
        """Gradients summed over replicas (divided by the global token count, unless each member's loss already
        was by its own); each member's global loss sum."""
        params = [p for m in self.alive for p in m.params]
        allreduce_grads(params, 1 if self.micro.divides_in_loss else total_tokens)
        sums = mine.member_sums.clone()
        dist.all_reduce(sums)
        return sums

    def learn(self, alive: list[Member]) -> None:
        for m in alive:
            m.learn()

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

    def after_step(self, step: int, stats: list[StepStats]) -> train_state.Stopped | None:
        """The evaluation (adapter-best, the run's decisions) when due, or the decisions after another task's look;
        the checkpoint when due or on a stop signal."""
        every_eval = self.cfg.train.eval_every
        due = every_eval and (step + 1) % every_eval == 0 and step + 1 < self.spec.steps
        if due:
            self.evaluate(step + 1)
            self.keep_best(step + 1)
        look = step + 1 < self.spec.steps and any(s.new_look for s in stats)  # a look taken since the step before
        if due or look:
            self.decide(step + 1, evaluated=bool(due))
            if not self.alive:
                return None
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

    # ---- evaluate ----------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> None:
        """Every member still in the group on the held-out batches (collective); eval.metrics, each member alone;
        each member's eval row."""
        t0 = time.time()  # each eval row's t_eval_s: since the group's evaluation began
        sums = held_out_sums(
            self.group,
            self.corpus.val,
            self.eval_ids,
            self.tokenizer.pad_id,
            self.cfg,
            self.device,
            self.rank,
            self.world,
        )
        dist.all_reduce(sums)
        for m in self.alive:
            m.last_metrics = self.score_metrics(m, step)
            row, m.last_eval, m.last_val = eval_row(
                step, sums[m.k], self.eval_sources, m.last_metrics, self.metric_set.seconds, t0
            )
            m.writer.write(row)

    def score_metrics(self, m: Member, step: int) -> dict:
        """eval.metrics of member m at `step` (collective). A metric that fails keeps a checkpoint of this step first
        (reason eval-failed): resume= evaluates again from it (start)."""
        if not self.metric_set:
            return {}
        from slurm_router.worker.metrics import MetricFailed

        try:
            with self.group.alone(m):
                return self.metric_set.score(self.model, step, self.gather)
        except MetricFailed:
            self.checkpoint(step, "eval-failed")
            raise

    def keep_best(self, step: int) -> None:
        """After an in-training evaluation: rank 0 saves a variant's adapter-best/ if this one improves it."""
        if self.rank != 0 or self.spec.save_weights:
            return
        for m in self.alive:
            m.adapters(self.tokenizer).after_eval(m.adapter_model, step, m.last_val, judged(m.cfg, m.last_metrics))

    # ---- the run's decisions, a member leaving -----------------------------------------------------------
    def decide(self, step: int, evaluated: bool = True) -> None:
        """prune=true: after an in-training evaluation (or, evaluated=False, before the first step and after a step
        in which the run took a look), the run's decision about each member; every rank learns rank 0's answers
        and each pruned or unneeded member leaves the group."""
        alive = self.alive
        if not alive or not decisions.prunes(self.cfg, self.spec.save_weights):
            return
        asked = decisions.ask(alive, step, evaluated, self.eval_sources) if self.rank == 0 else [None] * len(alive)
        flags = self.gather([e.flag if e else 0.0 for e in asked])[0]
        for m, flag, ending in zip(alive, flags, asked):
            if flag:
                ending = ending or decisions.learned(flag)
                self.leave(m, ending.exit_state, step, ending.detail, ending.result, steps_in_row=ending.steps_in_row)

    def leave_diverged(self, m: Member, step: int, loss: float) -> None:
        """Its loss went non-finite: a variant's result says so (the run goes on, the report lists it as diverged
        at step N with its lr); a base stage fails, since its variants would start from it."""
        d = Diverged(step, loss, m.spec.lr)
        result = {"exit_state": "diverged", "step": step, "loss": str(loss), "steps": m.spec.steps}
        self.leave(m, "diverged", step, f"loss {loss}", {**result, "lr": d.lr, "message": d.message})
        if self.spec.save_weights:
            self.close()
            raise Diverged(step, loss, d.lr, "base.lr")

    def leave(self, m: Member, exit_state: str, step: int, detail, result: dict, steps_in_row: bool = False) -> None:
        """m leaves the group: its end row; its result, written now (rank 0) when the task trains on without it
        (the run sees it ended) or it is not the task's own (the job writes that one from train's return)."""
        steps = m.spec.steps if steps_in_row else ev.OMIT
        m.writer.write(ev.EndRow(exit_state=exit_state, step=step, detail=detail, steps=steps))
        m.ended = result
        if self.rank == 0 and (m.k > 0 or self.alive):
            m.write_result(result)

    # ---- checkpoint, restore, finish ---------------------------------------------------------------------
    def checkpoint(self, next_step: int, reason: str) -> None:
        """Collective; rank 0 writes (replicas are identical, only the RNG states differ and are gathered): every
        member's weights, optimizer, losses (and end), the router and the RNG states, in the task's checkpoints/."""
        from slurm_router.worker.checkpoint import save_checkpoint

        t0 = time.time()
        state = train_state.capture_around(
            self.group.checkpoint_payload, self.router, next_step, self.world, self.device, self.group.identity
        )
        if state is None:  # not rank 0
            return
        meta = save_checkpoint(self.paths.checkpoints, next_step, state, self.cfg.train.keep_checkpoints)
        for m in self.alive:
            m.writer.write(
                ev.CheckpointSavedRow(
                    step=next_step,
                    path=meta["path"],
                    bytes=meta["bytes"],
                    sha256=meta["sha256"],
                    reason=reason,
                    t_save_s=time.time() - t0,
                )
            )

    def restore(self, path: str) -> None:
        from slurm_router.worker.checkpoint import load_checkpoint

        t0 = time.time()
        state = load_checkpoint(path, self.device)

        def load(state: dict) -> None:
            self.group.load_payload(state, self.device)

        self.first_step = train_state.restore_around(
            state, load, self.router, self.rank, self.device, self.group.identity
        )
        for m in self.alive:
            m.writer.write(ev.CheckpointLoadedRow(step=self.first_step, path=path, t_load_s=time.time() - t0))

    def finish(self) -> dict | None:
        """The final held-out loss of every member still in the group; each one's adapter (a base stage: the base
        weights), end row and result. Returns the task's own result (rank 0)."""
        alive = self.alive
        if alive:
            self.evaluate(self.spec.steps)
        for m in alive:
            result: dict | None = None
            if self.rank == 0:
                tail = m.train_losses[-max(1, len(m.train_losses) // 10) :]
                result = {"val_loss": m.last_val, "train_loss": sum(tail) / max(1, len(tail)), "steps": m.spec.steps}
            saved = self.save_final(m, result) if result is not None else {}
            m.writer.write(ev.EndRow(exit_state="completed", **(result or {})))
            m.ended = {**result, **saved} if result is not None else {"exit_state": "completed"}
            if result is not None and m.k > 0:
                m.write_result(m.ended)
        self.close()
        return self.members[0].ended if self.rank == 0 else None

    def save_final(self, m: Member, result: dict) -> dict:
        """Rank 0: a base stage's weights into the base cache, or a variant's adapter (the result names it)."""
        if not self.spec.save_weights:
            return m.adapters(self.tokenizer).final(
                m.adapter_model, m.spec.steps, m.last_val, judged(m.cfg, m.last_metrics)
            )
        from slurm_router.artifacts import base_cache
        from slurm_router.train.byte_tokenizer import to_transformers

        tokenizer = to_transformers(self.tokenizer, self.cfg.model.get("n_positions"))
        base_cache.save(self.model, self.spec.save_weights, result, tokenizer)
        return {}
