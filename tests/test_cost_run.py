"""What each verdict cost (analysis/cost.py), through the real command: a planted loser (r8 at lr 1e-6) against
r32, 2 seeds each, prune=true, the four replicates side by side: summary.json's `cost` and report.md's section."""

from __future__ import annotations

import json

from conftest import run_cli, run_dir_of


def test_a_pruned_run_says_what_it_spent_what_the_fixed_design_would_have_and_where_it_decided(tmp_path):
    proc = run_cli(
        "+experiment=lora_ab",
        "base.enabled=false",
        "data=stdlib",
        "train.steps=8",  # looks at 4 and 6 (from half of training on): room to stop after a look
        "train.eval_every=2",
        "train.eval_batches=8",
        "seeds=2",
        "prune=true",
        "launcher.cpu_slots=4",  # every replicate at once: each of r8's sees both of r32's at an evaluation
        "variants.r8.train.lr=1e-6",
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    c, tasks = summary["cost"], summary["cost"]["tasks"]
    assert sorted(tasks) == ["r32-s0", "r32-s1", "r8-s0", "r8-s1"]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, abs(b))  # noqa: E731

    # in all: the sum over tasks, the run header's figure, and the sum of its parts
    assert c["device_hours"] > 0 and close(c["device_hours"], sum(t["device_hours"] for t in tasks.values()))
    assert close(c["device_hours"], summary["header"]["device_hours"])
    assert close(c["device_hours"], sum(c[f"{p}_device_hours"] for p in ("train", "eval", "other")))
    assert close(c["device_hours"], sum(v["device_hours"] for v in c["by_variant"].values()))

    # evaluation apart from training: every task evaluated (each eval row carries its wall time) and trained
    for name, t in tasks.items():
        assert t["eval_device_hours"] > 0 and t["train_device_hours"] > 0 and t["evaluations"] >= 2, (name, t)
        rows = [json.loads(line) for line in (run_dir / "tasks" / name / "events-rank0.jsonl").read_text().splitlines()]
        assert all(r["t_eval_s"] > 0 for r in rows if r["event"] == "eval")

    # the fixed design: the pruned tasks' untrained steps at their own pace, so more than the run spent
    pruned = [n for n, t in tasks.items() if t["state"] == "pruned"]
    assert pruned and all(n.startswith("r8-") for n in pruned), tasks
    for n in pruned:
        t = tasks[n]
        assert t["remaining_steps"] == 8 - t["steps"] > 0 and t["steps_per_s"] > 0 and t["remaining_device_hours"] > 0
    assert c["fixed_design_device_hours"] > c["device_hours"] and c["saved_device_hours"] > 0

    # the decision: the evaluation named, what it cost up to there
    d = c["to_decision"]
    assert d["decided"] and d["winner"] == "r32" == summary["winner"]["variant"], (d, summary["winner"])
    assert d["step"] in (2, 4, 6) and 0 < d["device_hours"] <= c["device_hours"]
    report = (run_dir / "report" / "report.md").read_text()
    assert "## What the verdict cost" in report
    assert f"device-hours in all: {c['device_hours']:.4f}" in report
    assert f"decided at the evaluation at step {d['step']} (r32 the winner)" in report
    assert (
        f"the fixed design (every seed of every variant trained to the end): {c['fixed_design_device_hours']:.4f}"
        in (report)
    )
