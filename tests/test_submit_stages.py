"""The one stage loop (slurm_router.launch.base.submit_stages) against fake launchers, without Slurm: stage
order, afterok chaining, the cached base, a failed stage skipping the next, resume of only the unfinished
tasks, the manifest records, the report job last."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from slurm_router.artifacts import base_cache
from slurm_router.backends.slurm.config import SubmititLauncherConfig
from slurm_router.config.schema import LocalLauncherConfig
from slurm_router.launch.base import Launcher, RunJobs, StageJobs, TaskJob, submit_stages
from slurm_router.rundir.lifecycle import TaskState
from slurm_router.rundir.manifest import Manifest, create_run_dir
from slurm_router.rundir.spec import Stage, TaskSpec


class FakeSlurm(Launcher):
    """Queues nothing: numbers its jobs and logs every call."""

    schema = SubmititLauncherConfig

    def __init__(self, cfg, manifest):
        super().__init__(cfg, manifest)
        self.calls: list[tuple] = []

    def submit_stage(self, stage, after, after_round=None):
        job_id = str(100 + len(self.calls))
        self.calls.append(("stage", stage.name, [t.name for t in stage.tasks], after))
        return StageJobs(
            job_id=job_id,
            tasks={t.name: TaskJob(f"{job_id}_{t.index}", f"/o/{t.name}", f"/e/{t.name}") for t in stage.tasks},
        )

    def report_job(self, after):
        self.calls.append(("report", after))
        return "999"

    def finish(self, run: RunJobs) -> int:
        return 0

    @classmethod
    def task_states(cls, manifest):  # what `status` would show: the states the manifest records
        from slurm_router.scheduler.task_view import local_status

        return local_status(manifest)

    @classmethod
    def cancel(cls, manifest):
        return None


class FakeLocal(FakeSlurm):
    """Synchronous: every task of a stage ends in `outcome` (per task name), default completed."""

    schema = LocalLauncherConfig
    synchronous = True

    def __init__(self, cfg, manifest, outcome=None):
        super().__init__(cfg, manifest)
        self.outcome = outcome or {}

    def submit_stage(self, stage, after, after_round=None):
        self.calls.append(("stage", stage.name, [t.name for t in stage.tasks], after))
        return StageJobs(states={t.name: self.outcome.get(t.name, TaskState.COMPLETED) for t in stage.tasks})

    def report_job(self, after):
        self.calls.append(("report", after))
        return None


def _task(run_dir, name, stage, index, save_weights=None):
    return TaskSpec(
        run_id="r",
        run_dir=str(run_dir),
        experiment="e",
        name=name,
        stage=stage,
        variant=name,
        index=index,
        devices=1,
        config={},
        steps=1,
        lr=1e-3,
        global_batch_size=1,
        lora=stage != "base",
        save_weights=save_weights,
    )


def _run(tmp_path, cached_base=False):
    run_dir = tmp_path / "run"
    cache = tmp_path / "cache"
    cache.mkdir()
    weights = cache / "abc"  # a cache entry: a save_pretrained folder (slurm_router/artifacts/base_cache.py)
    if cached_base:  # a whole cache: weights, their sha256 sidecar, meta.json last
        from transformers import GPT2Config, GPT2LMHeadModel

        tiny = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=8, n_embd=8, n_layer=1, n_head=2))
        base_cache.save(tiny, weights, {"val_loss": 1.5})
    stages = [
        Stage("base", [_task(run_dir, "base", "base", 0, str(weights))], cached=cached_base),
        Stage("variants", [_task(run_dir, f"v{i}", "variants", i) for i in range(3)], depends_on=["base"]),
    ]
    cfg = OmegaConf.create({"experiment": "e", "launcher": {"kind": "slurm"}})
    manifest = create_run_dir(cfg, "r", run_dir, stages, "slurm")
    return cfg, manifest, stages


def test_stages_in_order_chained_afterok_report_last_and_recorded(tmp_path):
    cfg, manifest, stages = _run(tmp_path)
    launcher = FakeSlurm(cfg, manifest)
    run = submit_stages(launcher, stages)
    assert launcher.calls == [
        ("stage", "base", ["base"], None),
        ("stage", "variants", ["v0", "v1", "v2"], "100"),
        ("report", "101"),
    ]
    assert run.job_ids == ["100", "101"] and run.report_job_id == "999"
    data = Manifest.load(manifest.layout.root).data
    assert [j["stage"] for j in data["jobs"]] == ["base", "variants"]
    assert [t["job_id"] for t in data["jobs"][1]["tasks"]] == ["101_0", "101_1", "101_2"]
    assert all(t["state"] == "submitted" for t in data["tasks"].values())
    assert data["tasks"]["v1"]["log_path"] == "/o/v1"
    assert (data["state"], data["job_ids"], data["report_job_id"]) == ("submitted", ["100", "101"], "999")


def test_cached_base_is_not_submitted_and_its_cache_meta_is_the_result(tmp_path):
    cfg, manifest, stages = _run(tmp_path, cached_base=True)
    launcher = FakeSlurm(cfg, manifest)
    submit_stages(launcher, stages)
    assert launcher.calls == [("stage", "variants", ["v0", "v1", "v2"], None), ("report", "100")]
    result = manifest.layout.task("base").result
    assert json.loads(result.read_text()) == {"val_loss": 1.5}
    assert Manifest.load(manifest.layout.root).data["tasks"]["base"]["state"] == "cached"


def test_a_failed_stage_skips_the_next_and_records_skipped(tmp_path):
    cfg, manifest, stages = _run(tmp_path)
    launcher = FakeLocal(cfg, manifest, outcome={"base": TaskState.FAILED})
    run = submit_stages(launcher, stages)
    assert launcher.calls == [("stage", "base", ["base"], None), ("report", None)]
    data = Manifest.load(manifest.layout.root).data
    assert {n: t["state"] for n, t in data["tasks"].items()} == {
        "base": "failed",
        "v0": "skipped",
        "v1": "skipped",
        "v2": "skipped",
    }
    assert data["state"] == "failed" and not run.ok


def test_synchronous_launcher_records_final_states(tmp_path):
    cfg, manifest, stages = _run(tmp_path)
    launcher = FakeLocal(cfg, manifest, outcome={"v1": TaskState.INTERRUPTED})
    run = submit_stages(launcher, stages)
    data = Manifest.load(manifest.layout.root).data
    assert data["tasks"]["v1"]["state"] == "interrupted" and data["tasks"]["v0"]["state"] == "completed"
    assert data["state"] == "failed" and data["jobs"] == [] and run.job_ids == []


def test_resume_submits_only_the_unfinished_tasks(tmp_path, monkeypatch):
    """The base completed and v1 completed in the first run: resume's stages hold v0 and v2 only."""
    from slurm_router.launch import resume
    from slurm_router.launch.resume import plan_resume

    # these specs carry no config (config={}), so no config.yaml matches them: the edited-config refusal is
    # tested through the command (tests/test_requeue_local.py)
    monkeypatch.setattr(resume, "check_config_unchanged", lambda manifest: None)
    cfg, manifest, stages = _run(tmp_path, cached_base=True)
    manifest.layout.config.write_text(OmegaConf.to_yaml(cfg))
    for name in ("base", "v1"):
        manifest.layout.task(name).result.write_text("{}")
    manifest, cfg, stages = plan_resume(str(manifest.layout.root))
    assert [(s.name, s.cached, [t.name for t in s.tasks]) for s in stages] == [
        ("base", True, []),
        ("variants", False, ["v0", "v2"]),
    ]
    launcher = FakeSlurm(cfg, manifest)
    submit_stages(launcher, stages)
    assert launcher.calls == [("stage", "variants", ["v0", "v2"], None), ("report", "100")]
    data = Manifest.load(manifest.layout.root).data
    assert [t["job_id"] for t in data["jobs"][0]["tasks"]] == ["100_0", "100_2"]


