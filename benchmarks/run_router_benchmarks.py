"""Run every router benchmark and write benchmarks/results/router.md and router.json (a few minutes on 2 cores:
the memory benchmark trains real CPU micro-batches; the rest is the cost model), and the packed rows' fitted cost
(router_packed.py, simulated, ~10 s) to router_packed.md and router_packed.json.

    python benchmarks/run_router_benchmarks.py [--fast] [--packed-only]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import router_balance  # noqa: E402
import router_decision_cost  # noqa: E402
import router_heterogeneity  # noqa: E402
import router_memory  # noqa: E402
import router_packed  # noqa: E402
import router_simulation  # noqa: E402
from provenance import check, header, write  # noqa: E402
from router_common import machine_info  # noqa: E402


def _targets(res: dict) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for the figures the router promises."""
    out = []
    rows8 = [r for r in res["balance"]["rows"] if r["per_device"] == 8]
    for pool in dict.fromkeys(r["lengths"] for r in rows8):
        rs = [r for r in rows8 if r["lengths"] == pool]
        worst = max(r["balanced"]["ratio"] for r in rs)
        best = max(r["best_possible_ratio"] for r in rs)
        out.append(
            (
                f"balanced ratio <= 1.02 at 8 samples/device, {pool}",
                f"{worst:.3f} worst mean over D (best possible by lower bound: {best:.3f})",
                worst <= 1.02,
            )
        )
        useful = min(r["balanced"]["useful"] for r in rs)
        rr = mean_of(r["round_robin"]["useful"] for r in rs)
        out.append(
            (
                f"balanced useful-token fraction >= 0.95 at 8 samples/device, {pool}",
                f"{useful:.3f} lowest (round_robin {rr:.3f})",
                useful >= 0.95,
            )
        )
    for r in res["heterogeneity"]["rows"]:
        if r["fleet"] in ("1 : 0.5", "1 : 1 : 0.5 : 0.25"):
            v = r["balanced"]["learned"]
            out.append(
                (
                    f"balanced throughput >= 0.95 of ideal, speeds {r['fleet']}, {r['lengths'].split()[0]}",
                    f"{v:.3f} learned, {r['balanced']['oracle']:.3f} oracle "
                    f"(round_robin {r['round_robin']['oracle']:.3f})",
                    v >= 0.95,
                )
            )
    for r in res["decision_cost"]["rows"]:
        for src in ("lognormal", "stdlib"):
            v = r[f"balanced/{src}"]
            out.append(
                (
                    f"balanced plan <= {r['target_us']:.0f} us at {r['devices']} x {r['batch']}, {src}",
                    f"{v:.0f} us",
                    v <= r["target_us"],
                )
            )
    mem = {r["policy"]: r for r in res["memory"]["sim"]["rows"]}
    b, static = mem["balanced"], mem["round_robin (static, no memory model)"]
    out.append(
        (
            "memory: balanced finishes with no out-of-memory failure reaching the user (capped devices, "
            "static split beside it)",
            f"{b['failed_samples']} failed, {b['ooms_first_steps'] + b['ooms_after_warmup']} retried "
            f"(static: {static['ooms_first_steps'] + static['ooms_after_warmup']} OOMs)",
            b["failed_samples"] == 0,
        )
    )
    s = router_memory.summary(res["memory"])
    out.append(
        (
            "memory: refit predicted peak within 10% of the measured allocator peak (leave one out, every "
            "config and shape, worst)",
            f"{100 * s['refit']['max']:.1f}% worst, {100 * s['refit']['median']:.1f}% median over "
            f"{s['n_shapes']} shapes (the seed before any observation: {100 * s['seed']['max']:.1f}% worst, "
            f"{100 * s['seed']['median']:.1f}% median)",
            s["refit"]["max"] <= 0.10,
        )
    )
    return out


