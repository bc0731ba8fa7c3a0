"""One process per device: computes its share of every global batch, all-reduces token-weighted gradients and
takes the same optimizer step as every other replica.

The router runs on every worker over the same all-gathered state, so all workers get the same assignment
without a dispatcher round trip. Routing changes speed and memory, never the math: each worker sums token
losses, gradients are summed across workers and divided by the global batch's token count.
"""
from __future__ import annotations

import concurrent.futures
import copy
import datetime
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from slurm_router.events import EventWriter
from slurm_router.plan import TaskSpec
from slurm_router.router import MemoryModel, MicroBatch, Router, RouterSettings
from slurm_router.telemetry import Telemetry
from slurm_router.train.data import GlobalBatchSampler, build_corpus, eval_batches, make_tokenizer
from slurm_router.train.loss import target_positions, token_loss_sum
from slurm_router.train.model import build_model, compile_backbone, count_parameters, trainable_parameters
from slurm_router.train.optim import lr_at, make_optimizer
from slurm_router.train import state as train_state

# Per-device facts all-gathered after every step (one small collective, not a poll per decision).
STATS = ("busy_s", "compute_s", "cost", "peak_bytes", "free_bytes", "oom_count", "oom_padded", "oom_n", "stop")
# A collective waits at most this long for a peer. The job process kills the survivors as soon as a worker
# dies, so this only bounds a hang nobody else catches (a peer stuck without dying; srun_workers mode).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("SLURM_ROUTER_COLLECTIVE_TIMEOUT_S", "600"))


class SimulatedOOM(RuntimeError):
    """A CPU worker's stand-in for torch.cuda.OutOfMemoryError (router.cpu_memory_cap_bytes, a testing aid)."""


class CpuMemorySim:
    """Testing aid (router.cpu_memory_cap_bytes): a CPU worker acts as a device of `cap` bytes whose true peak
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
            raise SimulatedOOM(f"micro-batch of {mb.n_padded_tokens} padded tokens needs {self.peak_bytes(mb)} "
                               f"bytes > router.cpu_memory_cap_bytes={self.cap_bytes}")


@dataclass
class Context:
    spec: TaskSpec
    cfg: object
    rank: int
    world: int
    device: torch.device


def _device_name(device: torch.device) -> str:
    """The GPU model (for MFU in the report), or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return platform.processor() or platform.machine() or "cpu"