def test_the_registry_is_the_one_place_kinds_are_named():
    from slurm_router.config.schema import CHOICES
    from slurm_router.scheduler.registry import launcher_class, launcher_kinds

    assert tuple(launcher_kinds()) == CHOICES["launcher.kind"] == ("local", "slurm", "sbatch")
    assert all(launcher_class(kind).schema.kind == kind for kind in launcher_kinds())
    with pytest.raises(Exception, match="no such launcher"):
        launcher_class("nope")


def test_local_threads_follow_the_workers_that_run_side_by_side(tmp_path, monkeypatch):
    """One CPU task on an 8-slot pool gets every core; four tasks share them (slurm_router.worker.cpu)."""
    from slurm_router.backends.local import launcher as local

    seen = []
    monkeypatch.setattr(local, "device_pool", lambda cfg: ([f"cpu{i}" for i in range(8)], False))
    monkeypatch.setattr(
        local,
        "_run_queue",
        lambda tasks, pool, on_gpu, layout, manifest, threads: (
            seen.append(threads) or {t.name: TaskState.COMPLETED for t in tasks}
        ),
    )
    monkeypatch.setattr(local, "threads_per_worker", lambda n: 8 // n)
    cfg, manifest, stages = _run(tmp_path)
    launcher = local.LocalLauncher(cfg, manifest)
    launcher.submit_stage(stages[0], None)
    launcher.submit_stage(Stage("variants", [_task(tmp_path, f"v{i}", "variants", i) for i in range(4)]), None)
    assert seen == [8, 2]


@pytest.mark.parametrize("report_state", ["COMPLETED", "FAILED"])
def test_wait_waits_for_the_report_job_and_writes_report_only_if_it_failed(tmp_path, monkeypatch, capsys, report_state):
    """launcher.wait=true: the run's tasks, then the report job; the report it wrote is printed, not written
    again (one writer of report/); if it failed, say so and write it here."""
    from slurm_router.analysis import console, report
    from slurm_router.backends.slurm import queries as slurm_queries
    from slurm_router.backends.slurm.submitit_launcher import SubmititLauncher
    from slurm_router.scheduler.task_view import TaskView

    cfg, manifest, _ = _run(tmp_path)
    cfg.launcher.wait = True
    order, written = [], []
    monkeypatch.setattr(
        slurm_queries,
        "wait_for_run",
        lambda m, poll_s, on_poll=None: (
            order.append("tasks") or [TaskView(stage="variants", variant="v0", job_id="100_0", state="COMPLETED")]
        ),
    )
    monkeypatch.setattr(slurm_queries, "wait_for_job", lambda job_id, poll_s: order.append(job_id) or report_state)
    monkeypatch.setattr(report, "write_report", lambda run_dir: written.append(run_dir) or {"from": "here"})
    monkeypatch.setattr(console, "print_table", lambda summary: print(f"table {summary}"))
    manifest.layout.report.mkdir()
    (manifest.layout.report / "summary.json").write_text(json.dumps({"from": "the report job"}))
    code = SubmititLauncher(cfg, manifest).finish(RunJobs(job_ids=["100"], report_job_id="999"))
    out, err = capsys.readouterr()
    assert code == 0 and order == ["tasks", "999"]
    if report_state == "COMPLETED":
        assert not written and "table {'from': 'the report job'}" in out
    else:
        assert written and "report job 999 ended FAILED" in err and "table {'from': 'here'}" in out


class FakeChaining(FakeSlurm):
    """A queue that can hold a job until another has ended (Slurm's afterany): logs each part's after_round."""

    chains_rounds = True

    def submit_stage(self, stage, after, after_round=None):
        jobs = super().submit_stage(stage, after)
        self.calls[-1] = (*self.calls[-1], after_round)
        return jobs


def test_seeds_auto_reserves_are_queued_round_by_round_each_after_the_round_before(tmp_path):
    """A reserve (a variant's third seed on) is queued as its own job after the round before has ended, so its
    call can be made as it starts: it never holds devices while it waits. Not on a launcher that cannot chain."""
    run_dir = tmp_path / "run"
    tasks = []
    for seed in range(4):
        for variant in ("a", "b"):
            t = _task(run_dir, f"{variant}-s{seed}", "variants", len(tasks))
            t.variant, t.seed, t.config = variant, seed, {"seeds": "auto", "seed": 0}
            tasks.append(t)
    stages = [Stage("base", [_task(run_dir, "base", "base", 0)]), Stage("variants", tasks, depends_on=["base"])]
    cfg = OmegaConf.create({"experiment": "e", "launcher": {"kind": "slurm"}})
    manifest = create_run_dir(cfg, "r", run_dir, stages, "slurm")
    launcher = FakeChaining(cfg, manifest)
    run = submit_stages(launcher, stages)
    assert launcher.calls == [
        ("stage", "base", ["base"], None, None),
        ("stage", "variants", ["a-s0", "b-s0", "a-s1", "b-s1"], "100", None),
        ("stage", "variants", ["a-s2", "b-s2"], "100", "101"),
        ("stage", "variants", ["a-s3", "b-s3"], "100", "102"),
        ("report", "103"),  # after the last round, which ends after every round before it
    ]
    assert run.job_ids == ["100", "101", "102", "103"]
    data = Manifest.load(manifest.layout.root).data
    assert [(j["stage"], j["job_id"]) for j in data["jobs"]][1:] == [("variants", i) for i in ("101", "102", "103")]
    assert data["tasks"]["b-s3"]["job_id"] == "103_7" and data["tasks"]["a-s0"]["job_id"] == "101_0"

    plain = FakeSlurm(cfg, create_run_dir(cfg, "r", tmp_path / "run2", stages, "slurm"))
    submit_stages(plain, stages)
    assert [c[2] for c in plain.calls if c[0] == "stage"][1] == [t.name for t in tasks]  # one array, as before
