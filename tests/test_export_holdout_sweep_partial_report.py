"""Each through the real command: export of a diverged variant says so and offers --best; a
damaged RUN_DIR/base-init/ is one line (verified by its sha256 sidecar, as the base cache is); data=text_dir holds
out a fraction of the pieces, so one large file still gives a held-out set; a sweep over a key the experiment's
variants set is refused in one line, and a refused data sweep says it was the sweep; analysis of a run still
training says the report is partial.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

from conftest import event_rows, run_cli, run_dir_of, start_cli, wait_until

from slurm_router.train.data import _is_val

TINY = [
    "train.steps=4",
    "train.warmup_steps=0",
    "train.global_batch_size=8",
    "train.eval_batch_size=8",
    "train.eval_batches=2",
    "data.max_len=64",
    "data.max_documents=60",
]


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The command's one line on stderr, for a user's mistake: exit 2, no traceback."""
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), proc.stdout[-2000:] + proc.stderr
    return err[0]


def test_export_of_a_diverged_variant_offers_best_and_a_damaged_base_init_is_one_line(tmp_path):
    # r8 at lr 10 goes NaN at step 3 (tests/test_diverged.py); its evaluation at step 2 saved adapter-best/
    proc = run_cli(
        "+experiment=lora_ab",
        "base.enabled=false",
        *TINY,
        "train.eval_every=2",
        "variants.r8.train.lr=10",
        "variants.r8.train.steps=30",
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    assert json.loads((run_dir / "tasks" / "r8" / "result.json").read_text())["exit_state"] == "diverged"

    line = _one_error_line(run_cli(str(run_dir), "r8", module="slurm_router.export", cwd=tmp_path))
    assert "the variant diverged at step" in line and "--best" in line and "adapter-best" in line, line
    assert "has not completed" not in line and "resume=" not in line
    best = run_cli(str(run_dir), "r8", "--best", module="slurm_router.export", cwd=tmp_path)
    assert best.returncode == 0 and "adapter-best" in best.stdout, best.stdout + best.stderr

    # the seed-built base the adapters sit on carries a sha256 sidecar; truncated, export says so in one line
    (weights,) = run_dir.glob("base-init/*/model.safetensors")
    assert (weights.parent / "model.json").is_file()
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    line = _one_error_line(
        run_cli(str(run_dir), "r32", "--merge", str(tmp_path / "out"), module="slurm_router.export", cwd=tmp_path)
    )
    assert "model.safetensors" in line and "truncated" in line and "base-init" in line, line
    assert not (tmp_path / "out").exists()


def test_text_dir_holds_out_pieces_of_one_large_file(tmp_path):
    """One file whose name hashes to the held-out side: once refused as 'no training text'; now about
    data.val_fraction of its pieces are held out and the run trains."""
    name = next(f"book{i}.txt" for i in range(1000) if _is_val(f"book{i}.txt", 0.05))
    folder = tmp_path / "texts"
    folder.mkdir()
    paragraphs = [f"paragraph {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(40)) for i in range(2000)]
    (folder / name).write_text("\n\n".join(paragraphs))  # about 0.5 MB, 2000 pieces of one paragraph
    proc = run_cli(
        "data=text_dir",
        f"data.path={folder}",
        "data.max_len=256",
        "train.steps=2",
        "train.eval_batches=2",
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"(\d+) train / (\d+) held-out samples", proc.stdout)
    assert m, proc.stdout[-3000:]
    train, held_out = int(m.group(1)), int(m.group(2))
    assert train + held_out >= 2000 and 0.03 < held_out / (train + held_out) < 0.08, (train, held_out)


def test_a_sweep_over_a_key_the_variants_set_is_refused_and_a_refused_data_sweep_names_the_sweep(tmp_path):
    line = _one_error_line(
        run_cli("-m", "+experiment=lora_ab", "model.lora.r=8,32", f"run_root={tmp_path}", cwd=tmp_path)
    )
    assert line.startswith("error: model.lora.r=8,32: the sweep would override what the experiment's variants set")
    assert "r8: model.lora.r=8" in line and "r32: model.lora.r=32" in line
    line = _one_error_line(
        run_cli("-m", "data=text_dir", f"data.path={tmp_path}/a,{tmp_path}/b", f"run_root={tmp_path}", cwd=tmp_path)
    )
    assert "-m sweep" in line and f"{tmp_path}/a" in line and "is not a folder" in line, line
    assert not (tmp_path / "default").exists() and not list(tmp_path.glob("*/*/manifest.json"))


def test_analysis_of_a_run_still_training_says_the_report_is_partial(tmp_path):
    proc = start_cli(
        "+experiment=lora_ab",
        "base.enabled=false",
        *[a for a in TINY if not a.startswith("train.steps")],
        "train.steps=400",
        "launcher.cpu_slots=1",
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    try:
        task = wait_until(
            lambda: next(
                (
                    p.parent
                    for p in tmp_path.glob("lora_ab/*/tasks/*/events-rank0.jsonl")
                    if sum(r["event"] == "step" for r in event_rows(p.parent)) >= 2
                ),
                None,
            ),
            "a task with 2 steps",
            timeout=300,
        )
        run_dir = task.parents[1]
        report = run_cli(str(run_dir), module="slurm_router.analysis", cwd=tmp_path)
        assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
        lines = [line for line in report.stdout.splitlines() if line.startswith("partial report: the run is still")]
        assert len(lines) == 1 and "2 tasks not ended" in lines[0], report.stdout[-3000:]
        assert "partial report: the run is still training" in (run_dir / "report" / "report.md").read_text()
        summary = json.loads((run_dir / "report" / "summary.json").read_text())
        assert summary["partial"].startswith("partial report:")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=300)
    # ended (interrupted): the report is no longer partial
    again = run_cli(str(run_dir), module="slurm_router.analysis", cwd=tmp_path)
    assert again.returncode == 0 and "partial report" not in again.stdout, again.stdout[-2000:] + again.stderr
    assert not json.loads((Path(run_dir) / "report" / "summary.json").read_text())["partial"]