def mean_of(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def packed(out: Path, command: str) -> None:
    """router_packed.md and .json: the fitted row cost against the fixed default, simulated (deterministic)."""
    t0 = time.perf_counter()
    res = {"command": command, "header": header(command), "machine_info": machine_info()}
    res["packed"] = router_packed.run()
    res["targets"] = [{"target": t, "measured": m, "met": ok} for t, m, ok in router_packed.targets(res["packed"])]
    res["wall_s"] = time.perf_counter() - t0
    md = [
        "# Router benchmarks: packed rows' cost, fitted from step times",
        "",
        *res["header"],
        "",
        f"{res['wall_s']:.0f} s. Simulated (no processes, no GPU, seeded: the same figures on any machine with this "
        "Python, whose standard library is the stdlib pool): `benchmarks/router_packed.py`; the model in "
        "`slurm_router/router/cost_model.py`.",
        "",
        *targets_table(res["targets"]),
    ]
    md += ["", router_packed.to_markdown(res["packed"])]
    write(out / "router_packed.md", "\n".join(md), res)
    print("\n".join(md[: md.index("## Targets") + 4 + len(res["targets"])]))
    print(f"\nwrote {out / 'router_packed.md'} and {out / 'router_packed.json'} in {res['wall_s']:.0f} s")


def targets_table(targets: list[dict]) -> list[str]:
    """The results files' "Targets" section: each target, what was measured, whether it is met."""
    rows = [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |" for t in targets]
    return ["## Targets", "", "| target | measured | met |", "|---|---|---|", *rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--packed-only", action="store_true", help="only the packed rows' cost (router_packed.md)")
    ap.add_argument("--out", default=str(HERE / "results"), help="output folder")
    args = ap.parse_args()
    check(Path(args.out) / "router.md")
    if args.packed_only:
        packed(Path(args.out), "python benchmarks/run_router_benchmarks.py --packed-only")
        return
    t0 = time.perf_counter()
    command = "python benchmarks/run_router_benchmarks.py" + (" --fast" if args.fast else "")
    res = {
        "command": command,
        "header": header(command),
        "machine_info": machine_info(),
        "load_before": os.getloadavg(),
    }
    res["balance"] = router_balance.run(10 if args.fast else router_balance.N_BATCHES)
    res["heterogeneity"] = router_heterogeneity.run()
    res["decision_cost"] = router_decision_cost.run(fast=args.fast)
    res["simulation"] = router_simulation.run()
    res["memory"] = router_memory.run(fast=args.fast)
    res["targets"] = [{"target": t, "measured": m, "met": ok} for t, m, ok in _targets(res)]
    res["wall_s"] = time.perf_counter() - t0
    res["load_after"] = os.getloadavg()

    la0, la1 = res["load_before"], res["load_after"]
    md = [
        "# Router benchmarks",
        "",
        *res["header"],
        "",
        f"Whole suite {res['wall_s']:.0f} s; load average (1/5/15 min) {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f} "
        f"before, {la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} after (other work on the machine slows the timed "
        "figures: plan times, decision cost).",
        "",
        "Figures come from the cost model (no processes, no GPU): a device's time is the padded tokens "
        "(or cost) of its micro-batches over its speed, a step lasts as long as its slowest device; except the "
        "memory section's measured peaks (real CPU micro-batches). Default RouterSettings throughout "
        "(microbatch_overhead_tokens=16).",
        "",
        *targets_table(res["targets"]),
    ]
    md += [
        "",
        router_balance.to_markdown(res["balance"]),
        router_heterogeneity.to_markdown(res["heterogeneity"]),
        router_decision_cost.to_markdown(res["decision_cost"]),
        router_simulation.to_markdown(res["simulation"]),
        router_memory.to_markdown(res["memory"]),
    ]
    out = Path(args.out)
    write(out / "router.md", "\n".join(md), res)
    print("\n".join(md[: md.index("## Targets") + 4 + len(res["targets"])]))
    print(f"\nwrote {out / 'router.md'} and {out / 'router.json'} in {res['wall_s']:.0f} s")
    packed(out, command)


if __name__ == "__main__":
    main()
