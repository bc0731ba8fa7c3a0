"""prune=true gives a pruned task's devices to the work still to do, at once (issue 38, item 3): locally the next
queued task starts in the pruned task's slot as soon as it ends, not when the tasks beside it end; in a fused group
the others train on without the loser, computing only their own rows, with the losses they have without it; under
Slurm the pruned array task ends and the next waiting one (launcher.array_parallelism) starts, the replicates of
the variants side by side in the array's order so that the loser meets them there.

r8 at lr 1e-6 is the planted loser (tests/test_prune.py); r32 is slowed (SLURM_ROUTER_TEST_DEVICE_SLOWDOWN: a sleep in
proportion to each step's compute, which changes no number) so that a pruned r8 task ends while r32's run on."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from conftest import event_rows, read_json, run_cli, run_dir_of, slowdown
from test_prune import PLANTED

pytestmark = pytest.mark.integration

# How long after a task ends the next one starts: the local launcher polls every 0.2 s; Slurm schedules at a job's
# end (seen: the same second). Generous, for a loaded 2-core machine.
LOCAL_HANDOVER_S = 5.0
SLURM_HANDOVER_S = 30.0


def _pruned(run_dir: Path) -> dict[str, dict]:
    results = {p.parent.name: json.loads(p.read_text()) for p in (run_dir / "tasks").glob("*/result.json")}
    pruned = {t: r for t, r in results.items() if r.get("exit_state") == "pruned"}
    assert pruned and all(t.startswith("r8-") for t in pruned), results
    return pruned


def _handovers(spans: dict[str, tuple[float, float]], pruned: dict[str, dict]) -> list[tuple[str, str, float, list]]:
    """For each pruned task that ended while another still waited: (pruned, the next to start, the gap from the
    pruned task's end to that start, the ends of the tasks that ran beside it and ended after it)."""
    out = []
    for p in pruned:
        end = spans[p][1]
        later = sorted((s, t) for t, (s, _) in spans.items() if s >= end - 1e-3 and t != p)
        if not later:
            continue
        beside = [e for t, (s, e) in spans.items() if t != p and s < end < e]
        out.append((p, later[0][1], later[0][0] - end, beside))
    return out


@pytest.mark.timeout(600)  # r32's slowed steps: 90 s alone, 5 min beside other test files on 2 cores
def test_a_pruned_task_s_slot_goes_to_the_next_queued_task_at_once(tmp_path):
    """Two CPU slots, r8 against a slow r32, 3 seeds each: every pruned r8 task that ended while tasks waited
    handed its slot (its device, in the manifest) to the next one within a few seconds, and that task started
    before the r32 task training beside it ended (it did not wait for the others)."""
    proc = run_cli(
        *(a for a in PLANTED if not a.startswith("train.steps")),
        "train.steps=8",  # looks at 4 and 6 (from half of training on): r32-s1 reaches 4 before r32-s0 ends
        "launcher.cpu_slots=2",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env=slowdown("r32=20"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    pruned = _pruned(run_dir)
    tasks = read_json(run_dir / "manifest.json")["tasks"]
    spans = {t: (info["started_at"], info["ended_at"]) for t, info in tasks.items()}
    handovers = _handovers(spans, pruned)
    assert handovers, f"no pruned task ended while another waited: {spans}, pruned {sorted(pruned)}"
    for p, nxt, gap, beside in handovers:
        alone = not [t for t, (_, e) in spans.items() if t != p and abs(e - spans[p][1]) < 1.0]
        if alone:  # the only task that ended then: its own device is the one the next task took
            assert tasks[nxt]["devices"] == tasks[p]["devices"], (p, nxt, tasks[p], tasks[nxt])
        assert 0 <= gap < LOCAL_HANDOVER_S, (p, nxt, gap, spans)
        assert all(spans[nxt][0] < e for e in beside), (p, nxt, spans)
    # a pruned task does not hold its slot: its process ends soon after its end row (generous: a loaded machine)
    for p in pruned:
        end_row = next(r for r in event_rows(run_dir / "tasks" / p) if r["event"] == "end")
        assert 0 <= spans[p][1] - end_row["time"] < 60, (p, end_row["time"], spans[p])


FUSED = [
    "+experiment=lora_ab",
    "base.enabled=false",
    "train.steps=6",
    "train.global_batch_size=12",
    "train.warmup_steps=0",
    "train.lr=3e-3",
    "train.eval_every=2",
    "train.eval_batches=4",
    "train.eval_batch_size=4",
    "data.max_documents=40",
    "data.max_len=128",
    "launcher.cpu_slots=2",
    "seeds=3",
    "resources.devices_per_task=1",
]


@pytest.mark.timeout(600)
def test_a_replicate_stops_after_the_step_in_which_another_task_s_look_pruned_it(tmp_path):
    """One in-training evaluation (step 10 of 19). r8 (the planted loser) reaches it first and trains on; the slower
    r32 replicates take the look at step 10 later, and it prunes r8. Each r8 replicate stops within a step of that
    look (worker/prune.py LookWatch), between evaluations: before this, having no evaluation left, it trained to
    the end. r32 trains on to the end as it would alone."""
    keep = [a for a in PLANTED if not a.startswith(("seeds=", "train.eval_every=", "train.steps=", "train.eval_b"))]
    proc = run_cli(
        *keep, "seeds=2", "train.steps=19", "train.eval_every=10", "train.eval_batches=16", "launcher.cpu_slots=4",
        f"run_root={tmp_path}", cwd=tmp_path, env=slowdown("r8=4;r32=5"), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    (look,) = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    assert look["step"] == 10 and look["pruned"] == ["r8"], look
    pruned = _pruned(run_dir)
    assert sorted(pruned) == ["r8-s0", "r8-s1"], pruned
    for t, result in pruned.items():
        rows = _steps(run_dir / "tasks" / t)
        after = [r["step"] for r in rows if r["time"] > look["time"]]
        assert 10 < result["step"] < 19 and len(rows) == result["step"], (t, result, len(rows))
        assert len(after) <= 2, (t, after)  # the step it was in when the look was taken, and a torn second
    for t in ("r32-s0", "r32-s1"):
        assert [r["step"] for r in _steps(run_dir / "tasks" / t)] == list(range(19)), t


def _fused_run(root: Path, *args: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    proc = run_cli(*FUSED, *args, f"run_root={root / 'runs'}", cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc)


def _group_rows(run_dir: Path) -> dict[int, dict]:
    """step -> the group's work that step: the tokens of its micro-batches (written in the events of the first
    variant still in the group) and its step time."""
    out: dict[int, dict] = {}
    for task_dir in (run_dir / "tasks").iterdir():
        for r in event_rows(task_dir):
            if r["event"] == "micro":
                out.setdefault(r["step"], {"tokens": 0, "t_step_s": None})["tokens"] += r["n_tokens"]
            elif r["event"] == "step":
                out.setdefault(r["step"], {"tokens": 0, "t_step_s": None})["t_step_s"] = r["t_step_s"]
    return out


def _steps(task_dir: Path) -> list[dict]:
    return sorted((r for r in event_rows(task_dir) if r["event"] == "step"), key=lambda r: r["step"])


def test_a_fused_group_trains_on_without_its_pruned_members_and_computes_only_the_rest(tmp_path):
    """r8 and r32 x 3 seeds in one fused task: r8's replicates are pruned at an evaluation and leave the group; the
    group trains r32's three to the end with the losses of a fused run of r32's three alone, and from the prune on
    each of its steps computes only r32's rows (the tokens of that run, step by step): fewer tokens, and a smaller
    cost in the router's plan, than before it."""
    fused = _fused_run(tmp_path / "pruned", "resources.fuse_variants=6", "prune=true", "variants.r8.train.lr=1e-6")
    pruned = _pruned(fused)
    at = {r["step"] for r in pruned.values()}
    assert len(at) == 1, pruned  # the group's evaluation decides them together
    (step,) = at
    assert 0 < step < 6, pruned
    alone = _fused_run(tmp_path / "alone", "resources.fuse_variants=3", "~variants.r8")
    survivors = [f"r32-s{s}" for s in range(3)]
    for t in survivors:
        got, ref = _steps(fused / "tasks" / t), _steps(alone / "tasks" / t)
        assert [r["step"] for r in got] == list(range(6)) == [r["step"] for r in ref], t
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5), t
        assert read_json(fused / "tasks" / t / "result.json")["val_loss"] == pytest.approx(
            read_json(alone / "tasks" / t / "result.json")["val_loss"], rel=1e-5
        )
    for t in pruned:
        assert [r["step"] for r in _steps(fused / "tasks" / t)] == list(range(step)), t
    group, ref_rows = _group_rows(fused), _group_rows(alone)
    every = {
        s: sum(r["n_tokens"] for t in (fused / "tasks").iterdir() for r in _steps(t) if r["step"] == s) for s in group
    }
    for s in range(6):  # every member's rows until the loser leaves; r32's alone after, as in their own run
        assert group[s]["tokens"] == every[s], (s, group[s], every[s])
        if s >= step:
            assert group[s]["tokens"] == ref_rows[s]["tokens"], (s, group[s], ref_rows[s])
    before = [group[s]["tokens"] for s in range(step)]
    after = [group[s]["tokens"] for s in range(step, 6)]
    assert max(after) < min(before), (before, after)
    # the router's cost of each step (what it plans the step's time by) shrinks with it; the times are shown
    cost = {s: sum(r["planned_cost"]) for s, r in group_steps(fused).items()}
    times = {s: round(group[s]["t_step_s"], 3) for s in group}
    assert max(cost[s] for s in range(step, 6)) < min(cost[s] for s in range(step)), (cost, times)


def group_steps(run_dir: Path) -> dict[int, dict]:
    """step -> the group's step row (every member still in the group writes the same plan)."""
    return {r["step"]: r for t in sorted((run_dir / "tasks").iterdir()) for r in _steps(t)}


def _sacct_spans(job_id: str) -> dict[str, tuple[float, float]]:
    out = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-o", "JobID,Start,End", "-j", job_id],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    at = lambda s: datetime.fromisoformat(s).timestamp()
    return {j: (at(s), at(e)) for j, s, e in (line.split("|") for line in out.splitlines() if line)}


@pytest.mark.slurm
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)
def test_under_slurm_the_pruned_array_task_ends_and_the_next_waiting_one_starts(tmp_path):
    """launcher=slurm, two array tasks at a time (launcher.array_parallelism=2, Slurm's %2) of eight: the array is
    in the replicates' order across variants (r8-s0, r32-s0, r8-s1, ...), so an r8 replicate meets two of r32's and
    is pruned; its array task ends, and the next waiting one starts within seconds, before the r32 task beside
    it ends."""
    proc = run_cli(
        *[a for a in PLANTED if not a.startswith("seeds=")],
        "seeds=4",  # two more chances for a pruned r8 replicate with a task still waiting behind it
        "launcher=slurm",
        "launcher.array_parallelism=2",
        "launcher.wait=true",
        "launcher.timeout_min=10",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = run_dir_of(proc)
    job = read_json(run_dir / "manifest.json")["jobs"][-1]
    assert [t["variant"] for t in job["tasks"]] == [f"{v}-s{s}" for s in range(4) for v in ("r8", "r32")]
    by_job = _sacct_spans(job["job_id"])
    spans = {t["variant"]: by_job[t["job_id"]] for t in job["tasks"]}
    pruned = _pruned(run_dir)
    handovers = _handovers(spans, pruned)
    assert handovers, f"no pruned task ended while another waited: {spans}, pruned {sorted(pruned)}"
    for p, nxt, gap, beside in handovers:
        assert 0 <= gap < SLURM_HANDOVER_S, (p, nxt, gap, spans)
        assert all(spans[nxt][0] <= e for e in beside), (p, nxt, spans)
