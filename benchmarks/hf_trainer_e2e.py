"""The user's alternative end to end (issue 38 item 6): the same experiment, 4 variants (learning rates) x 3 training
seeds, run as one slurm_router job and as HF Trainer scripts (one process per variant and seed, 2 at a time on
the same 2 cores), measured side by side in one run: wall time and device-hours to the decision, and the decision.

    python benchmarks/hf_trainer_e2e.py [--steps 30] [--eval-every 15] [--seeds 3] [--parallel 2] [--out DIR]

slurm_router: one real command (`python -m slurm_router +experiment=lora_ab base.enabled=false data=stdlib`, the
built-in variants replaced by 4 learning rates, launcher.cpu_slots=2), timed from start to exit (time.monotonic:
planning, every task, the report); its device-hours and verdict are what RUN_DIR/report/summary.json says
(cost.device_hours; winner.variant, winner.decided).
HF Trainer: benchmarks/hf_trainer_task.py, one process per variant and seed, each with torch.set_num_threads(1),
at most --parallel at a time; wall time from the first start to the last exit, device-hours the sum over the
processes of their wall time x 1 device (a CPU core here, as slurm_router counts a CPU worker). The model (same
GPT-2 config, same init), the training and held-out samples (slurm_router's data=stdlib loading, imported) and
the settings (steps, batch, lr, warm-up, cosine to 10%, clipping, evaluations) are the same; the training order
is the Trainer's own shuffle. The decision a user of the scripts takes: the variant with the lowest mean final
held-out loss; decided as slurm_router decides (slurm_router.verdict.stats.compare on the per-seed per-batch
losses, every pair, Holm, 5%): `decide` below.
Writes benchmarks/results/hf_trainer_e2e.md and .json (or into --out DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import REPO, check, header, write  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TASK = Path(__file__).resolve().parent / "hf_trainer_task.py"
LRS = {"lr_001": 0.001, "lr_003": 0.003, "lr_01": 0.01, "lr_03": 0.03}


def env() -> dict:
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


def sr_command(root: Path, steps: int, eval_every: int, seeds: int) -> list[str]:
    variants = [f"+variants.{n}.train.lr={lr}" for n, lr in LRS.items()]
    return [
        sys.executable,
        "-m",
        "slurm_router",
        "+experiment=lora_ab",
        "base.enabled=false",
        "data=stdlib",
        "~variants.r8",
        "~variants.r32",
        *variants,
        f"seeds={seeds}",
        f"train.steps={steps}",
        f"train.eval_every={eval_every}",
        "launcher=local",
        "launcher.cpu_slots=2",
        f"run_root={root / 'runs'}",
    ]


def run_slurm_router(root: Path, steps: int, eval_every: int, seeds: int) -> dict:
    cmd = sr_command(root, steps, eval_every, seeds)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=root, env=env(), capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"slurm_router failed ({proc.returncode}): {proc.stderr[-2000:]}")
    run_dir = Path(next(l for l in reversed(proc.stdout.splitlines()) if l.startswith("run_dir: ")).split(": ", 1)[1])
    s = json.loads((run_dir / "report" / "summary.json").read_text())
    w = s.get("winner") or {}
    return {
        "command": " ".join(cmd[1:]).replace(str(root), "TMP"),
        "wall_s": wall,
        "device_hours": s["cost"]["device_hours"],
        "to_decision": s["cost"]["to_decision"],
        "winner": w.get("variant"),
        "decided": bool(w.get("decided")),
        "sentence": w.get("sentence", "").replace(str(root), "TMP"),
        "val_loss": {v: d.get("val_loss_mean") for v, d in (s.get("by_variant") or {}).items() if isinstance(d, dict)},
    }


def run_hf(root: Path, steps: int, eval_every: int, seeds: int, parallel: int) -> dict:
    """Every variant x seed as its own HF Trainer process, at most `parallel` at a time (in variant, seed order)."""
    jobs = [(n, lr, s) for n, lr in LRS.items() for s in range(seeds)]
    waiting, running, done = list(jobs), {}, {}
    t0 = time.monotonic()
    while waiting or running:
        while waiting and len(running) < parallel:
            n, lr, s = waiting.pop(0)
            out = root / f"hf-{n}-s{s}.json"
            args = [sys.executable, str(TASK), "--lr", str(lr), "--seed", str(s), "--steps", str(steps)]
            args += ["--eval-every", str(eval_every), "--out", str(out)]
            log = open(root / f"hf-{n}-s{s}.log", "w")
            running[(n, s)] = (
                subprocess.Popen(args, cwd=root, env=env(), stdout=log, stderr=log),
                time.monotonic(),
                out,
            )
        time.sleep(0.2)
        for key, (p, started, out) in list(running.items()):
            if p.poll() is not None:
                if p.returncode != 0:
                    sys.exit(f"HF task {key} failed ({p.returncode}): see {root / f'hf-{key[0]}-s{key[1]}.log'}")
                done[key] = {**json.loads(out.read_text()), "wall_s": time.monotonic() - started}
                del running[key]
    wall = time.monotonic() - t0
    sides = {n: {s: done[(n, s)] for s in range(seeds)} for n in LRS}
    verdict = decide(sides)
    return {
        "wall_s": wall,
        "device_hours": sum(d["wall_s"] for d in done.values()) / 3600,
        "processes": len(done),
        "setup_s_mean": sum(d["setup_s"] for d in done.values()) / len(done),
        **verdict,
        "tasks": {
            f"{n}-s{s}": {k: d[k] for k in ("val_loss", "evals", "wall_s", "setup_s")} for (n, s), d in done.items()
        },
    }


def decide(sides: dict[str, dict]) -> dict:
    """The user's decision from the scripts' outputs: {variant: {seed: {loss_sums, tokens, sources}}} -> the variant
    with the lowest mean held-out loss over its seeds, and whether it is decided as slurm_router decides (it
    beats every other variant, each pair by slurm_router.verdict.stats.compare, Holm over all pairs, at 5%: verdict/sentences.significant; a
    win resting on one seed only leads, not decided)."""
    import numpy as np

    from slurm_router.verdict.sentences import significant
    from slurm_router.verdict.stats import compare, holm

    mean = {
        v: float(np.mean([sum(r["loss_sums"]) / sum(r["tokens"]) for r in reps.values()])) for v, reps in sides.items()
    }
    best = min(mean, key=lambda v: mean[v])
    names = list(sides)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    diffs = [compare(sides[a], sides[b]) for a, b in pairs]
    adjusted = holm([d.p for d in diffs])
    beaten = 0
    for (a, b), d, p in zip(pairs, diffs, adjusted):
        row = {"p": d.p, "p_holm": p, "diff": d.diff}  # the report's test: Holm-adjusted p, not a float-order gap
        if best in (a, b) and significant(row) and (a if d.diff < 0 else b) == best and d.training_noise:
            beaten += 1
    return {"winner": best, "decided": beaten == len(names) - 1, "val_loss": mean}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=2, help="HF Trainer processes at a time (one per core)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for the results (default benchmarks/results)")
    a = ap.parse_args()
    md = a.out / "hf_trainer_e2e.md"
    check(md)
    command = "python benchmarks/hf_trainer_e2e.py" + "".join(
        f" --{k} {v}"
        for k, v, d in (
            ("steps", a.steps, 30),
            ("eval-every", a.eval_every, 15),
            ("seeds", a.seeds, 3),
            ("parallel", a.parallel, 2),
        )
        if v != d
    )
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="hf_e2e-") as tmp:
        root = Path(tmp)
        sr = run_slurm_router(root, a.steps, a.eval_every, a.seeds)
        load.append(os.getloadavg()[0])
        hf = run_hf(root, a.steps, a.eval_every, a.seeds, a.parallel)
        load.append(os.getloadavg()[0])
    import torch  # noqa: F401  (its version in the header)

    same = sr["winner"] == hf["winner"] and sr["decided"] == hf["decided"]
    verdict = lambda r: f"{r['winner']} ({'decided' if r['decided'] else 'not decided'})"  # noqa: E731
    rows = [
        ("slurm_router (one job)", sr),
        (f"HF Trainer scripts ({hf['processes']} processes, {a.parallel} at a time)", hf),
    ]
    lines = [
        "# The user's alternative end to end: HF Trainer scripts against one slurm_router job",
        "",
        *header(command),
        "",
        f"The same experiment on both sides: 4 variants (LoRA r8 on the tiny GPT-2, lr {', '.join(map(str, LRS.values()))})"
        f" x {a.seeds} training seeds, {a.steps} steps of 16 samples from data=stdlib, held-out loss on the same "
        f"16 x 16 samples at step 0 and every {a.eval_every} steps; fixed seeds on both sides. Measured one after "
        "the other in this run (slurm_router first) on the same 2 cores; device = one CPU core (a CPU worker, a "
        "Trainer process with 1 thread).",
        "",
        "| side | wall time (s) | device-hours | winner |",
        "|---|---|---|---|",
        *(f"| {name} | {r['wall_s']:.1f} | {r['device_hours']:.4f} | {verdict(r)} |" for name, r in rows),
        "",
        f"Ratio (HF Trainer scripts / slurm_router): wall time {hf['wall_s'] / sr['wall_s']:.2f}x, device-hours "
        f"{hf['device_hours'] / sr['device_hours']:.2f}x. Same decision: {'yes' if same else 'no'}.",
        "",
        "Held-out loss, mean over seeds (slurm_router's report / the scripts' final pass):",
        "",
        "| variant | slurm_router | HF Trainer |",
        "|---|---|---|",
        *(f"| {v} | {sr['val_loss'].get(v, float('nan')):.4f} | {hf['val_loss'][v]:.4f} |" for v in LRS),
        "",
        f"slurm_router's verdict: {sr['sentence']}  ",
        f"slurm_router to the decision: {sr['to_decision'].get('text')}.  ",
        f"HF Trainer processes spent {hf['setup_s_mean']:.1f} s each on average before their first step (imports, "
        "the corpus, the model). Load average (1 min) before, between and after: "
        + ", ".join(f"{x:.1f}" for x in load)
        + " (other work on the machine slows both sides).",
        "",
        "Caveats: the training samples' order differs (slurm_router's seeded sampler, the Trainer's seeded shuffle), "
        "so per-seed losses differ while the distributions are the same experiment; the Trainer's warm-up starts "
        "at lr 0 (lr x step / warmup), slurm_router's at lr / warmup (lr x (step + 1) / warmup), which shows in "
        "short runs; the scripts make one extra "
        "held-out pass at the end (per-batch losses for the statistics) that slurm_router's last evaluation "
        "already records; the two sides ran one after the other, not interleaved.",
    ]
    text = "\n".join(lines)
    print(text)
    write(
        md,
        text,
        {"command": command, "slurm_router": sr, "hf_trainer": hf, "load_average": load, "same_decision": same},
    )


if __name__ == "__main__":
    main()
