"""Heterogeneity benchmark: achieved throughput as a fraction of ideal (sum of solo throughputs) on mixed fleets.

Two views per fleet and policy:
  oracle  - the router is told the true speeds (DeviceState.speed)
  learned - the Router starts knowing nothing (all 1.0) and learns speeds from observe_step (simulated
            compute_s = cost / true speed); steps 0-4 are warm-up and left out of the figure
Step time = max over devices of cost_d / speed_d (cost model, no processes).

    python benchmarks/router_heterogeneity.py
"""

from __future__ import annotations

from router_common import POLICIES, mean, pools, sample_batches, throughput_fraction

from slurm_router.router import DeviceState, Router, RouterSettings

FLEETS = {
    "1 : 0.5": [1.0, 0.5],
    "1 : 1 : 0.5 : 0.25": [1.0, 1.0, 0.5, 0.25],
    "8 x (1, 0.5 alternating)": [1.0, 0.5] * 4,
}
PER_DEVICE = 16
N_STEPS = 30
WARMUP_STEPS = 5


def run() -> dict:
    rows = []
    for pool_name, pool in pools().items():
        for fleet_name, speeds in FLEETS.items():
            n_dev = len(speeds)
            n = PER_DEVICE * n_dev
            batches = sample_batches(pool, n, N_STEPS, seed=n_dev)
            oracle_devices = [DeviceState(d, s) for d, s in enumerate(speeds)]
            row = {"lengths": pool_name, "fleet": fleet_name, "per_device": PER_DEVICE}
            for policy in POLICIES:
                settings = RouterSettings(policy=policy)
                oracle = [
                    throughput_fraction(Router(settings, n_dev).plan(range(n), b, oracle_devices), speeds)
                    for b in batches
                ]
                router = Router(settings, n_dev)
                learned = []
                for step, b in enumerate(batches):
                    a = router.plan(range(n), b)
                    if step >= WARMUP_STEPS:
                        learned.append(throughput_fraction(a, speeds))
                    for d, cost in enumerate(a.planned_cost()):
                        router.observe_step(d, cost, cost / speeds[d], None, a.per_device[d])
                slow = speeds.index(min(speeds))
                row[policy] = {
                    "oracle": mean(oracle),
                    "learned": mean(learned),
                    "slowest_share": mean(
                        [
                            Router(settings, n_dev).plan(range(n), b, oracle_devices).planned_cost()[slow] / sum(b)
                            for b in batches[:5]
                        ]
                    ),
                }
            rows.append(row)
    return {"rows": rows, "per_device": PER_DEVICE, "steps": N_STEPS, "warmup_steps": WARMUP_STEPS}


def to_markdown(res: dict) -> str:
    lines = [
        f"## Heterogeneity (throughput / ideal; {res['per_device']} samples per device, {res['steps']} steps, "
        f"learned = speed model from observe_step, first {res['warmup_steps']} steps left out)",
        "",
        "| lengths | speeds | " + " | ".join(f"{p} oracle / learned" for p in POLICIES) + " |",
        "|---|---|" + "---|" * len(POLICIES),
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['lengths']} | {r['fleet']} | "
            + " | ".join(f"{r[p]['oracle']:.3f} / {r[p]['learned']:.3f}" for p in POLICIES)
            + " |"
        )
    lines += [
        "",
        "Cost share of the slowest device under balanced (1 : 0.5 should be 1/3): "
        + ", ".join(
            f"{r['fleet']} ({r['lengths'].split()[0]}): {r['balanced']['slowest_share']:.3f}"
            for r in res["rows"]
            if r["fleet"] == "1 : 0.5"
        ),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(to_markdown(run()))
