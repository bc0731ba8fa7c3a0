"""Fused groups in the report and in comparisons (issue 41, item 2), through the real command: the issue's run
(lora_ab plus r4 and r16, resources.fuse_variants=auto, train.steps=10 train.eval_every=5, launcher=local), then
the same variants alone and `analysis A B`. The report says which variants shared a task; each member has its own
samples, tokens and memory share (never '-'), the group's time split and job facts (not 0% for all but one);
the run's device-hours count each task once; a comparison sets a variant alone against its fused task's tokens/s."""

import json

import pytest
from conftest import run_cli, run_dir_of

pytestmark = pytest.mark.integration

ISSUE = [
    "+experiment=lora_ab",
    "+variants.r4.model.lora.r=4",
    "+variants.r16.model.lora.r=16",
    "train.steps=10",
    "train.eval_every=5",
    "launcher=local",
]
SMALL = [
    "base.steps=4",
    "launcher.cpu_slots=2",  # auto's K comes from the slots: 2 slots, 4 variants -> 2 fused tasks of 2
    "data.max_documents=60",
    "data.max_len=128",
    "train.global_batch_size=8",
    "train.eval_batches=2",
    "train.eval_batch_size=4",
]


def _run(tmp_path, base_cache, *extra):
    proc = run_cli(
        *ISSUE, *SMALL, *extra, f"base.cache_dir={base_cache}", f"run_root={tmp_path / 'runs'}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc)


@pytest.mark.timeout(900)
def test_the_report_and_a_comparison_tell_fused_variants_apart(tmp_path, base_cache):
    fused_run = _run(tmp_path, base_cache, "resources.fuse_variants=auto")
    summary = json.loads((fused_run / "report" / "summary.json").read_text())
    groups = {v["fused"]["task"]: v["fused"]["variants"] for v in summary["variants"].values()}
    assert sorted(map(sorted, groups.values())) == [["r16", "r4"], ["r32", "r8"]], groups

    report = (fused_run / "report" / "report.md").read_text()
    said = "; ".join(f"{', '.join(names)} in task {task}" for task, names in sorted(groups.items()))
    assert f"## Fused groups\n\nThese variants trained together, one task each group over one shared base: {said}." in (
        report
    )
    for name, v in summary["variants"].items():
        f = v["fused"]
        assert f["samples"] == 80 and f["tokens"] > 0, (name, f)  # 10 steps x 8 samples: its own, not '-'
        assert 0 < f["token_share"] < 1 and f["memory_share_bytes"] > 0
        assert v["device_hours"] == pytest.approx(f["group_device_hours"] * f["token_share"])
        assert f["group_tokens_per_s"] == pytest.approx(
            sum(summary["variants"][m]["tokens_per_s"] for m in f["variants"])
        )
        assert v["time_split"]["compute"] > 0.1, (name, v["time_split"])  # the group's, not 0% for a member
        assert v["job"]["util_mean"] == summary["variants"][f["task"]]["job"]["util_mean"]
    tasks_hours = {v["fused"]["task"]: v["fused"]["group_device_hours"] for v in summary["variants"].values()}
    base_hours = summary["base"].get("device_hours") or 0
    assert summary["header"]["device_hours"] == pytest.approx(sum(tasks_hours.values()) + base_hours)
    members = [n for n, v in summary["variants"].items() if v["fused"]["task"] != n]
    for m in members:
        assert (
            f"### {m}: per device" not in report and f"| {m} (in {summary['variants'][m]['fused']['task']}'s" in report
        )
    for leader, names in groups.items():
        assert f"### {leader} (fused task: {', '.join(names)}): per device" in report
    rows = report[report.index("## Fused groups") : report.index("## Files")]
    assert "| - |" not in rows

    alone_run = _run(tmp_path, base_cache, "resources.fuse_variants=1")
    out = tmp_path / "cmp"
    proc = run_cli("analysis", str(fused_run), str(alone_run), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cmp = json.loads((out / "comparison.json").read_text())["rows"]
    alone = json.loads((alone_run / "report" / "summary.json").read_text())["variants"]
    for row in cmp:
        v = row["variant"]
        if row["run_dir"] == str(fused_run):
            assert row["trained_in"] == ", ".join(summary["variants"][v]["fused"]["variants"])
            assert row["task_tokens_per_s"] == pytest.approx(summary["variants"][v]["fused"]["group_tokens_per_s"])
        else:
            assert row["trained_in"] == "alone" and "fused" not in alone[v]
            want = alone[v]["tokens_per_s"] / summary["variants"][v]["fused"]["group_tokens_per_s"]
            assert row["speedup"] == pytest.approx(want)  # against the fused task's tokens/s, not its share
    text = (out / "comparison.md").read_text()
    assert "| trained in |" in text and "| task tokens/s |" in text
    assert "trained_in" in proc.stdout
