"""Cost-model simulation of every policy from 8 to 1024 devices (no processes, no GPUs).

Two fleets: equal devices, and a mixed fleet where every fourth device runs at half speed (e.g. an older GPU
generation in the same job). 8 samples per device (lognormal lengths). Figures per policy:
  ratio       max / mean planned cost
  throughput  ideal / achieved step time, achieved = max_d padded tokens_d / speed_d (padding counts as work)
  plan ms     median wall time of one plan, pure Python

    python benchmarks/router_simulation.py
"""

from __future__ import annotations

import time

from router_common import POLICIES, fleet, gpt2_small_memory, mean, median, pools, sample_batches, useful_fraction

from slurm_router.router import Router, RouterSettings

DEVICES = (8, 64, 256, 1024)
PER_DEVICE = 8


def _reps(n_dev: int) -> int:
    return 20 if n_dev <= 64 else 5 if n_dev <= 256 else 3


def run() -> dict:
    pool = pools()["lognormal (mean 96, sigma 0.8, 8-512)"]
    rows = []
    for fleet_name in ("equal", "mixed (1/4 at 0.5x)"):
        for n_dev in DEVICES:
            speeds = [0.5 if fleet_name != "equal" and d % 4 == 3 else 1.0 for d in range(n_dev)]
            n = PER_DEVICE * n_dev
            batches = sample_batches(pool, n, _reps(n_dev), seed=n_dev)
            devices = fleet(speeds)
            row = {"fleet": fleet_name, "devices": n_dev, "batch": n}
            for policy in POLICIES:
                router = Router(RouterSettings(policy=policy), n_dev, gpt2_small_memory())
                ratios, thr, ms = [], [], []
                for b in batches:
                    t0 = time.perf_counter_ns()
                    a = router.plan(range(n), b, devices)
                    ms.append((time.perf_counter_ns() - t0) / 1e6)
                    ratios.append(a.time_balance_ratio(speeds))
                    thr.append(useful_fraction(a, speeds))
                row[policy] = {"ratio": mean(ratios), "throughput": mean(thr), "plan_ms": median(ms)}
            rows.append(row)
    return {"rows": rows, "per_device": PER_DEVICE}


def to_markdown(res: dict) -> str:
    lines = [
        f"## Simulation at scale ({res['per_device']} samples per device, lognormal lengths; "
        "ratio = max/mean of cost/speed, throughput = ideal/achieved with padding as work, plan ms = "
        "median time of one plan)",
        "",
        "| fleet | D | " + " | ".join(f"{p} ratio / throughput / plan ms" for p in POLICIES) + " |",
        "|---|---:|" + "---|" * len(POLICIES),
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['fleet']} | {r['devices']} | "
            + " | ".join(f"{r[p]['ratio']:.3f} / {r[p]['throughput']:.3f} / {r[p]['plan_ms']:.2f}" for p in POLICIES)
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(to_markdown(run()))
