"""The main command end to end: base stage (cached), two LoRA variants, report. Real processes."""

import csv
import json
import time

import pytest
from conftest import run_cli, run_dir_of

SHORT = ["base.steps=60", "train.steps=20"]


@pytest.mark.integration
def test_lora_ab_learns_reports_and_reuses_the_base(tmp_path, base_cache):
    args = ["+experiment=lora_ab", *SHORT, f"base.cache_dir={base_cache}", f"run_root={tmp_path}"]
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["experiment"] == "lora_ab" and summary["run_dir"] == str(run_dir)
    base = summary["base"]["val_loss"]
    assert set(summary["variants"]) == {"r8", "r32"}
    for name, v in summary["variants"].items():
        assert v["val_loss"] < base, f"{name} did not beat the base: {v['val_loss']} >= {base}"
        assert v["steps"] == 20 and v["devices"] == 1 and v["policy"] == "balanced"
        assert v["tokens_per_s"] > 0 and v["balance_ratio"] >= 1.0 and v["train_loss"] > 0
        assert v["val_loss_start"] == pytest.approx(base, rel=1e-4), "variants must start from the base"
    with open(run_dir / "report" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 40 and set(rows[0]) == {"variant", "step", "loss", "tokens", "step_time_s"}
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tasks" / "r8" / "task.json").is_file()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["state"] == "completed" and manifest["versions"]["torch"]

    # the second run finds the base in the cache and skips its stage
    t0 = time.time()
    again = run_cli(*args, cwd=tmp_path)
    assert again.returncode == 0 and "reusing the cached base model" in again.stdout
    summary2 = json.loads((run_dir_of(again) / "report" / "summary.json").read_text())
    assert summary2["base"]["val_loss"] == base
    assert summary2["variants"]["r8"]["val_loss"] == pytest.approx(summary["variants"]["r8"]["val_loss"], rel=1e-5)
    assert time.time() - t0 < 120

    # the report is regenerated from the run dir alone
    (run_dir / "report" / "summary.json").unlink()
    regen = run_cli(str(run_dir), module="slurm_router.analysis", cwd=tmp_path)
    assert regen.returncode == 0, regen.stderr
    assert json.loads((run_dir / "report" / "summary.json").read_text()) == summary


def test_analysis_of_a_non_run_dir_is_a_clear_error(tmp_path):
    proc = run_cli(str(tmp_path), module="slurm_router.analysis")
    assert proc.returncode == 2 and "no manifest.json" in proc.stderr and "Traceback" not in proc.stderr


def _main_task(proc) -> tuple[list[float], list[float], dict]:
    """(step losses, held-out losses, result.json) of a run's one task, `main`."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    task = run_dir_of(proc) / "tasks" / "main"
    rows = [json.loads(line) for line in (task / "events-rank0.jsonl").read_text().splitlines()]
    return (
        [r["loss"] for r in rows if r["event"] == "step"],
        [r["val_loss"] for r in rows if r["event"] == "eval"],
        json.loads((task / "result.json").read_text()),
    )


@pytest.mark.integration
def test_compile_trains_the_same_run(tmp_path):
    """train.compile=true (the throughput switch): the worker really compiles (TorchInductor writes its graphs to
    the cache folder it is given), the task completes and learns, and its losses are the eager run's. Every
    sample is one 32-token shape (documents cut into whole pieces, padded to 32), so the backbone compiles once for
    training and once for evaluation: each new shape is another compile, 15-20 s on CPU."""
    args = [
        "base.enabled=false",
        "train.steps=4",
        "train.eval_batches=1",
        "data.max_documents=40",
        "data.max_len=32",
        "data.split_on=@@@@",
        "train.packing=false",
        "train.pad_to_multiple=32",
        "launcher.cpu_slots=1",
        f"run_root={tmp_path / 'runs'}",
    ]
    inductor = tmp_path / "inductor"
    compiled = run_cli(*args, "train.compile=true", cwd=tmp_path, env={"TORCHINDUCTOR_CACHE_DIR": str(inductor)})
    steps, evals, result = _main_task(compiled)
    assert any((inductor / "fxgraph").rglob("*")), "train.compile=true compiled nothing"
    assert len(steps) == 4 and result["steps"] == 4 and evals[-1] == result["val_loss"] < evals[0], (evals, result)
    eager_steps, eager_evals, _ = _main_task(run_cli(*args, cwd=tmp_path))
    assert steps == pytest.approx(eager_steps, rel=1e-4) and evals == pytest.approx(eager_evals, rel=1e-4)
