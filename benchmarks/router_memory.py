"""Memory benchmark: the router's memory model against real allocations, then a capped long-tail workload.

Measured: real CPU training micro-batches of the GPT-2-shaped models slurm_router builds
(train/model.build_model from a model config), through the worker's own code (microbatch.loss_sum and
microbatch.accumulate, train/optim.make_optimizer's AdamW), one micro-batch of n samples x len tokens per shape.
The peak is the allocator's: every tensor allocation and free that torch's profiler records (profile_memory=True),
from before the model is built, summed in time order; the highest live total during the second step's micro-batch
(forward and backward; the first step's optimizer step made Adam's states) is the measured peak, the CPU
counterpart of torch.cuda.max_memory_allocated. Each config runs in a fresh subprocess, each shape with a freshly
built model and optimizer.

Compared with each measured peak:
  seed    the MemoryModel a worker starts from: MemoryModel.from_model_bytes(**memory_shape(model, cfg, device))
  refit   that model after observe() of every other shape's measured peak (leave one out: the online fit on the
          peaks a worker reports, predicting a shape it has not seen)

Then a cost-model simulation of capped devices on a long-tail workload. Its truth is a law fitted to the measured
peaks of one config (non-negative least squares: fixed + per padded token + per n x len^2; its largest residual
on the measured shapes is printed), not the router's seed; the router starts from its seed and learns from every
observed peak and out-of-memory error. A micro-batch whose true peak exceeds the cap is an out-of-memory error:
the worker halves it and retries (as slurm_router.worker.worker does).

    python benchmarks/router_memory.py            # prints the tables; run_router_benchmarks.py collects them
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from router_common import REPO
from workloads import lognormal_lengths, sample_batches

from slurm_router.router import MemoryModel, Router, RouterSettings
from slurm_router.router.memory_model import _nnls3

MIB = 1 << 20
# name -> model config (conf/model/*.yaml keys) and vocabulary size
CONFIGS = {
    "gpt2_tiny, LoRA r8 (lora_ab's variants)": {
        "model": {
            "n_layer": 2,
            "n_head": 4,
            "n_embd": 128,
            "n_positions": 2048,
            "lora": {"enabled": True, "r": 8, "alpha": 16, "target_modules": ["c_attn", "c_proj"]},
        },
        "vocab": 257,
    },
    "4 layers x 256, vocab 8192, LoRA r16": {
        "model": {
            "n_layer": 4,
            "n_head": 4,
            "n_embd": 256,
            "n_positions": 2048,
            "lora": {"enabled": True, "r": 16, "alpha": 32, "target_modules": ["c_attn", "c_proj"]},
        },
        "vocab": 8192,
    },
    "4 layers x 256, vocab 8192, full training (a base stage)": {
        "model": {"n_layer": 4, "n_head": 4, "n_embd": 256, "n_positions": 2048, "lora": {"enabled": False}},
        "vocab": 8192,
    },
}
SIM_CONFIG = "4 layers x 256, vocab 8192, full training (a base stage)"
SHAPES = ((1, 128), (16, 128), (64, 128), (1, 512), (4, 512), (8, 512), (1, 2048), (2, 2048))  # (n, len)
FAST_SHAPES = ((1, 64), (8, 64), (32, 64), (1, 256), (4, 256), (1, 512), (2, 512))
CAP_SAMPLES = 4  # the cap: what the true law gives CAP_SAMPLES samples of the longest length (rounded up)
N_DEVICES, BATCH, STEPS, WARMUP = 4, 64, 40, 10


# ---- measurement (in a fresh subprocess) -------------------------------------------------------------------------
def _measure_config(spec: dict, shapes) -> dict:
    """In this process: per shape, the allocator's peak over the second step's micro-batch."""
    import gc

    import torch
    from omegaconf import OmegaConf
    from torch.profiler import ProfilerActivity, profile, record_function

    from slurm_router.config.schema import ModelConfig, TrainConfig
    from slurm_router.train.model import build_model, memory_shape, parameter_bytes
    from slurm_router.train.optim import make_optimizer
    from slurm_router.worker.microbatch import accumulate, loss_sum

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), spec["model"])
    cfg = OmegaConf.create({"model": model_cfg, "train": OmegaConf.structured(TrainConfig)})
    device = torch.device("cpu")
    vocab = spec["vocab"]
    out = {"shapes": []}
    for n, length in shapes:
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = build_model(cfg.model, vocab, seed=0, lora=bool(model_cfg.lora.enabled), device=device)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = make_optimizer(params, 1e-4, 0.0, device)
            ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))
            for _ in range(2):
                with record_function("micro-batch"):
                    loss, _ = loss_sum(model, ids, ids, None, None, cfg, device)
                    accumulate(loss, params)
                    del loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        events = prof.profiler.kineto_results.events()
        windows = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == "micro-batch")
        start, end = windows[-1]
        live = peak = 0
        for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
            live += e.nbytes()
            if start <= e.start_ns() <= end:
                peak = max(peak, live)
        if "seed" not in out:
            frozen, trainable = parameter_bytes(model)
            out.update(
                seed=memory_shape(model, cfg, device),
                n_params=sum(p.numel() for p in model.parameters()),
                n_trainable=sum(p.numel() for p in params),
                frozen_bytes=frozen,
                trainable_bytes=trainable,
            )
        out["shapes"].append(
            {"n": n, "len": length, "padded_tokens": n * length, "peak_bytes": peak, "live_after_bytes": live}
        )
        del model, params, optimizer, ids, prof, events
    out["torch"] = torch.__version__
    return out


def measure(fast: bool = False) -> dict:
    """Every config's measured peaks, each config in a fresh interpreter (nothing of the last one's heap)."""
    shapes = FAST_SHAPES if fast else SHAPES
    configs = {k: v for k, v in CONFIGS.items() if not fast or k == SIM_CONFIG}
    res = {}
    for name, spec in configs.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--measure", json.dumps({"spec": spec, "shapes": shapes})],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=1800,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"measuring {name} failed:\n{proc.stderr[-3000:]}")
        res[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        res[name]["vocab"] = spec["vocab"]
    return res


# ---- comparison --------------------------------------------------------------------------------------------------
def seed_model(m: dict) -> MemoryModel:
    return MemoryModel.from_model_bytes(**m["seed"], vocab_size=m["vocab"])


def compare(m: dict) -> list[dict]:
    """Per shape: measured, the seed's prediction, and the refit's on the other shapes' peaks (leave one out)."""
    rows = []
    for i, s in enumerate(m["shapes"]):
        refit = seed_model(m)
        for j, o in enumerate(m["shapes"]):
            if j != i:
                refit.observe(o["padded_tokens"], o["n"], o["len"], o["peak_bytes"])
        seed = seed_model(m).predict(s["padded_tokens"], s["n"], s["len"])
        pred = refit.predict(s["padded_tokens"], s["n"], s["len"])
        rows.append(
            {
                **s,
                "seed_bytes": seed,
                "refit_bytes": pred,
                "seed_error": (seed - s["peak_bytes"]) / s["peak_bytes"],
                "refit_error": (pred - s["peak_bytes"]) / s["peak_bytes"],
            }
        )
    return rows


