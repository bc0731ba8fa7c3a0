"""Decision cost: wall time of one plan (one global batch) per policy, and why not to poll a GPU per decision.

The "poll per decision" router is least_loaded done the tutorial way: before placing each sample it asks every
device for its allocated memory. The call is simulated: a busy-wait of 136 us, the cost of
torch.cuda.memory_allocated measured on an H100 (DESIGN.md; nvmlDeviceGetMemoryInfo is about 10 us). A
busy-wait, because time.sleep cannot resolve 136 us. Our routers read telemetry the workers already reported.

    python benchmarks/router_decision_cost.py
"""
from __future__ import annotations

import time

from router_common import POLICIES, busy_wait_ns, fleet, gpt2_small_memory, median, pools, sample_batches

from slurm_router.router import Router, RouterSettings

SHAPES = ((4, 32), (64, 1024))        # (devices, samples per global batch)
TARGET_US = {(4, 32): 50.0, (64, 1024): 1000.0}
POLL_COST_NS = 136_000


def _time_plans(router: Router, batches: list[list[int]], devices, reps: int) -> float:
    ids = list(range(len(batches[0])))
    for b in batches[:3]:                 # warm caches / first-call costs out of the figure
        router.plan(ids, b, devices)
    samples = []
    for i in range(reps):
        b = batches[i % len(batches)]
        t0 = time.perf_counter_ns()
        router.plan(ids, b, devices)
        samples.append(time.perf_counter_ns() - t0)
    return median(samples) / 1000.0


def poll_per_decision_plan(lengths: list[int], n_devices: int, polls_per_decision: int) -> list[list[int]]:
    """least_loaded with a (simulated) GPU memory query per device per sample, the anti-pattern."""
    given = [0] * n_devices
    bins: list[list[int]] = [[] for _ in range(n_devices)]
    for p in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
        for _ in range(polls_per_decision):
            busy_wait_ns(POLL_COST_NS)
        d = min(range(n_devices), key=lambda d: (given[d], d))
        given[d] += lengths[p]
        bins[d].append(p)
    return bins


def run(fast: bool = False) -> dict:
    pool = pools()["lognormal (mean 96, sigma 0.8, 8-512)"]
    std = pools()["stdlib (512 B pieces)"]
    rows = []
    for n_dev, n in SHAPES:
        reps = 2000 if n <= 64 else 200
        if fast:
            reps //= 10
        row = {"devices": n_dev, "batch": n, "target_us": TARGET_US[(n_dev, n)], "reps": reps}
        for name, src in (("lognormal", pool), ("stdlib", std)):
            batches = sample_batches(src, n, 50, seed=n_dev)
            for policy in POLICIES:
                router = Router(RouterSettings(policy=policy), n_dev, gpt2_small_memory())
                row[f"{policy}/{name}"] = _time_plans(router, batches, fleet([1.0] * n_dev), reps)
        lengths = sample_batches(pool, n, 1, seed=7)[0]
        # one poll per decision: measured when it fits the time budget, else extrapolated
        if n * POLL_COST_NS <= 0.2e9:
            t0 = time.perf_counter_ns()
            poll_per_decision_plan(lengths, n_dev, 1)
            row["poll_once_per_sample_us"] = (time.perf_counter_ns() - t0) / 1000.0
            row["poll_once_measured"] = True
        else:
            row["poll_once_per_sample_us"] = n * POLL_COST_NS / 1000.0
            row["poll_once_measured"] = False
        # every device per decision (the tutorial's loop): n * D calls
        if n * n_dev * POLL_COST_NS <= 0.2e9:
            t0 = time.perf_counter_ns()
            poll_per_decision_plan(lengths, n_dev, n_dev)
            row["poll_all_devices_per_sample_us"] = (time.perf_counter_ns() - t0) / 1000.0
            row["poll_all_measured"] = True
        else:
            row["poll_all_devices_per_sample_us"] = n * n_dev * POLL_COST_NS / 1000.0
            row["poll_all_measured"] = False
        rows.append(row)
    return {"rows": rows, "poll_cost_us": POLL_COST_NS / 1000.0}


def to_markdown(res: dict) -> str:
    lines = ["## Decision cost (median us per global batch, pure Python, GPT-2-small memory model, "
             "equal 80 GiB devices)", "",
             "| D x batch | target | " + " | ".join(f"{p} (lognormal / stdlib)" for p in POLICIES)
             + " | poll 1x per sample | poll every device per sample |",
             "|---|---:|" + "---:|" * len(POLICIES) + "---:|---:|"]
    for r in res["rows"]:
        cells = " | ".join(f"{r[p + '/lognormal']:.0f} / {r[p + '/stdlib']:.0f}" for p in POLICIES)
        once = f"{r['poll_once_per_sample_us']:,.0f}" + ("" if r["poll_once_measured"] else " (extrapolated)")
        every = f"{r['poll_all_devices_per_sample_us']:,.0f}" + ("" if r["poll_all_measured"] else " (extrapolated)")
        lines.append(f"| {r['devices']} x {r['batch']} | <= {r['target_us']:.0f} | {cells} | {once} | {every} |")
    lines += ["", f"Polling columns: a simulated torch.cuda.memory_allocated of {res['poll_cost_us']:.0f} us "
              "(busy-wait; measured on an H100 per DESIGN.md) before each sample's decision, once or once per "
              "device; extrapolated = calls x 136 us where measuring would take over 0.2 s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(to_markdown(run()))
