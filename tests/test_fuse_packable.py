"""resources.fuse_variants checks at plan time that the model can take packed rows (issue 36, finding 8): a fused task
trains packed rows, so a checkpoint with sliding-window attention (Gemma-2) runs its variants unfused, said in one
line per variant, and the run succeeds, instead of a fused task that fails when its worker starts.

    pytest tests/test_fuse_packable.py
"""

import json

import pytest
from conftest import run_cli, run_dir_of, step_losses
from tiny_checkpoints import make_checkpoint

UNFUSED = (
    "resources.fuse_variants: variant {v} runs unfused: model.name_or_path={path}: Gemma2ForCausalLM uses "
    "sliding-window attention (sliding_window=4096); a fused task trains packed rows"
)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("checkpoints") / "gemma2", "gemma2")


def _run(gemma2, tmp_path, *extra):
    proc = run_cli(
        "-m",
        "model.lora.r=4,8",
        "model=hf",
        f"model.name_or_path={gemma2}",
        "resources.fuse_variants=2",
        "train.steps=2",
        "train.global_batch_size=4",
        "train.eval_batches=1",
        "data.max_len=48",
        "data.max_documents=40",
        "launcher=local",
        f"run_root={tmp_path / 'runs'}",
        *extra,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _said(proc, gemma2):
    lines = (proc.stdout + proc.stderr).splitlines()
    for v in ("r4", "r8"):
        assert lines.count(UNFUSED.format(v=v, path=gemma2)) == 1, proc.stdout[-3000:]


def test_the_plan_fuses_no_model_that_cannot_be_packed(gemma2, tmp_path):
    proc = _run(gemma2, tmp_path, "dry_run=true")
    _said(proc, gemma2)
    tasks = run_dir_of(proc) / "tasks"
    specs = [json.loads((tasks / v / "task.json").read_text()) for v in ("r4", "r8")]
    assert [(s["members"], s["fused_into"]) for s in specs] == [([], None), ([], None)]


@pytest.mark.integration
def test_a_run_of_a_model_that_cannot_be_packed_trains_its_variants_unfused(gemma2, tmp_path):
    proc = _run(gemma2, tmp_path)
    _said(proc, gemma2)
    tasks = run_dir_of(proc) / "tasks"
    assert all(len(step_losses(tasks / v)) == 2 for v in ("r4", "r8"))
