"""seeds=auto through the real command, locally and on the real Slurm test cluster: a planted loser (r8 at lr
1e-6) is pruned by its first two seeds and no reserve trains, each ending `not_needed` with why; two variants that
cannot be told apart (the same settings under two names) add seeds round by round up to auto_seeds.max, and the
report says the contest stayed undecided there. What the reserves would have cost is in the fixed design."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from conftest import event_rows, run_cli, run_dir_of
from test_prune import PLANTED

pytestmark = pytest.mark.integration

AUTO = [*(a for a in PLANTED if not a.startswith("seeds=")), "seeds=auto"]


def results(run_dir) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (run_dir / "tasks").glob("*/result.json")}


def check_loser_run(run_dir, waited: bool | None = False) -> None:
    """waited: a reserve that starts before its call holds its devices until then, and says so (a wait row, the
    cost's waiting part, left out of the fixed design). Locally it is started once called, and under Slurm queued
    after the round before (launch/base.py reserve_rounds), so it never waits (False); None: either."""
    got = results(run_dir)
    reserves = sorted(t for t in got if int(t.rsplit("-s", 1)[1]) >= 2)
    assert reserves and all(got[t]["exit_state"] == "not_needed" for t in reserves), got
    reasons = {t: got[t]["reason"] for t in reserves}
    assert all(" not run: r8 was pruned at look " in r for t, r in reasons.items() if t.startswith("r8-")), reasons
    assert all("the contest is decided, r32 is the only variant left" in r for t, r in reasons.items() if "r32" in t)
    kinds = {
        t: [json.loads(line)["event"] for line in (run_dir / "tasks" / t / "events-rank0.jsonl").open()]
        for t in reserves
    }
    assert not any("step" in k for k in kinds.values()), kinds  # a reserve not run trained no step
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    auto = summary["auto_seeds"]
    assert auto["ran"] == {"r8": 2, "r32": 2} and len(auto["not_run"]) == len(reserves)
    assert "the contest is decided: r32 is left" in auto["line"]
    assert not any(t in line for line in summary["missing"] for t in reserves)  # never run: not "missing"
    cost = summary["cost"]
    # the reserves priced at their variant's pace; the waiting is not the fixed design's (under Slurm it can outweigh
    # what the reserves not run saved: the report then says the run cost more)
    assert cost["fixed_design_device_hours"] > cost["device_hours"] - cost["wait_device_hours"]
    assert all(cost["tasks"][t]["state"] == "not_needed" and cost["tasks"][t]["remaining_steps"] == 6 for t in reserves)
    waits = {t: kinds[t].count("wait") for t in reserves}
    if waited is not None:
        assert all(waits.values()) if waited else not any(waits.values()), waits
    assert all((cost["tasks"][t]["wait_device_hours"] > 0) == bool(waits[t]) for t in reserves), (waits, cost)
    for row in (cost["tasks"][t] for t in reserves):
        trained = row["device_hours"] - row["wait_device_hours"]
        assert abs(row["fixed_design_device_hours"] - row["remaining_device_hours"] - trained) < 1e-12, row
    report = (run_dir / "report" / "report.md").read_text()
    assert auto["line"] in report and "r32 is the only variant left" in report
    status = run_cli("status", str(run_dir), "--json", cwd=run_dir, timeout=120)  # the reserves read as not needed
    tasks = {t["task"]: t for t in json.loads(status.stdout)["tasks"]}
    assert all(tasks[t]["state"] == "COMPLETED" and tasks[t]["ended_as"] == "not needed" for t in reserves), tasks
    pruned = [t for t in got if got[t].get("exit_state") == "pruned"]
    assert all(tasks[t]["ended_as"] == f"pruned at step {got[t]['step']}" for t in pruned), tasks
    assert all(tasks[t]["ended_as"] is None for t in tasks if t not in pruned + reserves), tasks
    # issue 50, 8: never run, pruned and completed are different words wherever a state is shown
    table = run_cli("status", str(run_dir), cwd=run_dir, timeout=120).stdout
    assert f"{len(reserves)} NOT_NEEDED" in table and (f"{len(pruned)} PRUNED" in table or not pruned), table
    assert f"{len(got) - len(reserves) - len(pruned)} COMPLETED" in table, table
    listed = run_cli("status", "--run-root", str(run_dir.parent), cwd=run_dir, timeout=120).stdout
    assert f"{len(got)}/{len(got)} (" in listed and f"{len(reserves)} not needed" in listed, listed


def test_a_clear_loser_is_decided_on_two_seeds_and_no_reserve_trains(tmp_path):
    proc = run_cli(*AUTO, "auto_seeds.max=4", f"run_root={tmp_path}", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "seeds=auto (at most 4 per variant): replicates run r8 2, r32 2" in proc.stdout
    assert "variants/r8-s2: not needed" in proc.stdout and ": completed" in proc.stdout, proc.stdout[-3000:]
    check_loser_run(run_dir_of(proc))


def test_fused_first_round_decides_and_its_reserves_would_run_alone(tmp_path):
    """resources.fuse_variants=2 with seeds=auto: the first round (2 seeds each) trains as 2 fused tasks, r8 and r32
    side by side in each, so every replicate reaches the first look together; the reserves are planned unfused
    after them and, the contest decided, end not_needed as in an unfused run."""
    proc = run_cli(
        *AUTO, "auto_seeds.max=3", "resources.fuse_variants=2", f"run_root={tmp_path}", cwd=tmp_path, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "resources.fuse_variants=2: 4 variant task(s) run as 2 task(s): 4 fused into 2 (one base in memory each), "
        "0 alone; seeds=auto's 2 reserve(s) (each variant's seeds after its first 2) run alone, after them"
    ) in proc.stdout
    run_dir = run_dir_of(proc)
    specs = {p.parent.name: json.loads(p.read_text()) for p in (run_dir / "tasks").glob("*/task.json")}
    assert {t: s["fused_into"] for t, s in specs.items() if s["fused_into"]} == {"r32-s0": "r8-s0", "r32-s1": "r8-s1"}
    assert not specs["r8-s2"]["members"] and not specs["r32-s2"]["members"]
    assert sorted(specs[t]["index"] for t in ("r8-s0", "r8-s1", "r8-s2", "r32-s2")) == [0, 1, 2, 3]
    check_loser_run(run_dir)


def test_variants_that_cannot_be_told_apart_run_to_the_cap_and_the_report_says_so(tmp_path):
    """r8 given r32's settings: the two train alike, no look can decide, so every round runs (3 seeds each) and
    the later round is looked at again (depth 3) at the run's one look step (4: evaluations at 2 and 4 of 6 steps,
    looks from half of training on), its level in the decisions file."""
    args = [a for a in AUTO if not a.startswith("variants.r8.train.lr")]
    proc = run_cli(
        *args, "variants.r8.model.lora.r=32", "variants.r8.model.lora.alpha=64", "auto_seeds.max=3",
        f"run_root={tmp_path}", cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    got = results(run_dir)
    assert sorted(got) == [f"{v}-s{s}" for v in ("r32", "r8") for s in range(3)]
    assert all(r.get("exit_state", "completed") == "completed" and r["steps"] == 6 for r in got.values()), got
    looks = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    assert not any(line["pruned"] for line in looks)
    assert [(line["depth"], line["step"]) for line in looks] == [(2, 4), (3, 4)]
    assert looks[1]["threshold"] == pytest.approx(0.05 / 2 / 1 / 1)  # half, one later depth, 1 look
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["auto_seeds"]["ran"] == {"r8": 3, "r32": 3}
    assert summary["auto_seeds"]["line"].endswith("r8, r32 reached auto_seeds.max=3 seeds undecided")
    assert (run_dir / "tasks" / "r8-s2" / "reserve.json").is_file()


def test_a_reserve_still_running_when_its_contest_is_decided_stops_there(tmp_path):
    """r8 at lr 3e-3, close to r32, 8 steps (evaluations at 2, 4, 6; looks at 4 and 6, from half of training on):
    2 seeds cannot decide (their looks at 0.0125 each do not prune), so round 2 runs r8-s2 and r32-s2, and their look
    at 3 seeds (step 4) prunes r8. r32-s2 ran only to decide: it stops within a step, not_needed, at the step it
    reached. The report counts it as run and stopped, the cost prices the steps it did not train in the fixed
    design, the verdict rests on r32's finished seeds, status says so."""
    args = [a for a in AUTO if not a.startswith(("variants.r8.train.lr", "train.steps"))]
    proc = run_cli(
        *args, "train.steps=8", "variants.r8.train.lr=3e-3", "auto_seeds.max=3", f"run_root={tmp_path}", cwd=tmp_path,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    got = results(run_dir)
    looks = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    assert [(line["depth"], line["pruned"]) for line in looks][-1] == (3, ["r8"]), looks
    assert got["r8-s2"]["exit_state"] == "pruned", got
    stopped = got["r32-s2"]
    assert stopped["exit_state"] == "not_needed" and 0 < stopped["step"] < 8, stopped
    assert f"the contest was decided at look {looks[-1]['look']}" in stopped["reason"], stopped
    steps = [r for r in event_rows(run_dir / "tasks" / "r32-s2") if r["event"] == "step"]
    assert len(steps) == stopped["step"], (len(steps), stopped)
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    auto = summary["auto_seeds"]
    assert auto["ran"] == {"r8": 3, "r32": 3} and not auto["not_run"], auto
    assert auto["stopped"] == [f"r32-s2: stopped at step {stopped['step']}: {stopped['reason']}"], auto
    assert auto["line"].endswith("the contest is decided: r32 is left; 1 stopped once decided"), auto
    cost = summary["cost"]["tasks"]["r32-s2"]
    assert cost["state"] == "not_needed" and cost["remaining_steps"] == 8 - stopped["step"], cost
    assert summary["winner"]["variant"] == "r32" and summary["winner"]["decided"], summary["winner"]
    assert summary["cost"]["to_decision"]["decided"], summary["cost"]["to_decision"]
    # the stopped reserve is in the tasks' table as stopped (issue 50, 8), never one of the verdict's replicates
    assert summary["variants"]["r32-s2"]["state"] == "stopped", summary["variants"]["r32-s2"]
    assert summary["by_variant"]["r32"]["n_seeds"] == 2, summary["by_variant"]["r32"]
    assert not any("r32-s2" in line for line in summary["missing"]), summary["missing"]
    status = run_cli("status", str(run_dir), "--json", cwd=run_dir, timeout=120)
    tasks = {t["task"]: t for t in json.loads(status.stdout)["tasks"]}
    assert tasks["r32-s2"]["ended_as"] == f"not needed (stopped at step {stopped['step']})", tasks["r32-s2"]
    table = run_cli("status", str(run_dir), cwd=run_dir, timeout=120).stdout
    assert "1 STOPPED" in table and "1 PRUNED" in table, table


def test_min_effect_settles_variants_that_train_alike_on_two_seeds(tmp_path):
    """auto_seeds.min_effect=0.01: r8 given r32's settings trains exactly alike, so the first look's interval is
    inside (-0.01, 0.01); the contest is settled there and no reserve trains, each saying why, as the report does."""
    args = [a for a in AUTO if not a.startswith("variants.r8.train.lr")]
    proc = run_cli(
        *args, "variants.r8.model.lora.r=32", "variants.r8.model.lora.alpha=64", "auto_seeds.max=4",
        "auto_seeds.min_effect=0.01", f"run_root={tmp_path}", cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    got = results(run_dir)
    reserves = sorted(t for t in got if int(t.rsplit("-s", 1)[1]) >= 2)
    assert len(reserves) == 4 and all(got[t]["exit_state"] == "not_needed" for t in reserves), got
    assert all("the contest is settled: r32 and r8 are within auto_seeds.min_effect=0.01" in got[t]["reason"]
               for t in reserves)  # fmt: skip
    looks = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    assert looks[0]["equivalent"]["r8"]["diff"] == 0 and not any(line["pruned"] for line in looks)
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    auto = summary["auto_seeds"]
    assert auto["ran"] == {"r8": 2, "r32": 2} and auto["settled_at_look"] == 1
    assert "the contest is settled: r32 and r8 are within auto_seeds.min_effect=0.01 of each other" in auto["line"]
    assert auto["line"] in (run_dir / "report" / "report.md").read_text()


@pytest.mark.slurm
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)
def test_under_slurm_the_reserves_of_a_decided_contest_end_not_needed(tmp_path):
    """launcher=sbatch: the reserves are queued as their own array job, after the first round's has ended
    (afterany), so they start once their call can be made: they end at once (not_needed, exit 0) and never hold
    an allocation waiting for it; the run completes and the report is the local run's."""
    proc = run_cli(
        *AUTO, "auto_seeds.max=3", "launcher=sbatch", "launcher.wait=true", "launcher.timeout_min=10",
        f"run_root={tmp_path}", cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = run_dir_of(proc)
    check_loser_run(run_dir, waited=False)
    check_rounds_queued_apart(run_dir)


def check_rounds_queued_apart(run_dir) -> None:
    """The variants stage as Slurm ran it: the first round one array job, the reserves (seed 2) another, which
    Slurm started only after every first-round task had ended (sacct's times)."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    jobs = [j for j in manifest["jobs"] if j["stage"] == "variants"]
    rounds = [sorted(t["variant"] for t in j["tasks"]) for j in jobs]
    assert len(rounds) == 2 and all(t[-3:] in ("-s0", "-s1") for t in rounds[0]), rounds
    assert rounds[1] == ["r32-s2", "r8-s2"], rounds
    ids = [j["job_id"] for j in jobs]
    sacct = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-j", ",".join(ids), "--format=JobID,Start,End"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = [line.split("|") for line in sacct.stdout.split() if line.count("|") == 2]
    first = [r for r in rows if r[0].split("_")[0] == ids[0]]
    later = [r for r in rows if r[0].split("_")[0] == ids[1]]
    assert first and later and max(r[2] for r in first) <= min(r[1] for r in later), sacct.stdout


@pytest.mark.slurm
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)
def test_under_slurm_a_fused_first_round_decides_and_the_reserve_array_tasks_end_not_needed(tmp_path):
    """launcher=slurm with resources.fuse_variants=2: the first round runs as 2 fused array tasks (r8 and r32 side
    by side in each), the reserves as the array's last tasks, alone; the contest decided, they end not_needed."""
    proc = run_cli(
        *AUTO, "auto_seeds.max=3", "resources.fuse_variants=2", "launcher=slurm", "launcher.wait=true",
        "launcher.timeout_min=10", f"run_root={tmp_path}", cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = run_dir_of(proc)
    specs = {p.parent.name: json.loads(p.read_text()) for p in (run_dir / "tasks").glob("*/task.json")}
    assert {t: s["fused_into"] for t, s in specs.items() if s["fused_into"]} == {"r32-s0": "r8-s0", "r32-s1": "r8-s1"}
    check_loser_run(run_dir, waited=False)
    check_rounds_queued_apart(run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["state"] == "completed", manifest["state"]