def fitted_law(m: dict) -> tuple[tuple[float, float, float], float]:
    """(fixed, per token, per n x len^2) fitted to the measured peaks, and its largest relative residual."""
    shapes = m["shapes"]
    coef = _nnls3(
        [(1.0, float(s["padded_tokens"]), float(s["n"] * s["len"] ** 2)) for s in shapes],
        [float(s["peak_bytes"]) for s in shapes],
    )
    f, a, b = coef
    worst = max(
        abs(f + a * s["padded_tokens"] + b * s["n"] * s["len"] ** 2 - s["peak_bytes"]) / s["peak_bytes"] for s in shapes
    )
    return coef, worst


# ---- simulation on capped devices --------------------------------------------------------------------------------
def cap_bytes(law, max_len: int) -> int:
    f, a, b = law
    return -(-int(f + a * CAP_SAMPLES * max_len + b * CAP_SAMPLES * max_len**2) // (64 * MIB)) * 64 * MIB


def simulate(policy: str, with_memory_model: bool, lengths_pool, m: dict, law, cap: int) -> dict:
    f, a, b = law

    def true_peak(mb) -> int:
        n = len(mb.sample_ids)
        max_len = mb.n_padded_tokens // max(1, n)
        return int(f + a * mb.n_padded_tokens + b * n * max_len**2)

    model = seed_model(m) if with_memory_model else None
    router = Router(RouterSettings(policy=policy), N_DEVICES, memory_model=model)
    if with_memory_model:
        for d in range(N_DEVICES):
            router.set_device_memory(d, cap)
    ooms, failed = [], 0
    batches = sample_batches(lengths_pool, BATCH, STEPS, seed=7)
    for step, lengths in enumerate(batches):
        ids = list(range(len(lengths)))
        by_id = dict(zip(ids, lengths))
        plan = router.plan(ids, lengths)
        step_ooms = 0
        for d, mbs in enumerate(plan.per_device):
            queue, peak, done = list(mbs), 0, []
            while queue:
                mb = queue.pop(0)
                if true_peak(mb) > cap:
                    if len(mb.sample_ids) == 1:
                        failed += 1  # nothing left to halve: this error would reach the user
                        continue
                    step_ooms += 1
                    router.observe_oom(d, mb)
                    queue[:0] = list(router.split_for_oom(mb, by_id))
                    continue
                peak = max(peak, true_peak(mb))
                done.append(mb)
            router.observe_step(d, sum(mb.cost for mb in done), 1.0, peak or None, done)
        ooms.append(step_ooms)
    return {
        "policy": policy if with_memory_model else f"{policy} (static, no memory model)",
        "ooms_first_steps": sum(ooms[:WARMUP]),
        "ooms_after_warmup": sum(ooms[WARMUP:]),
        "failed_samples": failed,
    }


def run(fast: bool = False) -> dict:
    measured = measure(fast)
    sim_name = SIM_CONFIG if SIM_CONFIG in measured else next(iter(measured))
    law, residual = fitted_law(measured[sim_name])
    max_len = max(length for _, length in (FAST_SHAPES if fast else SHAPES))
    pool = tuple(lognormal_lengths(20_000, seed=99, mean_len=max_len / 4, sigma=1.0, max_len=max_len))
    cap = cap_bytes(law, max_len)
    sim = [
        simulate(policy, with_model, pool, measured[sim_name], law, cap)
        for policy, with_model in (("round_robin", False), ("round_robin", True), ("balanced", True))
    ]
    return {
        "configs": {
            name: {**{k: v for k, v in m.items() if k != "shapes"}, "rows": compare(m)} for name, m in measured.items()
        },
        "sim": {
            "config": sim_name,
            "law": law,
            "law_max_residual": residual,
            "cap_bytes": cap,
            "devices": N_DEVICES,
            "batch": BATCH,
            "steps": STEPS,
            "warmup": WARMUP,
            "max_len": max_len,
            "mean_len": max_len / 4,
            "rows": sim,
        },
    }


def summary(res: dict) -> dict:
    """Seed and refit errors over every config and shape: median and worst of |error|."""
    rows = [r for c in res["configs"].values() for r in c["rows"]]
    out = {}
    for kind in ("seed", "refit"):
        errs = [abs(r[f"{kind}_error"]) for r in rows]
        worst = max(rows, key=lambda r: abs(r[f"{kind}_error"]))
        out[kind] = {
            "median": statistics.median(errs),
            "max": max(errs),
            "max_at": f"{worst['n']} x {worst['len']}",
            "max_config": next(n for n, c in res["configs"].items() if worst in c["rows"]),
        }
    out["n_shapes"] = len(rows)
    return out


def to_markdown(res: dict) -> str:
    s = summary(res)
    lines = [
        "## Memory: the router's memory model against real allocations (CPU)",
        "",
        "Each row: one training micro-batch (n samples of len tokens each: no padding, so a packed row of "
        "train.packing holds the same tokens) of a model built by "
        "train/model.build_model, run through the worker's loss_sum and accumulate with AdamW's states "
        "allocated; measured = the allocator's peak (torch profiler, profile_memory=True: every tensor "
        "allocation and free since before the model was built), the CPU counterpart of "
        "torch.cuda.max_memory_allocated. seed = MemoryModel.from_model_bytes(memory_shape(...)) as a worker "
        "seeds it; refit = that model after observing the measured peaks of the config's other shapes "
        "(leave one out). Error = predicted / measured - 1. A GPU worker observes this kind of peak "
        "(torch.cuda.max_memory_allocated); a CPU worker observes its process's RSS (telemetry.peak_bytes), "
        "which also counts the interpreter and its libraries.",
        "",
    ]
    for name, c in res["configs"].items():
        lines += [
            f"### {name}",
            "",
            f"{c['n_params'] / 1e6:.2f}M parameters ({c['n_trainable'] / 1e6:.3f}M trained), weights "
            f"{(c['frozen_bytes'] + c['trainable_bytes']) / MIB:.1f} MiB; torch {c['torch']}.",
            "",
            "| n x len | padded tokens | measured peak MiB | seed MiB | seed error | refit MiB | refit error |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in c["rows"]:
            lines.append(
                f"| {r['n']} x {r['len']} | {r['padded_tokens']:,} | {r['peak_bytes'] / MIB:,.1f} | "
                f"{r['seed_bytes'] / MIB:,.1f} | {100 * r['seed_error']:+.1f}% | "
                f"{r['refit_bytes'] / MIB:,.1f} | {100 * r['refit_error']:+.1f}% |"
            )
        lines.append("")
    lines += [
        f"Over all {s['n_shapes']} rows: seed |error| median {100 * s['seed']['median']:.1f}%, worst "
        f"{100 * s['seed']['max']:.1f}% ({s['seed']['max_at']}, {s['seed']['max_config']}); refit |error| "
        f"median {100 * s['refit']['median']:.1f}%, worst {100 * s['refit']['max']:.1f}% "
        f"({s['refit']['max_at']}, {s['refit']['max_config']}).",
        "",
    ]
    sim = res["sim"]
    f, a, b = sim["law"]
    lines += [
        f"## Memory: capped devices, long-tail lengths (simulated; the truth fitted to the measured peaks of "
        f"{sim['config']})",
        "",
        f"{sim['devices']} devices x {sim['cap_bytes'] / MIB:,.0f} MiB cap (the true peak of {CAP_SAMPLES} "
        f"samples of the longest length), {sim['batch']} samples per step (lognormal "
        f"lengths, mean {sim['mean_len']:.0f}, sigma 1, up to {sim['max_len']}), {sim['steps']} steps. True "
        f"peak = {f / MIB:.1f} MiB + {a / 1024:.1f} KiB x padded tokens + {b:.1f} B x n x len^2 (fitted to the "
        f"measured peaks above, largest residual {100 * sim['law_max_residual']:.1f}%); the router starts "
        "from its seed and learns from each peak and OOM (its prediction error against real peaks is the "
        "table above: against a law of its own three terms it would be exact). An OOM is halved and "
        "retried; a single sample that cannot fit is a failure reaching the user.",
        "",
        f"| policy | OOM retries, first {sim['warmup']} steps | OOM retries after | failed samples |",
        "|---|---:|---:|---:|",
    ]
    for r in sim["rows"]:
        lines.append(f"| {r['policy']} | {r['ooms_first_steps']} | {r['ooms_after_warmup']} | {r['failed_samples']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--measure":
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        arg = json.loads(sys.argv[2])
        print(json.dumps(_measure_config(arg["spec"], [tuple(s) for s in arg["shapes"]])))
    else:
        print(to_markdown(run(fast="--fast" in sys.argv)))
