"""Disk full and permission errors while writing (issue 12, finding 7) are one line naming the path and the
cause, with nothing half-written left behind: checkpoint.py's atomic writes (checkpoints, their sidecars,
the base cache, the manifest, results), on real small file systems (tmpfs; root only). In a real run a
checkpoint that does not fit ends its task with that line, not torch's 'unexpected pos'."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_cli, run_dir_of

from slurm_router.artifacts import base_cache
from slurm_router.fileio import WriteError, atomic_write_text
from slurm_router.worker.checkpoint import save_checkpoint


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _one_line(e: pytest.ExceptionInfo, path: Path, cause: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and cause in msg, msg
    assert "unexpected pos" not in msg
    return msg


def test_a_checkpoint_that_does_not_fit_is_one_line_and_leaves_no_file(tmpfs):
    fs = tmpfs("64k")
    with pytest.raises(WriteError) as e:
        save_checkpoint(fs / "ckpt", 1, {"w": torch.zeros(100_000)}, keep=3)
    _one_line(e, fs / "ckpt" / "step-00000001.pt", "No space left on device")
    assert _files(fs) == []


def test_a_checkpoint_whose_sidecar_does_not_fit_is_removed_too(tmpfs, tmp_path):
    state = {"w": torch.zeros(30_000)}
    probe = save_checkpoint(tmp_path / "probe", 1, state, keep=3)
    fs = tmpfs(f"{math.ceil(probe['bytes'] / 4096) * 4}k")  # room for the data file, not one page more
    with pytest.raises(WriteError) as e:
        save_checkpoint(fs / "ckpt", 1, state, keep=3)
    _one_line(e, fs / "ckpt" / "step-00000001.json", "No space left on device")
    assert _files(fs) == [], "a checkpoint without its sidecar could never be verified: it must not stay"


def test_a_manifest_write_on_a_read_only_file_system_is_one_line(tmpfs):
    fs = tmpfs("1m", "ro")
    with pytest.raises(WriteError) as e:
        atomic_write_text(fs / "manifest.json", "{}")
    _one_line(e, fs / "manifest.json", "Read-only file system")


def test_a_base_cache_that_does_not_fit_leaves_no_part_of_it(tmpfs):
    fs = tmpfs("64k")
    weights = fs / "base" / "abc"  # a cache entry: a save_pretrained folder of ~400 kB of weights
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=64, n_layer=1, n_head=2))
    with pytest.raises(WriteError) as e:
        base_cache.save(model, weights, {"val_loss": 1.0})
    _one_line(e, weights, "No space left on device")
    assert _files(fs) == [] and base_cache.check(weights) == base_cache.ABSENT


@pytest.mark.integration
def test_a_run_whose_checkpoint_does_not_fit_ends_the_task_with_one_line(tmpfs):
    """Full fine-tuning of the tiny model: a 6 MB checkpoint on a 3 MB file system (the run dir's other files
    fit). The task fails at its first checkpoint with the line, the run ends, and no temp file stays."""
    fs = tmpfs("3m")
    proc = run_cli(
        "base.enabled=false",
        "model.lora.enabled=false",
        "train.steps=2",
        "train.checkpoint_every=1",
        "train.global_batch_size=8",
        "train.eval_batch_size=8",
        "train.eval_batches=2",
        "data.max_len=64",
        "data.max_documents=60",
        f"run_root={fs}",
        cwd=fs,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    ckpt = run_dir / "tasks" / "main" / "checkpoints" / "step-00000001.pt"
    log = (run_dir / "logs" / "main.log").read_text()
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: main: ") and f"cannot write {ckpt}: No space left on device" in last, last
    assert "unexpected pos" not in log
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["tasks"]["main"]["state"] == "failed" and manifest["state"] == "failed"
    rows = [json.loads(line) for line in (run_dir / "tasks" / "main" / "events-rank0.jsonl").read_text().splitlines()]
    assert rows[-1]["event"] == "end" and "No space left on device" in rows[-1]["error"]
    assert not [f for f in _files(fs) if f.endswith(".tmp")], "nothing half-written"