def _setup(spec: TaskSpec, rank: int, world: int, master: str) -> Context:
    cfg = OmegaConf.create(spec.config)
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        per_worker = max(1, int(os.environ.get("SLURM_CPUS_PER_TASK", "0")) // (1 if "SLURM_PROCID" in os.environ
                                                                               and world > 1 else world))
        threads = int(os.environ.get("SLURM_ROUTER_THREADS", "0")) or (
            per_worker if "SLURM_CPUS_PER_TASK" in os.environ else max(1, (os.cpu_count() or 1) // world))
        torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return Context(spec, cfg, rank, world, device)


def _autocast(ctx: Context):
    p = ctx.cfg.train.precision
    bf16 = p == "bf16" or (p == "auto" and ctx.device.type == "cuda")
    return torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)


def _batch_tensors(split, ids, pad_id: int, device: torch.device, pad_to_multiple: int = 1):
    """Right-padded inputs and labels (-100 at padding so only real next-token targets count), the number of
    real targets and their flat positions: everything the loss needs, built on the host."""
    seqs = [split.sample(i) for i in ids]
    width = -(-max(len(s) for s in seqs) // pad_to_multiple) * pad_to_multiple
    inputs = np.full((len(seqs), width), pad_id, dtype=np.int64)
    labels = np.full((len(seqs), width), -100, dtype=np.int64)
    for r, s in enumerate(seqs):
        inputs[r, :len(s)] = s
        labels[r, :len(s)] = s
    n_targets, index = target_positions([len(s) for s in seqs], width)
    tensors = [torch.from_numpy(inputs), torch.from_numpy(labels), index]
    if device.type == "cuda":      # pinned host memory: the copy overlaps with compute
        tensors = [t.pin_memory() for t in tensors]
    inputs_t, labels_t, index_t = (t.to(device, non_blocking=True) for t in tensors)
    return inputs_t, labels_t, n_targets, index_t


class _Loader:
    """Builds a micro-batch's tensors; with prefetch, the next one is built on a thread while this one computes
    (numpy padding and the pinned host-to-device copy release the GIL)."""
    _pool = None

    def __init__(self, build, prefetch: bool):
        self.build, self.pending = build, {}
        if prefetch and _Loader._pool is None:
            _Loader._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self.pool = _Loader._pool if prefetch else None

    def prefetch(self, ids) -> None:
        if self.pool is not None and ids not in self.pending:
            self.pending[ids] = self.pool.submit(self.build, ids)

    def get(self, ids):
        future = self.pending.pop(ids, None)
        return future.result() if future is not None else self.build(ids)


def _loss_sum(model, inputs, labels, n_targets, target_index, ctx: Context) -> tuple[torch.Tensor, int]:
    with _autocast(ctx):
        return token_loss_sum(model, inputs, labels, ctx.cfg.train.loss_chunk_tokens, n_targets, target_index)


def _allreduce_grads(params: list[torch.nn.Parameter], total_tokens: int) -> None:
    """Sum every replica's token-summed gradients in one flat buffer, then divide by the global token count."""
    for p in params:
        if p.grad is None:          # a device that got no samples this step still joins the sum
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat.div_(total_tokens)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def evaluate(model, val, batches, ctx: Context, pad_id: int) -> tuple[float, list[float], list[int]]:
    """Held-out token-weighted loss; each eval batch's samples are spread over the workers."""
    sums = torch.zeros(2 * len(batches), dtype=torch.float64, device=ctx.device)
    model.eval()
    with torch.no_grad():
        for b, ids in enumerate(batches):
            mine = ids[ctx.rank::ctx.world]
            if mine:
                loss, n = _loss_sum(model, *_batch_tensors(val, mine, pad_id, ctx.device), ctx)
                sums[2 * b] += loss.double()
                sums[2 * b + 1] += n
    model.train()
    dist.all_reduce(sums)
    s = sums.cpu().tolist()
    loss_sums, tokens = s[0::2], [int(t) for t in s[1::2]]
    return sum(loss_sums) / max(1, sum(tokens)), loss_sums, tokens


class _ComputeTimer:
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


def _accumulate(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    """loss.backward(), all or nothing: the micro-batch's gradients are computed apart and added only once
    all exist, so an out-of-memory error halfway through a backward leaves no partial gradient behind for
    the retried halves to add again (backward() accumulates layer by layer as it goes)."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:      # in the parameter's own layout, as backward() would leave it (fused AdamW)
            p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
        else:
            p.grad.add_(g)


def _run_microbatches(model, params, mbs: list[MicroBatch], split, ctx, pad_id, telemetry, mem_sim, router,
                      events, step, lr, slowdown):
    """Forward/backward every micro-batch of this device; on OOM halve and retry (no sample lost or repeated).
    Losses and timings are read once, after the last micro-batch: one host-device sync a step, not one each."""
    queue = list(mbs)
    loader = _Loader(lambda ids: _batch_tensors(split, ids, pad_id, ctx.device, ctx.cfg.train.pad_to_multiple),
                     ctx.cfg.train.prefetch)
    done, ran, oom_count, oom_mb, peak = [], [], 0, (0, 0), 0
    while queue:
        mb = queue.pop(0)
        t0 = time.time()
        batch = loader.get(mb.sample_ids)
        if queue:
            loader.prefetch(queue[0].sample_ids)
        t_data = time.time() - t0
        telemetry.reset_peak()
        try:
            if mem_sim is not None:
                mem_sim.check(mb)
            timer = _ComputeTimer(ctx.device)
            loss, n_tok = _loss_sum(model, *batch, ctx)
            _accumulate(loss, params)
            timer.stop()
        except (torch.cuda.OutOfMemoryError, SimulatedOOM):
            if len(mb.sample_ids) <= 1:
                raise
            del batch
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            oom_count += 1
            oom_mb = max(oom_mb, (mb.n_padded_tokens, len(mb.sample_ids)))   # the largest that failed
            lengths = {i: int(split.lengths[i]) for i in mb.sample_ids}
            queue[:0] = list(router.split_for_oom(mb, lengths))
            continue
        # the allocator's peak is known on the host as soon as the work is queued: no sync needed
        mb_peak = mem_sim.peak_bytes(mb) if mem_sim is not None else telemetry.peak_bytes()
        peak = max(peak, mb_peak)
        ran.append((mb, t0, t_data, timer, loss.detach(), n_tok, mb_peak, oom_count))
        done.append(mb)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    loss_sum, compute_total = 0.0, 0.0
    for micro, (mb, t0, t_data, timer, loss, n_tok, mb_peak, ooms) in enumerate(ran):
        t_compute = timer.seconds()
        if slowdown != 1.0:      # testing aid: make this device look slower, in proportion to its work
            time.sleep(t_compute * (slowdown - 1.0))
            t_compute *= slowdown
        compute_total += t_compute
        loss = float(loss)
        loss_sum += loss
        events.write("micro", step=step, micro=micro, sample_ids=mb.sample_ids, n_samples=len(mb.sample_ids),
                     n_tokens=mb.n_tokens, n_pad_tokens=mb.n_padded_tokens - mb.n_tokens, cost=mb.cost, t_start=t0,
                     t_data_s=t_data, t_compute_s=t_compute, mem_peak_bytes=mb_peak,
                     mem_predicted_bytes=mb.predicted_mem_bytes, loss=loss / max(1, n_tok), lr=lr,
                     oom_retries=ooms)
    return done, loss_sum, compute_total, peak, oom_count, oom_mb


def train(spec: TaskSpec, rank: int, world: int, master: str, resume: str | None = None
          ) -> dict | train_state.Stopped | None:
    """Train spec's task as rank `rank` of `world`, from checkpoint `resume` if given. Returns the result (rank 0),
    None (other ranks), or Stopped after a stop signal (checkpoint saved at a step end, every rank agreeing)."""
    train_state.install_stop_handlers()
    ctx = _setup(spec, rank, world, master)
    cfg = ctx.cfg
    if spec.attempt < 0:            # srun workers (no job process above them): rank 0 counts, the others learn it
        from slurm_router.requeue import next_attempt
        spec.attempt = int(_gather(ctx, [next_attempt(spec.task_dir) if rank == 0 else 0])[0][0])
    tokenizer = make_tokenizer(cfg.model)
    corpus = build_corpus(cfg.data, tokenizer)
    model = build_model(cfg.model, tokenizer.vocab_size, cfg.seed, spec.base_weights, lora=spec.lora).to(ctx.device)
    if cfg.train.compile:
        compile_backbone(model)
    params = trainable_parameters(model)
    n_params, n_trainable = count_parameters(model)
    optimizer = make_optimizer(params, spec.lr, cfg.train.weight_decay, ctx.device)
    telemetry = Telemetry(ctx.device)
    settings = RouterSettings.from_config(cfg.router)
    mem_model = MemoryModel.from_model_sizes(n_params=n_params, n_trainable_params=n_trainable,
                                             hidden_size=model.config.n_embd if hasattr(model.config, "n_embd")
                                             else model.config.hidden_size,
                                             n_layers=getattr(model.config, "n_layer", None)
                                             or model.config.num_hidden_layers,
                                             vocab_size=tokenizer.vocab_size)
    mem_sim, total = None, telemetry.total_bytes()
    if cfg.router.cpu_memory_cap_bytes and ctx.device.type == "cpu":
        mem_sim = CpuMemorySim(cfg.router.cpu_memory_cap_bytes, copy.deepcopy(mem_model))
        total = cfg.router.cpu_memory_cap_bytes
    router = Router(settings, world, memory_model=mem_model)
    totals = [int(row[0]) for row in _gather(ctx, [total])]
    for d, t in enumerate(totals):
        router.set_device_memory(d, t)
    slowdowns = list(cfg.router.device_slowdown) or [1.0]
    slowdown = float(slowdowns[rank % len(slowdowns)])
    sampler = GlobalBatchSampler(len(corpus.train), spec.global_batch_size, cfg.seed)
    evals = eval_batches(corpus.val, cfg.train.eval_batches, cfg.train.eval_batch_size, cfg.seed)
    events = EventWriter(spec.task_dir / f"events-rank{rank}.jsonl", run_id=spec.run_id, task=spec.name,
                         variant=spec.variant, stage=spec.stage, attempt=spec.attempt, device=rank,
                         policy=settings.policy)
    events.write("start", steps=spec.steps, world=world, device_type=ctx.device.type, n_params=n_params,
                 n_trainable_params=n_trainable, global_batch_size=spec.global_batch_size, lr=spec.lr,
                 n_train_samples=len(corpus.train), n_val_samples=len(corpus.val), mem_total_bytes=telemetry.total_bytes(),
                 mem_budget_bytes=[d.mem_budget_bytes for d in router.device_states()], torch=torch.__version__, pid=os.getpid(),
                 cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), resume_from=resume,
                 device_name=_device_name(ctx.device))
    ckpt_identity = {"task": spec.name, "lora": spec.lora, "global_batch_size": spec.global_batch_size}
    first_step, train_losses = 0, []
    if resume:
        from slurm_router.checkpoint import load_checkpoint
        t0 = time.time()
        first_step, train_losses = train_state.restore(load_checkpoint(resume, ctx.device), model, optimizer, router,
                                                       rank, ctx.device, ckpt_identity)
        events.write("checkpoint_loaded", step=first_step, path=resume, t_load_s=time.time() - t0)
    else:           # a resumed task measured its step-0 held-out loss in its first attempt
        val_loss, sums, toks = evaluate(model, corpus.val, evals, ctx, tokenizer.pad_id)
        events.write("eval", step=0, val_loss=val_loss, val_tokens=sum(toks), batch_loss_sums=sums,
                     batch_tokens=toks)
    for step in range(first_step, spec.steps):
        t_step0 = time.time()
        lr = lr_at(step, spec.steps, spec.lr, cfg.train.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = sampler.batch(step)
        lengths = [int(corpus.train.lengths[i]) for i in ids]
        speeds = [d.speed for d in router.device_states()]
        assignment = router.plan(ids, lengths)
        mine = list(assignment.per_device[rank])
        done, loss_sum, compute_s, peak, oom_count, oom_mb = _run_microbatches(
            model, params, mine, corpus.train, ctx, tokenizer.pad_id, telemetry, mem_sim, router, events, step, lr,
            slowdown)
        busy_s = time.time() - t_step0
        total_tokens = sum(L - 1 for L in lengths)
        t_sync0 = time.time()
        _allreduce_grads(params, total_tokens)
        loss_t = torch.tensor([loss_sum], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(loss_t)
        t_sync = time.time() - t_sync0
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        my_cost = sum(mb.cost for mb in mine)
        # The stop flag rides with the step stats: every rank sees every flag, so all stop after the same step.
        stats = _gather(ctx, [busy_s, compute_s, my_cost, peak, telemetry.free_bytes(), oom_count, *oom_mb,
                              train_state.stop_requested()])
        for d, row in enumerate(stats):
            s = dict(zip(STATS, row))
            router.observe_step(d, s["cost"], s["compute_s"], int(s["peak_bytes"]) or None,
                                list(assignment.per_device[d]))
            if s["oom_count"] > 0:      # the memory model learns that this size did not fit this device
                n = int(s["oom_n"])
                router.observe_oom(d, MicroBatch(tuple(range(n)), 0, int(s["oom_padded"]), 0.0, None))
            router.set_device_memory(d, totals[d], int(s["free_bytes"]))
        loss = float(loss_t) / total_tokens
        train_losses.append(loss)
        t_step = time.time() - t_step0
        events.write("step", step=step, loss=loss, n_tokens=sum(lengths), n_target_tokens=total_tokens,
                     n_samples=len(ids), t_step_s=t_step, t_sync_wait_s=t_sync, lr=lr, busy_s=busy_s,
                     busy_s_all=[r[0] for r in stats], planned_cost=assignment.planned_cost(),
                     n_micro=[len(p) for p in assignment.per_device], speed=speeds,
                     cost_balance_ratio=assignment.cost_balance_ratio(), oom_retries=oom_count,
                     n_pad_tokens=sum(mb.n_padded_tokens - mb.n_tokens for mb in done),
                     mem_peak_bytes=peak, mem_total_bytes=telemetry.total_bytes(), util=telemetry.util())
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {step}: the loss is {loss}; lower train.lr")
        if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and step + 1 < spec.steps:
            v, sums, toks = evaluate(model, corpus.val, evals, ctx, tokenizer.pad_id)
            events.write("eval", step=step + 1, val_loss=v, val_tokens=sum(toks), batch_loss_sums=sums,
                         batch_tokens=toks)
        signum = int(max(row[STATS.index("stop")] for row in stats))
        stop = signum and step + 1 < spec.steps       # a stop during the last step: finishing is quicker
        every = cfg.train.checkpoint_every
        if stop or (every and (step + 1) % every == 0):
            _save_checkpoint(ctx, spec, model, optimizer, router, train_losses, step + 1, events, ckpt_identity,
                             "signal" if stop else "periodic")
        if stop:
            dist.barrier()          # the checkpoint is on disk before any rank exits (srun kills the step then)
            events.close()
            dist.destroy_process_group()
            return train_state.Stopped(step + 1, signum)
    val_loss, sums, toks = evaluate(model, corpus.val, evals, ctx, tokenizer.pad_id)
    events.write("eval", step=spec.steps, val_loss=val_loss, val_tokens=sum(toks), batch_loss_sums=sums,
                 batch_tokens=toks)
    result = None
    if rank == 0:
        tail = train_losses[-max(1, len(train_losses) // 10):]
        result = {"val_loss": val_loss, "train_loss": sum(tail) / len(tail), "steps": spec.steps}
        if spec.save_weights:
            from slurm_router.train.model import base_state_dict
            from slurm_router.checkpoint import save_base
            save_base(base_state_dict(model), spec.save_weights, result)
    events.write("end", exit_state="completed", **(result or {}))
    events.close()
    dist.destroy_process_group()
    return result


def _save_checkpoint(ctx: Context, spec: TaskSpec, model, optimizer, router, train_losses, next_step: int, events,
                     identity: dict, reason: str) -> None:
    """Collective; rank 0 writes (replicas are identical, only the RNG states differ and are gathered)."""
    from slurm_router.checkpoint import save_checkpoint
    t0 = time.time()
    state = train_state.capture(model, optimizer, router, train_losses, next_step, ctx.world, ctx.device, identity)
    if ctx.rank == 0:
        meta = save_checkpoint(spec.task_dir / "checkpoints", next_step, state, ctx.cfg.train.keep_checkpoints)
        events.write("checkpoint_saved", step=next_step, path=meta["path"], bytes=meta["bytes"],
                     sha256=meta["sha256"], reason=reason, t_save_s=time.time() - t0)


def _gather(ctx: Context, values: list[float]) -> list[list[float]]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    out = [torch.zeros_like(t) for _ in range(ctx.world)]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]
