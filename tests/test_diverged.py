"""Diverged is a result, not a crash (issue 12, finding 5). A variant whose loss goes non-finite ends as
'diverged at step N (lr X)': its task finishes cleanly (exit 0, state completed, an `end` row
exit_state=diverged), the other variants train on, the run exits 0 and the report compares the healthy ones
and lists the diverged one; analysis never refuses its events or asks to delete them. A base stage that
diverges fails (its variants would start from it) with one line naming base.lr."""

import json
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of

pytestmark = pytest.mark.integration

# Tiny steps; r8 at lr 10 goes NaN at step 3 on the tiny model (30 steps keep its lr near 10 until then: it
# stops there, so they cost nothing). r32 and r16 train 4 healthy steps. Three tasks side by side.
FAST = [
    "train.steps=4",
    "train.warmup_steps=0",
    "train.global_batch_size=8",
    "train.eval_batch_size=8",
    "train.eval_batches=2",
    "data.max_len=64",
    "data.max_documents=60",
]
DIVERGING = [
    "+experiment=lora_ab",
    "base.enabled=false",
    *FAST,
    "launcher.cpu_slots=3",
    "variants.r8.train.lr=10",
    "variants.r8.train.steps=30",
    "+variants.r16.model.lora.r=16",
]


def _rows(task_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (task_dir / "events-rank0.jsonl").read_text().splitlines()]


def test_a_diverging_variant_is_a_result_and_the_others_are_compared(tmp_path):
    proc = run_cli(*DIVERGING, f"run_root={tmp_path}", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["state"] == "completed"
    assert {n: t["state"] for n, t in manifest["tasks"].items()} == {
        "r8": "completed",
        "r32": "completed",
        "r16": "completed",
    }
    # the task: an end row and a result saying where it diverged, no traceback in its log
    end = _rows(run_dir / "tasks" / "r8")[-1]
    assert end["event"] == "end" and end["exit_state"] == "diverged", end
    step = end["step"]
    assert 0 < step < 30 and end["detail"] == "loss nan"
    result = json.loads((run_dir / "tasks" / "r8" / "result.json").read_text())
    assert (result["exit_state"], result["step"], result["lr"]) == ("diverged", step, 10.0)
    assert "Traceback" not in (run_dir / "logs" / "r8.log").read_text()
    # the report: r8 listed as diverged at its step with its lr; the verdict among the healthy ones
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    line = f"r8: diverged at step {step} (loss nan, lr 10)"
    assert summary["diverged"] and summary["diverged"][0].startswith(line), summary["diverged"]
    assert summary["variants"]["r8"]["diverged"]["step"] == step and summary["variants"]["r8"]["val_loss"] is None
    assert {(r["a"], r["b"]) for r in summary["ab"]} == {("r32", "r16"), ("r32", "base"), ("r16", "base")}
    assert all(summary["variants"][n]["val_loss"] < summary["base"]["val_loss"] for n in ("r32", "r16"))
    assert line in proc.stdout and line in (run_dir / "report" / "report.md").read_text()
    assert "Traceback" not in out and "remove" not in out
    # the report regenerates from the run dir alone, and resume= has nothing to redo
    regen = run_cli(str(run_dir), module="slurm_router.analysis", cwd=tmp_path)
    assert regen.returncode == 0 and line in regen.stdout, regen.stdout[-2000:] + regen.stderr[-2000:]
    assert "remove" not in regen.stdout + regen.stderr and "delete" not in regen.stdout + regen.stderr
    again = run_cli(f"resume={run_dir}", cwd=tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr


def test_a_diverging_base_stage_fails_in_one_line_naming_base_lr(tmp_path):
    proc = run_cli(
        "base.enabled=true",
        "base.lr=10",
        "base.steps=30",
        "base.global_batch_size=8",
        *FAST,
        f"base.cache_dir={tmp_path / 'cache'}",
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert {n: t["state"] for n, t in manifest["tasks"].items()} == {"base": "failed", "main": "skipped"}
    errors = [r["error"] for r in _rows(run_dir / "tasks" / "base") if r["event"] == "end" and r.get("error")]
    assert errors and "diverged at step" in errors[-1] and "lr 10): lower base.lr" in errors[-1], errors
    assert not list((tmp_path / "cache").glob("base/*/meta.json")), "a diverged base is never cached"
