"""A worker's start-up (docs/design/data-flow.md, "Data flow"): device, threads and process group; then the data,
the members the task trains (one, or a fused group's K), the router, each member's events file and the micro-batch
runner; the collectives every step uses (gather) and the end (close). The Worker is this plus its loop.
"""

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
from slurm_router.train.data import build_corpus, eval_batches
from slurm_router.train.model import memory_shape
from slurm_router.train.tokenizer import make_tokenizer
from slurm_router.worker import state as train_state
from slurm_router.worker.cpu import worker_threads
from slurm_router.worker.members import Group, Member, build_group
from slurm_router.worker.microbatch import CpuMemorySim, FusedMicroBatches, MicroBatchRunner
from slurm_router.worker.prune import LookWatch
from slurm_router.worker.telemetry import Telemetry, device_name

# A collective waits at most this long for a peer. The job process kills the survivors as soon as a worker
# dies, so this only bounds a hang nobody else catches (a peer stuck without dying; srun_workers mode).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("SLURM_ROUTER_COLLECTIVE_TIMEOUT_S", "600"))


class WorkerSetup:
    """The start-up of a Worker: what setup() builds, every rank the same way."""

    looks: LookWatch | None = None  # prune=true, rank 0: whether the run took a look since the last step
    group: Group  # the members the task trains

    spec: TaskSpec
    rank: int
    world: int
    master: str
    resume: str | None
    paths: TaskPaths
    cfg: Any

    def setup(self) -> None:
        """Device, threads and process group; then data, members, router, the events files and the runner."""
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
        for m in self.group.members:  # each member writes in its own task directory
            m.events = self.events_writer(m.spec)
        self.micro = self._runner()

    @property
    def members(self) -> list[Member]:
        return self.group.members

    @property
    def alive(self) -> list[Member]:
        """The members still in the group (not yet completed, pruned or diverged)."""
        return self.group.alive

    def _runner(self) -> MicroBatchRunner:
        """What runs this device's micro-batches: a task alone's, or a fused group's over keyed samples."""
        fused = self.group.fused
        runner = (MicroBatchRunner if fused is None else FusedMicroBatches)(
            self.model,
            self.members[0].params,
            self.corpus.train,
            self.cfg,
            self.device,
            self.tokenizer.pad_id,
            self.telemetry,
            self.mem_sim,
            self.router,
            self.members[0].events,
            self.slowdown,
            self.packed,
        )
        if isinstance(runner, FusedMicroBatches):
            runner.fused = cast(Any, fused)
            layout = str(self.cfg.train.fused_layout)
            runner.per_variant = layout == "per_variant" or (layout == "auto" and self.device.type == "cpu")
        return runner

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
        row = ev.StartRow(
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
        if self.device.type == "cpu":  # MFU against this machine's matmul peak at the worker's threads
            row.threads = torch.get_num_threads()
        for name, value in model_shape(self.model).items():  # attention's FLOPs in MFU
            setattr(row, name, value)
        return row

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
        self._build_data()
        self.group = build_group(self.spec, self.cfg, len(self.corpus.train), self.device, self.rank == 0)
        self.model, self.packed, self.n_params = self.group.model, self.group.packed, self.group.n_params
        self._build_router()

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

    def close(self) -> None:
        for m in self.members:
            if m.events is not None:
                m.events.close()
        dist.destroy_process_group()

    def gather(self, values: list[float]) -> list[list[float]]:
        """All-gather one small float64 row per rank."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [o.cpu().tolist() for o in out]


def model_shape(model) -> dict:
    """{n_layer, d_model} of a transformer's config (GPT-2's names or Llama's), for attention's FLOPs in MFU; {} when
    the config does not say."""
    config = getattr(model, "config", None)
    n_layer = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    d_model = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    return {"n_layer": int(n_layer), "d_model": int(d_model)} if n_layer and d_model else {}
