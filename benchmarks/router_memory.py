"""Memory benchmark: a long-tail workload on devices with a memory cap, simulated (no GPU here).

Each device's true peak for a micro-batch follows a memory law the router does not know: TRUE_SCALE x the
router's seeded estimate plus an eager-attention term the seed underrates. A micro-batch whose true peak
exceeds the cap is an out-of-memory error: the worker halves it and retries (as slurm_router.worker does),
and the router's memory model learns from the OOM and from every observed peak.

Compared: a static split (round_robin, one micro-batch per device, no memory model: what DistributedSampler
plus a fixed batch does) against round_robin and balanced with the memory model. Reported: OOM errors per
step (first steps and after warm-up), whether any sample could not be computed at all (an OOM reaching the
user), and predicted vs observed peak after warm-up.
"""
from __future__ import annotations

import statistics

from router_common import GIB, gpt2_small_memory
from slurm_router.router import MemoryModel, Router, RouterSettings
from workloads import lognormal_lengths, sample_batches

TRUE_SCALE = 1.3
TRUE_EXTRA_LEN2 = 0.5         # the true attention term is 1.5x the seed's
CAP_BYTES = 40 * GIB
N_DEVICES, BATCH, STEPS, WARMUP = 4, 64, 40, 10


def true_peak(prior: MemoryModel, mb) -> int:
    n = len(mb.sample_ids)
    f, a, b = prior.prior
    max_len = mb.n_padded_tokens // max(1, n)
    return int(TRUE_SCALE * (f + a * mb.n_padded_tokens + b * (1 + TRUE_EXTRA_LEN2) * n * max_len ** 2))


def simulate(policy: str, with_memory_model: bool, lengths_pool) -> dict:
    prior = gpt2_small_memory()
    model = gpt2_small_memory() if with_memory_model else None
    router = Router(RouterSettings(policy=policy), N_DEVICES, memory_model=model)
    if with_memory_model:
        for d in range(N_DEVICES):
            router.set_device_memory(d, CAP_BYTES)
    ooms, failed, errors = [], 0, []
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
                if true_peak(prior, mb) > CAP_BYTES:
                    if len(mb.sample_ids) == 1:
                        failed += 1            # nothing left to halve: this error would reach the user
                        continue
                    step_ooms += 1
                    router.observe_oom(d, mb)
                    queue[:0] = list(router.split_for_oom(mb, by_id))
                    continue
                observed = true_peak(prior, mb)
                if step >= WARMUP and model is not None and mb.predicted_mem_bytes:
                    errors.append(abs(model.predict_mb(mb) - observed) / observed)
                peak = max(peak, observed)
                done.append(mb)
            router.observe_step(d, sum(m.cost for m in done), 1.0, peak or None, done)
        ooms.append(step_ooms)
    return {"policy": policy if with_memory_model else f"{policy} (static, no memory model)",
            "ooms_first_steps": sum(ooms[:WARMUP]), "ooms_after_warmup": sum(ooms[WARMUP:]),
            "failed_samples": failed,
            "pred_error_median": statistics.median(errors) if errors else None,
            "pred_error_p95": sorted(errors)[int(0.95 * (len(errors) - 1))] if errors else None}


def run() -> dict:
    pool = tuple(lognormal_lengths(20_000, seed=99, mean_len=500.0, sigma=1.0, max_len=2048))
    rows = [simulate("round_robin", False, pool), simulate("round_robin", True, pool),
            simulate("balanced", True, pool)]
    return {"rows": rows, "cap_gib": CAP_BYTES / GIB, "devices": N_DEVICES, "batch": BATCH, "steps": STEPS,
            "warmup": WARMUP}


def to_markdown(res: dict) -> str:
    lines = ["## Memory (simulated devices with a cap; GPT-2 small full fine-tune law, long-tail lengths up to 2048)",
             "", f"{res['devices']} devices x {res['cap_gib']:.0f} GiB cap, {res['batch']} samples per step, "
             f"{res['steps']} steps; the true peak is {TRUE_SCALE}x the router's seed with a {1 + TRUE_EXTRA_LEN2:g}x "
             "attention term, so the router starts optimistic and must learn. An OOM is halved and retried; a "
             "single sample that cannot fit is a failure reaching the user.", "",
             f"| policy | OOM retries, first {res['warmup']} steps | OOM retries after | failed samples | "
             "predicted vs observed peak, median / p95 error |", "|---|---:|---:|---:|---|"]
    for r in res["rows"]:
        err = ("n/a" if r["pred_error_median"] is None
               else f"{100 * r['pred_error_median']:.1f}% / {100 * r['pred_error_p95']:.1f}%")
        lines.append(f"| {r['policy']} | {r['ooms_first_steps']} | {r['ooms_after_warmup']} | {r['failed_samples']} | "
                     f"{err} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(to_markdown(run()))
