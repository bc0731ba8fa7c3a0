"""The local launcher is a GPU-pinned task queue: each task gets devices of its own, never more concurrent
tasks than devices. GPUs are stood in for by CUDA_VISIBLE_DEVICES ids (workers fall back to CPU compute), so
the pinning itself is what is tested."""
import json

import pytest

from conftest import run_cli, run_dir_of

TINY = ["base.enabled=false", "train.steps=3", "train.global_batch_size=4", "train.eval_batches=1",
        "train.eval_batch_size=2", "data.max_documents=20", "data.max_len=64"]
VARIANTS = [f"+variants.v{i}.train.lr={1e-3 * (i + 1)}" for i in range(4)]


def _spans(run_dir):
    spans = {}
    for f in run_dir.glob("tasks/*/events-rank0.jsonl"):
        rows = [json.loads(l) for l in f.read_text().splitlines()]
        start = next(r for r in rows if r["event"] == "start")
        end = next(r for r in rows if r["event"] == "end")
        spans[start["task"]] = (start["time"], end["time"], start["cuda_visible_devices"])
    return spans


@pytest.mark.integration
def test_tasks_are_pinned_to_distinct_gpus(tmp_path):
    proc = run_cli(*TINY, *VARIANTS, f"run_root={tmp_path}", cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": "0,1,2"},
                   timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spans = _spans(run_dir_of(proc))
    assert sorted(spans) == ["v0", "v1", "v2", "v3"]
    assert all(gpu in ("0", "1", "2") for _, _, gpu in spans.values()), spans
    for a in spans:
        for b in spans:
            overlap = a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
            if overlap:
                assert spans[a][2] != spans[b][2], f"{a} and {b} ran at once on GPU {spans[a][2]}"
    # at every task start, at most 3 tasks (the GPU count) were running
    for t0, _, _ in spans.values():
        assert sum(s <= t0 < e for s, e, _ in spans.values()) <= 3
    manifest = json.loads((run_dir_of(proc) / "manifest.json").read_text())
    assert all(t["state"] == "completed" and len(t["devices"]) == 1 for t in manifest["tasks"].values())


def test_more_gpus_than_the_machine_has_is_refused(tmp_path):
    proc = run_cli(*TINY, "resources.devices_per_task=4", f"run_root={tmp_path}", cwd=tmp_path,
                   env={"CUDA_VISIBLE_DEVICES": "0,1,2"}, timeout=120)
    assert proc.returncode == 2
    assert "resources.devices_per_task=4 but this machine has 3 GPU(s)" in proc.stderr
    assert not any(tmp_path.rglob("manifest.json"))
