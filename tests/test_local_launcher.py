"""The local launcher is a GPU-pinned task queue: each task gets devices of its own, never more concurrent
tasks than devices. GPUs are stood in for by CUDA_VISIBLE_DEVICES ids (workers fall back to CPU compute), so
the pinning itself is what is tested."""

import json

import pytest
from conftest import run_cli, run_dir_of, slowdown, task_spans

TINY = [
    "base.enabled=false",
    "train.steps=3",
    "train.global_batch_size=4",
    "train.eval_batches=1",
    "train.eval_batch_size=2",
    "data.max_documents=20",
    "data.max_len=64",
]
VARIANTS = [f"+variants.v{i}.train.lr={1e-3 * (i + 1)}" for i in range(4)]


# Steps long enough (a 0.01 s step made 1.5 s: the sleep is in proportion to the compute, so a loaded machine slows
# both alike) that tasks started together are still training when the last of them starts: unslowed, three tiny
# tasks started at once were seen to train one after another, each in 0.2 s; slowed, their starts were 0.1-0.8 s
# apart and each trained 4 s or more.
HELD = slowdown("150")


@pytest.mark.integration
def test_tasks_are_pinned_to_distinct_gpus(tmp_path):
    proc = run_cli(
        *TINY,
        *VARIANTS,
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": "0,1,2", **HELD},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spans = task_spans(run_dir_of(proc))
    assert sorted(spans) == ["v0", "v1", "v2", "v3"]
    assert all(gpu in ("0", "1", "2") for _, _, gpu in spans.values()), spans
    # the first three ran at once (a moment inside all three spans), each on a GPU of its own
    first = sorted(spans, key=lambda t: spans[t][0])[:3]
    assert max(spans[t][0] for t in first) < min(spans[t][1] for t in first), f"{first} did not run at once: {spans}"
    assert sorted(spans[t][2] for t in first) == ["0", "1", "2"], spans
    # the fourth waited for a free GPU: it started after one of them ended, on a GPU no running task had
    last = next(t for t in spans if t not in first)
    t0 = spans[last][0]
    assert any(spans[t][1] <= t0 for t in first), f"{last} started while 3 tasks held the 3 GPUs: {spans}"
    running = [t for t in first if spans[t][0] <= t0 < spans[t][1]]
    assert spans[last][2] not in {spans[t][2] for t in running}, f"{last} shared a GPU with a running task: {spans}"
    manifest = json.loads((run_dir_of(proc) / "manifest.json").read_text())
    assert all(t["state"] == "completed" and len(t["devices"]) == 1 for t in manifest["tasks"].values())


def test_more_gpus_than_the_machine_has_is_refused(tmp_path):
    proc = run_cli(
        *TINY,
        "resources.devices_per_task=4",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": "0,1,2"},
        timeout=120,
    )
    assert proc.returncode == 2
    assert "resources.devices_per_task=4 but this machine has 3 GPU(s)" in proc.stderr
    assert not any(tmp_path.rglob("manifest.json"))


@pytest.mark.integration
def test_colocated_variants_share_a_gpu_but_spread_first(tmp_path):
    proc = run_cli(
        *TINY,
        *VARIANTS[:3],
        "resources.tasks_per_gpu=2",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": "0,1"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "up to 2 tasks per GPU" in proc.stdout
    manifest = json.loads((run_dir_of(proc) / "manifest.json").read_text())
    placed = [manifest["tasks"][f"v{i}"]["devices"] for i in range(3)]
    assert placed[0] != placed[1], "the first two tasks should spread over both GPUs before sharing one"
    assert all(len(p) == 1 and p[0] in ("0", "1") for p in placed)


def test_colocated_count_follows_predicted_memory():
    from omegaconf import OmegaConf

    from slurm_router.backends.local.launcher import packable_tasks
    from slurm_router.config.schema import Config

    cfg = OmegaConf.structured(Config)
    small = packable_tasks(cfg, 80 << 30)  # a tiny GPT on an 80 GiB GPU: co-locates to the limit
    assert small == 8
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.vocab_size = 12, 768, 12, 50257
    cfg.train.global_batch_size, cfg.data.max_len = 64, 512
    assert packable_tasks(cfg, 80 << 30) in range(1, small)  # GPT-2 small at 64 x 512 needs far more per task
    assert packable_tasks(cfg, 1 << 30) == 1
    cfg.train.global_batch_size = 16
    alone = packable_tasks(cfg, 80 << 30)  # 7 measured
    cfg.resources.fuse_variants = 4  # a fused task holds 4 variants' batches at once: fewer of them fit (1)
    assert packable_tasks(cfg, 80 << 30) in range(1, alone) and alone > 1
