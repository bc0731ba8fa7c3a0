"""Speed models side by side (router.speed_model=robust | ema | none) on noisy real workers and a real slowdown.

Real runs (python -m slurm_router, launcher=local, gpt2_tiny, heavy-tailed synthetic lengths), one after another
(identical workers in a mirrored order, robust, ema, none, none, ema, robust, so a drift in the machine's load
hits every model alike; the slowdown once per model):
  identical  4 identical CPU workers on this machine's cores: how far each model's planned per-device costs and
             learned speeds stray from equal, and the time balance (max / mean busy time per step) it gets
  slowdown   2 workers, SLURM_ROUTER_TEST_DEVICE_SLOWDOWN=1,2 (the testing aid: worker 1 takes twice as long): steps until
             the planned speeds are within 25% of the measured ratio, and throughput / ideal
Runs on a shared machine meet different load, so every model is also replayed against the timings recorded in
all runs of a kind (the fair side-by-side); then a seeded cost-model simulation (no processes, ~8 s) with the
same noise shape at 4 to 64 devices.

    python benchmarks/router_noise.py [--steps 40] [--out benchmarks/results]    # 4-6 minutes on 2 busy cores

Writes benchmarks/results/router_noise.md and .json. Figures from a shared 2-core box: the load average is
recorded with them (see the results file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import check, header, write
from router_common import REPO, machine_info, mean, median
from workloads import lognormal_lengths, sample_batches

from slurm_router.router import Router, RouterSettings
from slurm_router.router.speed_model import make_speed_model

MODELS = ("robust", "ema", "none")
ORDER = MODELS + MODELS[::-1]  # identical workers, mirrored: robust, ema, none, none, ema, robust
COMMON = [
    "base.enabled=false",
    "train.warmup_steps=0",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.eval_batch_size=4",
    "data=synthetic",
    "data.sigma=1.0",
    "data.n_samples=4096",
    "router=balanced",
]
IDENTICAL = ["resources.devices_per_task=4", "launcher.cpu_slots=4", "train.global_batch_size=32"]
SLOWDOWN = [
    "resources.devices_per_task=2",
    "launcher.cpu_slots=2",
    "train.global_batch_size=32",
]
SLOWDOWN_ENV = {"SLURM_ROUTER_TEST_DEVICE_SLOWDOWN": "1,2"}  # worker 1 takes twice as long (config/testing_aids.py)
LEARNED_WITHIN = 1.25  # "learned": the planned speed ratio within 25% of the measured one ...
LEARNED_FOR = 3  # ... for 3 steps in a row (the load of a shared machine moves the truth)


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def real_run(root: Path, model: str, extra: list[str], steps: int, env: dict | None = None) -> list[dict]:
    """One real run (env: more environment variables); its step rows (rank 0's events: every device's planned cost, busy time, planned speed)."""
    args = [*COMMON, *extra, f"train.steps={steps}", f"router.speed_model={model}", f"run_root={root}"]
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_router", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"run with router.speed_model={model} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run_dir: "))
    rows = [json.loads(line) for line in (run_dir / "tasks" / "main" / "events-rank0.jsonl").read_text().splitlines()]
    return sorted((r for r in rows if r["event"] == "step"), key=lambda r: r["step"])


def identical_metrics(rows: list[dict]) -> dict:
    planned = [r["planned_cost"] for r in rows]
    speeds = [r["speed"] for r in rows[1:]]  # step 0 plans before any observation
    busy = [r["busy_s_all"] for r in rows]
    return {
        "cost_balance": mean([max(c) * len(c) / sum(c) for c in planned]),
        "cost_spread_max": max(max(c) / min(c) for c in planned),
        "speed_spread": mean([max(s) / min(s) for s in speeds]),
        "speed_spread_max": max(max(s) / min(s) for s in speeds),
        "time_balance": mean([max(b) * len(b) / sum(b) for b in busy]),
        "step_s": median([max(b) for b in busy]),
        "tokens_per_s": sum(r["n_tokens"] for r in rows) / sum(r["t_step_s"] for r in rows),
    }


def slowdown_metrics(rows: list[dict]) -> dict:
    """True speeds = each device's median observed cost / busy second over the run's second half (a device's
    cost per second depends a little on its share: a fixed cost per micro-batch weighs more on a small share);
    throughput / ideal per step = (total cost / sum of true speeds) / the slowest device's busy time."""
    obs = [[c / b for c, b in zip(r["planned_cost"], r["busy_s_all"])] for r in rows[len(rows) // 2 :]]
    true = [median([o[d] for o in obs]) for d in range(2)]
    truth = true[1] / true[0]
    ratios = [r["speed"][1] / r["speed"][0] for r in rows]
    ok = [abs(math.log(x / truth)) <= math.log(LEARNED_WITHIN) for x in ratios]
    learned = next((s for s in range(len(ok) - LEARNED_FOR + 1) if all(ok[s : s + LEARNED_FOR])), None)
    thr = [(sum(r["planned_cost"]) / sum(true)) / max(r["busy_s_all"]) for r in rows]
    return {
        "measured_ratio": truth,
        "learned_at_step": learned,
        "throughput": mean(thr[5:]),
        "throughput_all": mean(thr),
        "share_slow": mean([r["planned_cost"][1] / sum(r["planned_cost"]) for r in rows[5:]]),
        "time_balance": mean([max(r["busy_s_all"]) * 2 / sum(r["busy_s_all"]) for r in rows[5:]]),
    }


def _pool(runs: list[dict]) -> dict:
    """Mean of each figure over a model's repeated runs (max for the max figures, the later step for learning)."""
    out = {}
    for k in runs[0]:
        vals = [r[k] for r in runs]
        if k.endswith("_max"):
            out[k] = max(vals)
        elif k == "learned_at_step":
            out[k] = None if None in vals else max(vals)
            out["learned_each"] = vals
        else:
            out[k] = mean(vals)
    return out


def trace(rows: list[dict]) -> list[list[float]]:
    """Per step, every device's observed cost per busy second."""
    return [[c / b for c, b in zip(r["planned_cost"], r["busy_s_all"])] for r in rows]


def replay(traces: list[list[list[float]]], model: str) -> dict:
    """Every model on the same recorded timings, so the machine's load differs between runs but not between
    models: before each step the model's speeds set fluid shares (cost in proportion to speed, no indivisible
    samples); that step's observed speeds give each device's time. time balance = max/mean time; throughput /
    ideal = (1 / sum of the step's speeds) / the slowest device's time. Steps 5 on, mean over traces."""
    balance, thr = [], []
    for tr in traces:
        sm = make_speed_model(model, len(tr[0]))
        for step, obs in enumerate(tr):
            sp = sm.speeds()
            times = [s / sum(sp) / o for s, o in zip(sp, obs)]
            if step >= 5:
                balance.append(max(times) * len(times) / sum(times))
                thr.append(1 / sum(obs) / max(times))
            for d, o in enumerate(obs):
                sm.observe(d, 1000.0, 1000.0 / o)
    return {"time_balance": mean(balance), "throughput": mean(thr)}


# ---- the simulation -------------------------------------------------------------------------------------------
def log_noise(rng: random.Random, scale: float = 0.06) -> float:
    """tests/test_speed_model.py's noise: Student t (3 dof) x scale, one step in six 20-60% fast."""
    t = rng.gauss(0, 1) / math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3)
    return scale * t + (rng.uniform(0.2, 0.6) if rng.random() < 1 / 6 else 0.0)


def simulate(model: str, n_dev: int, truth, steps: int, seed: int, per_device: int = 8) -> list[tuple]:
    rng = random.Random(seed)
    router = Router(RouterSettings(speed_model=model), n_dev)
    pool = lognormal_lengths(20_000, seed=1, sigma=1.0)
    out = []
    for step, lengths in enumerate(sample_batches(pool, per_device * n_dev, steps, seed=seed)):
        a = router.plan(range(len(lengths)), lengths)
        speeds = router.device_states()
        costs, load, true = a.planned_cost(), rng.gauss(0, 0.1), truth(step)
        times = [c / true[d] * math.exp(-log_noise(rng) - load) for d, c in enumerate(costs)]
        for d, c in enumerate(costs):
            router.observe_step(d, c, times[d], None, a.per_device[d])
        ideal = sum(costs) / sum(true)
        out.append(([s.speed for s in speeds], costs, ideal / max(c / t for c, t in zip(costs, true))))
    return out


def simulation(seeds: int = 5) -> list[dict]:
    rows = []
    for n_dev in (4, 16, 64):
        row = {"devices": n_dev}
        for model in MODELS:
            ident = [x for s in range(seeds) for x in simulate(model, n_dev, lambda t: [1.0] * n_dev, 40, s)[5:]]
            slow_truth = [1.0] * (n_dev - 1) + [0.5]
            learn, thr = [], []
            for s in range(seeds):
                run = simulate(model, n_dev, lambda t: slow_truth, 30, s)
                ratio = [sp[-1] * (n_dev - 1) / sum(sp[:-1]) for sp, _, _ in run]
                ok = [abs(math.log(r / 0.5)) <= math.log(LEARNED_WITHIN) for r in ratio]
                learn.append(next((t for t in range(len(ok)) if all(ok[t:])), None))
                thr.append(mean([x for _, _, x in run[5:]]))
            mid = []
            for s in range(seeds):
                run = simulate(model, n_dev, lambda t: [1.0] * (n_dev - 1) + [1.0 if t < 20 else 0.5], 40, s)
                ratio = [sp[-1] * (n_dev - 1) / sum(sp[:-1]) for sp, _, _ in run]
                ok = [abs(math.log(r / 0.5)) <= math.log(LEARNED_WITHIN) for r in ratio]
                mid.append(next((t - 20 for t in range(20, len(ok)) if all(ok[t:])), None))
            row[model] = {
                "speed_spread": mean([max(sp) / min(sp) for sp, _, _ in ident]),
                "cost_balance": mean([max(c) * n_dev / sum(c) for _, c, _ in ident]),
                "learn_steps": learn,
                "throughput": mean(thr),
                "follow_steps": mid,
            }
        rows.append(row)
    return rows


# ---- report -----------------------------------------------------------------------------------------------------
def _steps(xs) -> str:
    return (
        "never"
        if xs is None
        else str(xs)
        if not isinstance(xs, list)
        else ", ".join("never" if x is None else str(x) for x in xs)
    )


def to_markdown(res: dict) -> str:
    m = res["machine_info"]
    la0, la1 = res["load_before"], res["load_after"]
    lines = [
        "# Speed models side by side (router.speed_model)",
        "",
        *res["header"],
        "",
        f"{res['wall_s']:.0f} s. Load average (1/5/15 min) {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f} before, "
        f"{la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} after (other work on the machine meets the real runs).",
        "",
        f"Real runs: gpt2_tiny, data=synthetic sigma=1.0 (heavy-tailed lengths), global batch 32, "
        f"{res['steps']} steps per run of identical workers (every model twice, in the order "
        f"{', '.join(ORDER)}: the mean of its two runs, the max for the max columns), {res['slow_steps']} "
        "steps per run with a slow one (once per model). Busy time = a worker's time from the step's start "
        "to the end of its micro-batches.",
        "",
        f"## Identical workers ({res['identical_devices']} CPU workers on {m['cpu_count']} cores)",
        "",
        "speed spread = max/min of the speeds the plan used (1.00 = all equal); cost balance = max/mean planned "
        "cost (the speed-blind `none` shows the floor set by indivisible samples); time balance = max/mean "
        "busy time per step (what the step waits for).",
        "",
        "| speed model | speed spread mean / max | cost balance mean | planned cost max/min (worst step) | "
        "time balance mean | step s (median) | tokens/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model in MODELS:
        r = res["identical"][model]
        lines.append(
            f"| {model} | {r['speed_spread']:.3f} / {r['speed_spread_max']:.2f} | {r['cost_balance']:.3f} | "
            f"{r['cost_spread_max']:.2f} | {r['time_balance']:.3f} | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:.0f} |"
        )
    lines += [
        "",
        "## A real 2x slowdown (`SLURM_ROUTER_TEST_DEVICE_SLOWDOWN=1,2`, 2 workers)",
        "",
        f"learned at step = the first step from which the planned speed ratio is within "
        f"{LEARNED_WITHIN - 1:.0%} of the measured one for {LEARNED_FOR} steps in a row (the plan of step s "
        "has seen steps 0..s-1; per run; "
        "measured = median cost per busy second over the run's second half); "
        "throughput / ideal = (total cost / sum of measured speeds) / the slowest worker's busy time, "
        "steps 5 on; slow share = the slow worker's share of planned cost (1/3 is ideal).",
        "",
        "| speed model | measured speed ratio | learned at step | throughput / ideal | slow share | time balance |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for model in MODELS:
        r = res["slowdown"][model]
        lines.append(
            f"| {model} | {r['measured_ratio']:.2f} | {_steps(r['learned_each'])} | {r['throughput']:.3f} | "
            f"{r['share_slow']:.3f} | {r['time_balance']:.3f} |"
        )
    n_tr = {k: len(v) for k, v in res["traces"].items()}
    lines += [
        "",
        f"## Replay: every model on the same recorded timings ({n_tr['identical']} runs of identical "
        f"workers, {n_tr['slowdown']} with a slow one)",
        "",
        "The live figures above compare runs that met different load on a shared machine. Here each "
        "model plans, step by step, against the per-device speeds recorded in all the runs of a kind "
        "(fluid shares in proportion to its speeds; a step's time per device = share / that step's observed "
        "speed; steps 5 on).",
        "",
        "| speed model | identical: time balance | identical: throughput / ideal | slowdown: time balance | "
        "slowdown: throughput / ideal |",
        "|---|---:|---:|---:|---:|",
    ]
    for model in MODELS:
        a, b = res["replay"]["identical"][model], res["replay"]["slowdown"][model]
        lines.append(
            f"| {model} | {a['time_balance']:.3f} | {a['throughput']:.3f} | {b['time_balance']:.3f} | "
            f"{b['throughput']:.3f} |"
        )
    lines += [
        "",
        "## Simulation (cost model, seeded noise of tests/test_speed_model.py, 8 samples per device)",
        "",
        "identical: speed spread and cost balance, steps 5-39, 5 seeds; 2x: one device at half speed from the "
        "start (steps until learned, per seed; throughput / ideal, steps 5 on); mid-run: it slows at step 20 "
        "(steps after the change until learned, per seed).",
        "",
        "| D | speed model | identical: speed spread | identical: cost balance | 2x: learned at step | "
        "2x: throughput / ideal | mid-run: followed after |",
        "|---:|---|---:|---:|---|---:|---|",
    ]
    for row in res["simulation"]:
        for model in MODELS:
            r = row[model]
            lines.append(
                f"| {row['devices']} | {model} | {r['speed_spread']:.3f} | {r['cost_balance']:.3f} | "
                f"{_steps(r['learn_steps'])} | {r['throughput']:.3f} | {_steps(r['follow_steps'])} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="steps per real run of identical workers")
    ap.add_argument("--slow-steps", type=int, default=25, help="steps per real run with a slow worker")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--no-real", action="store_true", help="the simulation only (seconds)")
    args = ap.parse_args()
    if not args.no_real:
        check(Path(args.out) / "router_noise.md")
    t0 = time.perf_counter()
    command = "python benchmarks/router_noise.py" + "".join(
        f" --{k.replace('_', '-')} {v}"
        for k, v, d in (("steps", args.steps, 40), ("slow_steps", args.slow_steps, 25))
        if v != d
    )
    res = {
        "command": command,
        "header": header(command),
        "machine_info": machine_info(),
        "load_before": load_average(),
        "steps": args.steps,
        "slow_steps": args.slow_steps,
        "identical_devices": 4,
    }
    if not args.no_real:
        ident: dict[str, list] = {m: [] for m in MODELS}
        slow: dict[str, list] = {m: [] for m in MODELS}
        traces: dict[str, list] = {"identical": [], "slowdown": []}
        with tempfile.TemporaryDirectory(prefix="router_noise-") as tmp:
            for i, model in enumerate(ORDER):
                root = Path(tmp) / f"{i}-{model}"
                root.mkdir()
                rows = real_run(root, model, IDENTICAL, args.steps)
                ident[model].append(identical_metrics(rows))
                traces["identical"].append(trace(rows))
                print(f"{model}: identical {ident[model][-1]}", flush=True)
                if i < len(MODELS):
                    rows = real_run(root, model, SLOWDOWN, args.slow_steps, SLOWDOWN_ENV)
                    slow[model].append(slowdown_metrics(rows))
                    traces["slowdown"].append(trace(rows))
                    print(f"  slowdown {slow[model][-1]}", flush=True)
        res["identical"] = {m: _pool(v) for m, v in ident.items()}
        res["slowdown"] = {m: _pool(v) for m, v in slow.items()}
        res["replay"] = {kind: {m: replay(tr, m) for m in MODELS} for kind, tr in traces.items()}
        res["traces"] = traces
    res["simulation"] = simulation()
    res["load_after"] = load_average()
    res["wall_s"] = time.perf_counter() - t0
    if args.no_real:  # a quick look: nothing written
        print(json.dumps(res["simulation"], indent=1))
        return
    write(Path(args.out) / "router_noise.md", to_markdown(res), res)
    print(to_markdown(res))


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    main()
