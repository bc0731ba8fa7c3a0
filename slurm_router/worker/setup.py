"""A worker's start-up (docs/design/data-flow.md, "Data flow"): device, threads and process group; then the data,
model, optimizer, router and events file; the collectives every step uses (gather) and the end (close). The
Worker (worker.py) is this plus its named steps."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
from typing import Any, cast

import torch
import torch.distributed as dist

from slurm_router.config.testing_aids import testing_aids
from slurm_router.router import MemoryModel, Router, RouterSettings
from slurm_router.rundir import events as ev
from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.spec import TaskSpec
from slurm_router.tracking.trackers import task_sink
from slurm_router.train.data import GlobalBatchSampler, build_corpus, eval_batches
from slurm_router.train.model import build_model, compile_backbone, count_parameters, memory_shape, trainable_parameters
from slurm_router.train.optim import make_optimizer
from slurm_router.train.packed import choose_packing
from slurm_router.train.tokenizer import make_tokenizer
from slurm_router.worker import state as train_state
from slurm_router.worker.cpu import worker_threads
from slurm_router.worker.microbatch import CpuMemorySim, MicroBatchRunner
from slurm_router.worker.prune import LookWatch
from slurm_router.worker.telemetry import Telemetry, device_name

# A collective waits at most this long for a peer. The job process kills the survivors as soon as a worker
# dies, so this only bounds a hang nobody else catches (a peer stuck without dying; srun_workers mode).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("SLURM_ROUTER_COLLECTIVE_TIMEOUT_S", "600"))


class WorkerSetup:
    """The start-up half of a Worker: what setup() builds, every rank the same way."""

    runner_class: type[MicroBatchRunner] = MicroBatchRunner  # what runs a device's micro-batches (fused.py: its own)
    looks: LookWatch | None = None  # prune=true, rank 0: whether the run took a look since the last step

    spec: TaskSpec
    rank: int
    world: int
    master: str
    resume: str | None
    paths: TaskPaths
    cfg: Any

    def setup(self) -> None:
        """Device, threads and process group; then data, model, optimizer, router and the events file."""
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
            # srun workers (attempt < 0, see job.py) are one Slurm task each, with their own allocation
            torch.set_num_threads(worker_threads(1 if self.spec.attempt < 0 else self.world))
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if self.world == 1:  # no peer to meet: an in-process store, so no port can be taken between pick and bind
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://{self.master}", rank=self.rank, world_size=self.world, timeout=timeout
            )
        if self.spec.attempt < 0:  # srun workers (no job process above them): rank 0 counts, the others learn it
            from slurm_router.rundir.attempts import next_attempt

            self.spec.attempt = int(self.gather([next_attempt(self.spec.task_dir) if self.rank == 0 else 0])[0][0])
        self._build()
        self.events = self.events_writer(self.spec)
        self.micro = self.runner_class(
            self.model,
            self.params,
            self.corpus.train,
            self.cfg,
            self.device,
            self.tokenizer.pad_id,
            self.telemetry,
            self.mem_sim,
            self.router,
            self.events,
            self.slowdown,
            self.packed,
        )

    def events_writer(self, spec: TaskSpec) -> ev.EventWriter:
        """This rank's events file of `spec`'s task (a fused task: each variant's), rank 0's with its trackers."""
        paths = TaskPaths(spec.task_dir)
        sink = task_sink(spec, paths.events(0)) if self.rank == 0 else None  # trackers.py, or None
        return ev.EventWriter(
            paths.events(self.rank),
            sink,
            run_id=spec.run_id,
            task=spec.name,
            variant=spec.variant,
            stage=spec.stage,
            attempt=spec.attempt,
            device=self.rank,
            policy=self.settings.policy,
        )

    def start_row(self, spec: TaskSpec, n_trainable: int) -> ev.StartRow:
        """What a worker of `spec`'s task starts with (a fused task: each variant's, its own trainable count)."""
        return ev.StartRow(
            steps=spec.steps,
            world=self.world,
            device_type=self.device.type,
            n_params=self.n_params,
            n_trainable_params=n_trainable,
            global_batch_size=spec.global_batch_size,
            lr=spec.lr,
            n_train_samples=len(self.corpus.train),
            n_val_samples=len(self.corpus.val),
            mem_total_bytes=self.telemetry.total_bytes(),
            mem_budget_bytes=[d.mem_budget_bytes for d in self.router.device_states()],
            torch=torch.__version__,
            pid=os.getpid(),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            resume_from=self.resume,
            device_name=device_name(self.device),
        )

    def _build_data(self) -> None:
        """The tokenizer, the corpus, the held-out batches; the base cache verified (size, sha256) before a
        model loads its weights."""
        cfg = self.cfg
        self.tokenizer = make_tokenizer(cfg.model)
        self.corpus = build_corpus(cfg.data, self.tokenizer)
        self.eval_ids = eval_batches(self.corpus.val, cfg.train.eval_batches, cfg.train.eval_batch_size, cfg.seed)
        self.eval_sources = [sorted({self.corpus.val.source(i) for i in ids}) for ids in self.eval_ids]
        from slurm_router.worker.metrics import MetricSet

        self.metric_set = MetricSet(cfg, self.tokenizer, self.device, self.rank, self.world)
        if self.spec.save_weights:  # the base stage is judged by held-out loss alone
            self.metric_set.items = []
        if self.spec.base_weights:
            from slurm_router.artifacts.base_cache import verify_before_load

            verify_before_load(self.spec.base_weights)

    def _build(self) -> None:
        spec, cfg = self.spec, self.cfg
        self._build_data()
        # the base's init from the config's seed; the LoRA init and the data order from the task's training seed
        self.model = build_model(
            cfg.model,
            cfg.model.vocab_size,
            cfg.seed,
            spec.base_weights,
            lora=spec.lora,
            device=self.device,
            gradient_checkpointing=cfg.train.gradient_checkpointing,
            lora_seed=spec.seed,
        ).to(self.device)
        self.packed = choose_packing(self.model, cfg.train, self.rank == 0)
        if cfg.train.compile:
            compile_backbone(self.model)
        self.params = trainable_parameters(self.model)
        self.n_params, self.n_trainable = count_parameters(self.model)
        self.optimizer = make_optimizer(self.params, spec.lr, cfg.train.weight_decay, self.device)
        self._build_router()
        self.sampler = GlobalBatchSampler(len(self.corpus.train), spec.global_batch_size, cast(int, spec.seed))
        self.ckpt_identity = {"task": spec.name, "lora": spec.lora, "global_batch_size": spec.global_batch_size}

    def _build_router(self) -> None:
        """Telemetry, the router and its memory model (seeded from the model's shape), every device's memory."""
        cfg = self.cfg
        self.telemetry = Telemetry(self.device)
        self.settings = dataclasses.replace(RouterSettings.from_config(cfg.router), packed=self.packed)
        shape = memory_shape(self.model, cfg, self.device)
        self.model_vocab = int(cast(Any, self.model).config.vocab_size)  # the logits' width (not the tokenizer's)
        mem_model = MemoryModel.from_model_bytes(**shape, vocab_size=self.model_vocab)
        self.mem_sim, total = None, self.telemetry.total_bytes()
        aids = testing_aids()  # SLURM_ROUTER_TEST_*: simulated slow devices and small memory (tests only)
        cap = aids.cpu_memory_cap(self.spec.variant)
        if cap and self.device.type == "cpu":
            self.mem_sim, total = CpuMemorySim(cap, copy.deepcopy(mem_model)), cap
        elif self.device.type == "cpu":
            # A CPU worker's observed peak is its whole RSS (telemetry.py): the interpreter, torch's libraries
            # and the corpus are in it before the first micro-batch, and the tensor-only prior under-predicted
            # the first micro-batches ~7x until the online refit. Seed the fixed term with that baseline.
            # Every rank plans with the same router state, so the seed is the ranks' largest baseline, not each
            # rank's own (srun workers are separate processes whose RSS differs: plans diverged, a sample was lost).
            own = self.telemetry.peak_bytes() - shape["frozen_bytes"] - shape["trainable_bytes"]
            baseline = int(max(row[0] for row in self.gather([float(own)])))
            shape["workspace_bytes"] = shape.get("workspace_bytes", 0) + max(0, baseline)
            mem_model = MemoryModel.from_model_bytes(**shape, vocab_size=self.model_vocab)
        self.router = Router(self.settings, self.world, memory_model=mem_model)
        self.totals = [int(row[0]) for row in self.gather([total])]
        for d, t in enumerate(self.totals):
            self.router.set_device_memory(d, t)
        self.slowdown = aids.slowdown(self.spec.variant, self.rank)

    def stopped_in_setup(self) -> train_state.Stopped | None:
        """A stop signal during start-up (it waited, blocked, until the handlers existed: supervisor.py): every
        rank learns of any rank's, and all stop before the first step; the checkpoint resumed from stands."""
        signum = int(max(row[0] for row in self.gather([float(train_state.stop_requested())])))
        if not signum:
            return None
        self.close()
        from slurm_router.rundir.layout import checkpoint_step

        return train_state.Stopped(checkpoint_step(self.resume) if self.resume else 0, signum)

    def score_metrics(self, model: Any, step: int) -> dict:
        """eval.metrics of `model` at `step` (worker/metrics.py; collective). A metric that fails keeps a checkpoint
        of this step first (reason eval-failed): resume= evaluates again from it (Worker.start)."""
        if not self.metric_set:
            return {}
        from slurm_router.worker.metrics import MetricFailed

        try:
            return self.metric_set.score(model, step, self.gather)
        except MetricFailed:
            cast(Any, self).checkpoint(step, "eval-failed")
            raise

    def judged(self, metrics: dict) -> tuple[str, float] | None:
        """(eval.primary, its mean score at the evaluation, signed so that lower is better): what adapter-best/
        keeps the best of when the run judges by a task metric; None: by held-out loss."""
        primary = str((self.cfg.get("eval") or {}).get("primary") or "loss")
        m = metrics.get(primary)
        if not m:
            return None
        mean = sum(m["scores"]) / max(1, len(m["scores"]))
        return primary, -mean if m["higher_is_better"] else mean

    def eval_missing(self, tasks: list[TaskPaths]) -> bool:
        """resume= from a checkpoint at an evaluation step whose evaluation no task of `tasks` recorded (eval.metrics
        failed there): rank 0 reads their events, every rank learns it (collective). An evaluation counts once."""
        s, every = cast(Any, self).first_step, self.cfg.train.eval_every
        if not (s == 0 or (every and s % every == 0 and s < self.spec.steps)):
            return False
        missing = 0.0
        if self.rank == 0:
            for paths in tasks:
                try:
                    rows = ev.scan_events(paths.events(0))[0]
                except OSError:
                    rows = []
                if not any(r.get(ev.EVENT) == ev.EvalRow.KIND and r.get("step") == s for r in rows):
                    missing = 1.0
        return bool(self.gather([missing])[0][0])

    def close(self) -> None:
        self.events.close()
        dist.destroy_process_group()

    def gather(self, values: list[float]) -> list[list[float]]:
        """All-gather one small float64 row per rank."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [o.cpu().tolist() for o in out]
