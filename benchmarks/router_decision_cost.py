"""Decision cost: wall time of one plan (one global batch) per policy, and why not to poll a GPU per decision.

The "poll per decision" router is least_loaded done the tutorial way: before placing each sample it asks every
device for its allocated memory. The call is simulated by a busy-wait (time.sleep cannot resolve tens of us) of
the per-call cost a GPU measured: benchmarks/results/poll_cost-cuda.json, written by benchmarks/poll_cost.py on
the device named in poll_cost-cuda.md (torch.cuda.memory_allocated, and NVML's nvmlDeviceGetMemoryInfo beside
it). Without that file the polling columns are left out. Our routers read telemetry the workers already reported.

    python benchmarks/router_decision_cost.py
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from router_common import POLICIES, busy_wait_ns, fleet, gpt2_small_memory, median, pools, sample_batches

from slurm_router.router import Router, RouterSettings

SHAPES = ((4, 32), (64, 1024))  # (devices, samples per global batch)
TARGET_US = {(4, 32): 50.0, (64, 1024): 1000.0}
POLL_COST_FILE = Path(__file__).resolve().parent / "results" / "poll_cost-cuda.json"
POLL_READS = ("torch.cuda.memory_allocated", "pynvml.nvmlDeviceGetMemoryInfo")  # the tutorial's read, NVML's
MEASURE_BUDGET_NS = 200_000_000  # a polling plan that would take longer is extrapolated (calls x cost)


def poll_costs(path: Path = POLL_COST_FILE) -> dict | None:
    """The per-call costs (median us) of POLL_READS from poll_cost.py's results, and the device that measured
    them (the Machine line of the .md beside the .json); None when no GPU has measured them."""
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["rows"]
    md = path.with_suffix(".md")
    m = re.search(r"^Machine: ([^,\n]+)", md.read_text(), re.M) if md.exists() else None
    return {
        "file": str(path.relative_to(path.parents[2])),
        "device": m.group(1).strip() if m else "unknown",
        "reads": {r: rows[r]["median_us"] for r in POLL_READS if r in rows},
    }


def _time_plans(router: Router, batches: list[list[int]], devices, reps: int) -> float:
    ids = list(range(len(batches[0])))
    for b in batches[:3]:  # warm caches / first-call costs out of the figure
        router.plan(ids, b, devices)
    samples = []
    for i in range(reps):
        b = batches[i % len(batches)]
        t0 = time.perf_counter_ns()
        router.plan(ids, b, devices)
        samples.append(time.perf_counter_ns() - t0)
    return median(samples) / 1000.0


def poll_per_decision_plan(
    lengths: list[int], n_devices: int, polls_per_decision: int, poll_ns: int
) -> list[list[int]]:
    """least_loaded with a (simulated, poll_ns each) GPU memory query per device per sample, the anti-pattern."""
    given = [0] * n_devices
    bins: list[list[int]] = [[] for _ in range(n_devices)]
    for p in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
        for _ in range(polls_per_decision):
            busy_wait_ns(poll_ns)
        d = min(range(n_devices), key=lambda d: (given[d], d))
        given[d] += lengths[p]
        bins[d].append(p)
    return bins


def run(fast: bool = False) -> dict:
    pool = pools()["lognormal (mean 96, sigma 0.8, 8-512)"]
    std = pools()["stdlib (512 B pieces)"]
    polls = poll_costs()
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
        if polls is not None:
            lengths = sample_batches(pool, n, 1, seed=7)[0]
            for read, us in polls["reads"].items():
                row[f"poll/{read}"] = {
                    "once": _poll_plan_us(lengths, n_dev, 1, us),
                    "every_device": _poll_plan_us(lengths, n_dev, n_dev, us),
                }
        rows.append(row)
    return {"rows": rows, "poll_costs": polls}


def _poll_plan_us(lengths: list[int], n_dev: int, polls_per_decision: int, us: float) -> dict:
    """Wall time of one polling plan: measured when it fits MEASURE_BUDGET_NS, else calls x the per-call cost."""
    poll_ns = round(us * 1000)
    calls = len(lengths) * polls_per_decision
    if calls * poll_ns <= MEASURE_BUDGET_NS:
        t0 = time.perf_counter_ns()
        poll_per_decision_plan(lengths, n_dev, polls_per_decision, poll_ns)
        return {"us": (time.perf_counter_ns() - t0) / 1000.0, "measured": True, "calls": calls}
    return {"us": calls * us, "measured": False, "calls": calls}


def to_markdown(res: dict) -> str:
    polls = res["poll_costs"]
    reads = list(polls["reads"]) if polls else []
    head = " | ".join(f"poll `{r.split('.')[-1]}` 1x / every device per sample" for r in reads)
    lines = [
        "## Decision cost (median us per global batch, pure Python, GPT-2-small memory model, equal 80 GiB devices)",
        "",
        "| D x batch | target | "
        + " | ".join(f"{p} (lognormal / stdlib)" for p in POLICIES)
        + (" | " + head if head else "")
        + " |",
        "|---|---:|" + "---:|" * (len(POLICIES) + len(reads)),
    ]
    for r in res["rows"]:
        cells = " | ".join(f"{r[p + '/lognormal']:.0f} / {r[p + '/stdlib']:.0f}" for p in POLICIES)
        for read in reads:
            cells += " | " + " / ".join(
                f"{c['us']:,.0f}" + ("" if c["measured"] else " (extrapolated)")
                for c in (r[f"poll/{read}"]["once"], r[f"poll/{read}"]["every_device"])
            )
        lines.append(f"| {r['devices']} x {r['batch']} | <= {r['target_us']:.0f} | {cells} |")
    if polls:
        costs = ", ".join(f"`{read}` {us:.1f} us" for read, us in polls["reads"].items())
        lines += [
            "",
            f"Polling columns: least_loaded that reads the device's memory before each sample's decision "
            f"(once, or once per device), each read a busy-wait of the per-call cost measured on "
            f"{polls['device']} ({polls['file']}, median: {costs}); extrapolated = calls x that cost where "
            f"measuring would take over {MEASURE_BUDGET_NS / 1e9:g} s.",
        ]
    else:
        lines += [
            "",
            f"No polling columns: {POLL_COST_FILE.name} is missing (a GPU writes it: "
            "`python benchmarks/poll_cost.py`).",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(to_markdown(run()))
