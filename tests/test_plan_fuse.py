"""resources.fuse_variants=K (issue 28) around the fused worker: the planner groups the variants stage's compatible
tasks in queue order into fused tasks of up to K (launch/fuse.py), each task keeps its own folder and task.json,
the manifest's stage lists only the tasks that run (indexed 0..N-1) and mirrors a leader's records onto its
members, the job and resume= treat a group as done only when every variant is, Slurm's status shows the members,
and the refusals and the preview go through the real command."""

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import event_rows, run_cli, run_dir_of

from slurm_router.config.compose import compose
from slurm_router.config.variants import validate
from slurm_router.launch.fuse import fuse_tasks, not_fusable
from slurm_router.launch.plan import make_plan, prune_layout_note, queue_order, trained_variants
from slurm_router.rundir.manifest import IDENTITY_FIELDS, Manifest, create_run_dir
from slurm_router.rundir.spec import TaskSpec

FAST = ["base.enabled=false", "train.steps=2", "data.max_documents=60"]


def _plan(tmp_path: Path, *overrides: str, multirun: bool = True):
    cfg = compose([*FAST, *overrides], multirun)
    return cfg, make_plan(cfg, validate(cfg), "run", str(tmp_path / "run"))


def _groups(stage) -> list[list[str]]:
    return [t.group for t in stage.tasks]


def test_compatible_tasks_fuse_in_queue_order_up_to_k(tmp_path, capsys):
    _, [stage] = _plan(tmp_path, "model.lora.r=4,8,16", "seeds=2", "resources.fuse_variants=4")
    # queue order is seed by seed across variants: r4-s0, r8-s0, r16-s0, r4-s1 | r8-s1, r16-s1
    assert _groups(stage) == [["r4-s0", "r8-s0", "r16-s0", "r4-s1"], ["r8-s1", "r16-s1"]]
    assert [(t.name, t.index) for t in stage.tasks] == [("r4-s0", 0), ("r8-s1", 1)]
    by_name = {t.name: t for t in stage.fused}
    assert {n: (t.fused_into, t.index, t.members) for n, t in by_name.items()} == {
        "r8-s0": ("r4-s0", 0, []),
        "r16-s0": ("r4-s0", 0, []),
        "r4-s1": ("r4-s0", 0, []),
        "r16-s1": ("r8-s1", 1, []),
    }
    out = capsys.readouterr().out
    assert (
        "resources.fuse_variants=4: 6 variant task(s) run as 2 task(s): 6 fused into 2 (one base in memory each), "
        "0 alone" in out
    )
    _, [stage] = _plan(tmp_path, "model.lora.r=4,8,16", "seeds=2", "resources.fuse_variants=2")
    assert _groups(stage) == [["r4-s0", "r8-s0"], ["r16-s0", "r4-s1"], ["r8-s1", "r16-s1"]]
    assert [t.index for t in stage.tasks] == [0, 1, 2] and queue_order(stage.tasks) == stage.tasks  # kept
    # K larger than the tasks: one group; the leader is variant 0, members[i] variant i+1
    _, [stage] = _plan(tmp_path, "model.lora.r=4,8", "resources.fuse_variants=8")
    assert _groups(stage) == [["r4", "r8"]] and stage.tasks[0].fused_into is None


def test_fuse_variants_1_plans_as_before(tmp_path, capsys):
    _, [stage] = _plan(tmp_path, "model.lora.r=4,8", "seeds=2")
    assert [(t.name, t.index, t.members, t.fused_into) for t in stage.tasks] == [
        ("r4-s0", 0, [], None),
        ("r4-s1", 1, [], None),
        ("r8-s0", 2, [], None),
        ("r8-s1", 3, [], None),
    ]
    assert stage.fused == [] and "fuse_variants" not in capsys.readouterr().out


def test_what_a_variant_owns_may_differ_within_a_fused_task(tmp_path, capsys):
    _, [stage] = _plan(
        tmp_path,
        "model.lora.r=4,8",
        "model.lora.alpha=8,32",
        "model.lora.target_modules=[c_attn],[c_attn,c_proj]",
        "train.lr=1e-3,3e-3",
        "train.weight_decay=0,0.1",
        "train.grad_clip=0.5,1",
        "train.warmup_steps=0,2",
        "train.global_batch_size=8,16",
        "resources.fuse_variants=64",
    )
    assert _groups(stage) and all(len(g) == 64 for g in _groups(stage)) and len(stage.tasks) == 2**8 // 64
    assert "0 alone" in capsys.readouterr().out


def test_a_task_that_cannot_join_runs_alone_with_one_line_naming_variant_and_key(tmp_path, capsys):
    variants = (
        "++variants={a: {model: {lora: {r: 4}}}, b: {model: {lora: {r: 16}}}, dora: {model: {lora: {use_dora: true}}},"
        " drop: {model: {lora: {dropout: 0.1}}}, full: {model: {lora: {enabled: false}}},"
        " long: {data: {max_len: 128}}}"
    )
    _, [stage] = _plan(tmp_path, variants, "seeds=2", "resources.fuse_variants=8", multirun=False)
    assert _groups(stage) == [
        ["a-s0", "b-s0", "a-s1", "b-s1"],
        ["dora-s0"],
        ["drop-s0"],
        ["full-s0"],
        ["long-s0", "long-s1"],  # they differ from a's group, not from each other
        ["dora-s1"],
        ["drop-s1"],
        ["full-s1"],
    ]
    assert [t.index for t in stage.tasks] == list(range(8))
    lines = [line for line in capsys.readouterr().out.splitlines() if "runs unfused" in line]
    assert lines == [
        "resources.fuse_variants: variant dora runs unfused: model.lora.use_dora=true: DoRA is not fused",
        "resources.fuse_variants: variant drop runs unfused: model.lora.dropout=0.1: LoRA dropout would draw every "
        "variant's masks from one random stream (set model.lora.dropout=0 to fuse it)",
        "resources.fuse_variants: variant full runs unfused: model.lora.enabled=false: full fine-tuning has no "
        "adapter over a shared frozen base",
    ]  # one line per variant, not per seed; long fused with itself, so says nothing


def test_an_incompatible_task_alone_names_the_key_and_the_other_value(tmp_path, capsys):
    variants = "++variants={r8: {model: {lora: {r: 8}}}, r32: {model: {lora: {r: 32}}}, long: {data: {max_len: 128}}}"
    _, [stage] = _plan(tmp_path, variants, "resources.fuse_variants=2", multirun=False)
    assert _groups(stage) == [["r8", "r32"], ["long"]]
    out = capsys.readouterr().out
    assert (
        "resources.fuse_variants: variant long runs unfused: data.max_len=128 (r8 has 256); only model.lora.*, "
        "train.lr, train.weight_decay, train.grad_clip, train.warmup_steps, train.global_batch_size and the "
        "training seed may differ within a fused task" in out
    )
    assert "3 variant task(s) run as 2 task(s): 2 fused into 1 (one base in memory each), 1 alone" in out
    # alone only because its group was full (K): no line
    _, [stage] = _plan(tmp_path, "model.lora.r=4,8,16", "resources.fuse_variants=2")
    assert _groups(stage) == [["r4", "r8"], ["r16"]] and "runs unfused" not in capsys.readouterr().out


def test_the_base_stage_is_never_fused(tmp_path):
    cfg = compose(
        ["+experiment=lora_ab", "resources.fuse_variants=4", f"base.cache_dir={tmp_path / 'cache'}", "base.steps=2"]
    )
    base, variants = make_plan(cfg, validate(cfg), "run", str(tmp_path / "run"))
    assert [t.group for t in base.tasks] == [["base"]] and base.fused == []
    assert _groups(variants) == [["r8", "r32"]]


def test_not_fusable_reads_the_real_keys():
    assert not_fusable({"model": {"lora": {"enabled": True, "use_dora": False, "dropout": 0.0}}}) is None
    assert "use_dora" in (not_fusable({"model": {"lora": {"enabled": True, "use_dora": True}}}) or "")


def test_what_the_fused_worker_does_not_do_keeps_a_task_alone():
    """Settings the fused worker would not honour are reasons, never silently dropped."""
    lora = {"lora": {"enabled": True, "use_dora": False, "dropout": 0.0}}
    for train, key in (
        ({"packing": "false"}, "train.packing=false"),
        ({"compile": True}, "train.compile=true"),
        ({"loss_chunk_tokens": 4096}, "train.loss_chunk_tokens=4096"),
    ):
        assert (not_fusable({"model": lora, "train": train}) or "").startswith(key), train
    assert not_fusable({"model": lora, "train": {"packing": "auto", "compile": False, "loss_chunk_tokens": 0}}) is None


def _spec(tmp_path: Path, name: str, variant: str, seed: int, **config) -> TaskSpec:
    cfg = {"seed": 0, "model": {"lora": {"enabled": True, "r": 8}}, "data": {"max_len": 64}, **config}
    return TaskSpec("run", str(tmp_path), "e", name, "variants", variant, 0, 1, cfg, 2, 1e-3, 8, True, seed=seed)


def test_prune_layout_counts_the_variants_a_fused_task_trains(tmp_path):
    tasks = [_spec(tmp_path, f"{v}-s{s}", v, s) for v in ("r8", "r32") for s in (0, 1)]
    fusion = fuse_tasks(queue_order(tasks), 4)
    from slurm_router.rundir.spec import Stage

    stage = Stage("variants", fusion.runs, fused=fusion.fused)
    assert [t.name for t in stage.tasks] == ["r8-s0"]
    # one task at a time, yet it trains both seeds of both variants side by side: nothing is blind
    assert prune_layout_note(stage.tasks, 1, trained_variants(stage)) is None
    assert "r8 can never be compared" in (prune_layout_note(stage.tasks, 1) or "")  # counted as one variant


def _fused_run(tmp_path: Path) -> Manifest:
    cfg, stages = _plan(tmp_path, "model.lora.r=4,8,16", "resources.fuse_variants=2")
    return create_run_dir(cfg, "run", tmp_path / "run", stages, "local")


def test_the_run_dir_has_every_task_and_the_stage_only_those_that_run(tmp_path):
    manifest = _fused_run(tmp_path)
    assert manifest.stage_tasks("variants") == ["r4", "r16"]
    tasks = manifest.data["tasks"]
    assert list(tasks) == ["r4", "r8", "r16"]  # each member right after its leader
    assert tasks["r4"]["members"] == ["r8"] and "fused_into" not in tasks["r4"]
    assert tasks["r8"]["fused_into"] == "r4" and tasks["r8"]["index"] == 0 and "members" not in tasks["r8"]
    assert tasks["r16"]["index"] == 1 and "members" not in tasks["r16"]
    for name in ("r4", "r8", "r16"):
        spec = TaskSpec.load(manifest.layout.task(name).task_file)
        assert spec.name == name and spec.variant == name
    leader = TaskSpec.load(manifest.layout.task("r4").task_file)
    leader.attempt = 3
    specs = leader.group_specs()
    assert [s.name for s in specs] == ["r4", "r8"] and specs[1].fused_into == "r4" and specs[1].attempt == 3


def test_a_leaders_records_reach_its_members_and_their_identity_stays(tmp_path):
    manifest = _fused_run(tmp_path)
    before = {k: v for k, v in manifest.data["tasks"]["r8"].items() if k in IDENTITY_FIELDS}
    manifest.set_task("r4", state="running", devices=["cpu0"], log_path="/x/r4.log", pid=123, job_id="7_0")
    on_disk = json.loads(manifest.path.read_text())["tasks"]
    member = on_disk["r8"]
    assert member["state"] == "running" and member["job_id"] == "7_0" and member["pid"] == 123
    assert {k: v for k, v in member.items() if k in IDENTITY_FIELDS} == before  # devices, index, variant, ...
    assert on_disk["r16"]["state"] == "pending" and "job_id" not in on_disk["r16"]  # not of the group
    # in-place changes written with save() (submit_stages' _record), and a later writer's own update
    manifest.data["tasks"]["r4"].update(state="completed", exit_code=0, elapsed_s=1.5)
    manifest.save()
    Manifest.load(manifest.layout.root).update(lambda d: d["tasks"]["r4"].update(note="done"))
    member = json.loads(manifest.path.read_text())["tasks"]["r8"]
    assert (member["state"], member["exit_code"], member["elapsed_s"], member["note"]) == ("completed", 0, 1.5, "done")
    assert member["fused_into"] == "r4" and member["variant"] == "r8" and member["seed"] == before["seed"]


def test_a_task_json_written_before_fusion_loads(tmp_path):
    old = asdict(_spec(tmp_path, "r8", "r8", 0))
    for key in ("members", "fused_into", "seed"):
        old.pop(key)
    path = tmp_path / "task.json"
    path.write_text(json.dumps(old))
    spec = TaskSpec.load(path)
    assert spec.members == [] and spec.fused_into is None and spec.seed == 0 and spec.group == ["r8"]


def test_a_group_is_done_only_when_every_variant_has_its_result(tmp_path):
    from slurm_router.supervise.job import _unfinished, run_task

    manifest = _fused_run(tmp_path)
    leader_file = manifest.layout.task("r4").task_file
    leader = TaskSpec.load(leader_file)
    assert _unfinished(leader) == ["r4", "r8"]
    manifest.layout.task("r4").result.write_text(json.dumps({"variant": "r4", "exit_state": "pruned"}))
    assert _unfinished(leader) == ["r8"]
    manifest.layout.task("r8").result.write_text(json.dumps({"variant": "r8"}))
    assert _unfinished(leader) == []
    assert run_task(str(leader_file)) == {"variant": "r4", "exit_state": "pruned"}  # no worker started


def test_a_failure_ends_every_unfinished_variant_of_the_group(tmp_path):
    from slurm_router.supervise.job import _end_failed

    cfg, stages = _plan(tmp_path, "model.lora.r=4,8,16", "resources.fuse_variants=3")
    manifest = create_run_dir(cfg, "run", tmp_path / "run", stages, "local")
    layout = manifest.layout
    layout.task("r8").result.write_text("{}")  # pruned before the failure: its end stands
    leader = TaskSpec.load(layout.task("r4").task_file)
    leader.attempt = 2
    _end_failed(leader, "r4: worker 0 died")
    for name, ended in (("r4", True), ("r8", False), ("r16", True)):
        rows = [r for r in event_rows(layout.task(name).dir) if r.get("event") == "end"]
        assert bool(rows) is ended, (name, rows)
        if ended:
            assert rows[0]["exit_state"] == "failed" and rows[0]["error"] == "r4: worker 0 died"
            assert rows[0]["task"] == name and rows[0]["attempt"] == 2


def test_resume_reruns_a_group_while_any_variant_is_unfinished_and_never_a_member_alone(tmp_path, capsys):
    from slurm_router.launch.resume import plan_resume
    from slurm_router.rundir.lock import release_all

    manifest = _fused_run(tmp_path)
    layout = manifest.layout

    def plan() -> list[tuple[list[str], list[str]]]:
        try:
            _, _, stages = plan_resume(str(layout.root))
        finally:
            release_all()
        return [([t.name for t in s.tasks], [t.name for t in s.fused]) for s in stages if not s.cached]

    assert plan() == [(["r4", "r16"], ["r8"])]
    layout.task("r8").result.write_text("{}")  # the member ended (pruned), the leader did not
    layout.task("r16").result.write_text("{}")
    assert plan() == [(["r4"], ["r8"])]
    assert "r4 (+ r8 fused) from step 0" in capsys.readouterr().out
    layout.task("r4").result.write_text("{}")
    assert plan() == []
    assert "r4 (+ r8 fused) completed" in capsys.readouterr().out


def test_slurm_status_shows_each_member_with_its_leaders_job(tmp_path):
    from slurm_router.backends.slurm.parse import merge_status, mirror_fused, parse_squeue

    manifest = _fused_run(tmp_path).data
    manifest["jobs"] = [
        {
            "stage": "variants",
            "job_id": "7",
            "array": True,
            "tasks": [{"variant": "r4", "array_index": 0, "job_id": "7_0"}, {"variant": "r16", "job_id": "7_1"}],
        }
    ]
    squeue = parse_squeue("7_0|RUNNING|0:05|0|node1|None\n7_1|PENDING|0:00|0||Resources\n")
    tasks = mirror_fused(manifest, merge_status(manifest, squeue, {}))
    assert [(t.variant, t.job_id, t.state) for t in tasks] == [
        ("r4", "7_0", "RUNNING"),
        ("r8", "7_0", "RUNNING"),
        ("r16", "7_1", "PENDING"),
    ]


# ---- the real command: refusals (exit 2, one line, nothing written) and the preview


@pytest.mark.parametrize("launcher", ["slurm", "sbatch"])
def test_srun_workers_is_refused_in_one_line(tmp_path, launcher):
    proc = run_cli(
        *FAST,
        "-m",
        "model.lora.r=4,8",
        "resources.fuse_variants=2",
        f"launcher={launcher}",
        "launcher.srun_workers=true",
        "dry_run=true",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "resources.fuse_variants=2 and launcher.srun_workers=true do not combine" in lines[0]
    assert "set launcher.srun_workers=false" in lines[0] and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "value, says",
    [
        ("1.5", "give K, the most variants fused into one task (e.g. resources.fuse_variants=4; 1: off), or auto"),
        ("true", "give K, the most variants fused into one task"),
        ("Auto", "resources.fuse_variants='Auto': give K"),
        ("0", "resources.fuse_variants=0 is out of range: it must be >= 1"),
    ],
)
def test_a_bad_fuse_variants_is_one_line(tmp_path, value, says):
    proc = run_cli(*FAST, f"resources.fuse_variants={value}", "dry_run=true", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_sweep_cannot_set_fuse_variants_per_variant(tmp_path):
    proc = run_cli(*FAST, "-m", "resources.fuse_variants=1,2", "dry_run=true", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "resources.fuse_variants cannot be swept" in proc.stderr, proc.stderr
    assert "variants." not in proc.stderr.replace("fuse_variants", "")  # no internal variant's name (issue 41)
    assert not (tmp_path / "runs").exists()


def test_the_preview_shows_the_groups_and_the_first_lines_count_them(tmp_path):
    proc = run_cli(
        *FAST,
        "-m",
        "model.lora.r=8,32",
        "seeds=2",
        "resources.fuse_variants=2",
        "launcher=sbatch",
        "dry_run=true",
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    first = out.splitlines()[:3]
    assert any(
        "resources.fuse_variants=2: 4 variant task(s) run as 2 task(s): 4 fused into 2 (one base in memory each), "
        "0 alone" in line
        for line in first
    ), first
    assert (
        "stage 1 variants: 2 task(s) x 1 device(s) (4 variant task(s) run as 2: 4 fused into 2 by "
        "resources.fuse_variants=2, each fused task holding one base in memory); one Slurm array of 2 task(s)"
    ) in out, out
    # one line for the group, its members named (issue 50, 9)
    assert re.search(
        r"^  r8 \+ r32 fused, seeds 0, 1 \(tasks r8-s0, r8-s1\): .*one variant's: each task trains 2\)$", out, re.M
    ), out
    run_dir = run_dir_of(proc)
    script = next(run_dir.glob("submit*.sbatch")).read_text()
    assert re.search(r"^#SBATCH --array=0-1\b", script, re.M), script
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"][0]["tasks"] == ["r8-s0", "r8-s1"]
    assert sorted(manifest["tasks"]) == ["r32-s0", "r32-s1", "r8-s0", "r8-s1"]


def test_fused_tasks_colocate_in_array_tasks(tmp_path):
    """resources.tasks_per_gpu=2 under Slurm co-locates two fused tasks (their leaders) in one array task."""
    proc = run_cli(
        *FAST,
        "-m",
        "model.lora.r=8,32",
        "seeds=2",
        "resources.fuse_variants=2",
        "resources.tasks_per_gpu=2",
        "launcher=sbatch",
        "dry_run=true",
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "one Slurm array of 1 task(s) (2 tasks co-located each)" in proc.stdout
    from slurm_router.supervise.colocate import colocated_task_files

    run_dir = run_dir_of(proc)
    files = colocated_task_files(str(run_dir), "variants", 0, 2)
    assert [Path(f).parent.name for f in files] == ["r8-s0", "r8-s1"]  # the leaders; each trains its members


# ---- resources.fuse_variants=auto (launcher=local: backends/local/launcher.py auto_fuse_variants) --------------------------
@pytest.mark.parametrize("slots, k, groups", [(2, 2, ["r4 + r8", "r16 + r32"]), (1, 4, ["r4 + r8 + r16 + r32"])])
def test_auto_spreads_the_tasks_over_the_slots_the_machine_runs_at_once(tmp_path, slots, k, groups):
    """auto: as many fused tasks as the local launcher runs at once (none idle, none waiting for a slot), each of
    ceil(tasks / slots) variants; said in one line before the groups."""
    proc = run_cli(
        *FAST,
        "-m",
        "model.lora.r=4,8,16,32",
        "resources.fuse_variants=auto",
        f"launcher.cpu_slots={slots}",
        "dry_run=true",
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
        timeout=300,
        env={"CUDA_VISIBLE_DEVICES": ""},  # the CPU slots, whatever this machine has
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resources.fuse_variants=auto: K={k} for 4 variant task(s) over {slots} CPU task slot(s)" in proc.stdout
    for group in groups:
        assert f"  {group} fused, " in proc.stdout, proc.stdout  # one line per fused task, its members named


def test_auto_fuses_no_more_variants_than_the_memory_model_fits(monkeypatch):
    """A fused task holds every variant's batch at once: K drops until its predicted peak fits the device's share."""
    import slurm_router.backends.local.launcher as local

    cfg = compose([*FAST, "resources.fuse_variants=auto"], False)
    monkeypatch.setattr(local, "device_pool", lambda cfg: (["cpu0"], False))  # one slot: K = every task
    peak = local.task_peak_bytes(cfg, "cpu")
    assert peak(4) > peak(2) > peak(1) > 0
    assert local.auto_fuse_variants(cfg, 8)[0] == 8  # this machine's memory holds 8 small variants' batches
    room = int(peak(3) / cfg.router.memory_headroom) + 1  # bytes where 3 fit and 4 do not
    pages = room // 4096 + 1
    monkeypatch.setattr(local.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": pages}[name])
    k, why = local.auto_fuse_variants(cfg, 8)
    assert k == 3 and why.startswith("resources.fuse_variants=auto: K=3 for 8 variant task(s)"), why


def test_auto_runs_through_the_real_command_and_every_variant_ends(tmp_path):
    proc = run_cli(
        *FAST,
        "-m",
        "model.lora.r=4,8,16",
        "resources.fuse_variants=auto",
        "launcher.cpu_slots=2",
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
        timeout=300,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resources.fuse_variants=auto: K=2 for 3 variant task(s)" in proc.stdout
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"][0]["tasks"] == ["r4", "r16"]  # r4 + r8 fused, r16 alone
    for name in ("r4", "r8", "r16"):
        result = json.loads((run_dir / "tasks" / name / "result.json").read_text())
        assert result["steps"] == 2 and result["val_loss"] > 0, result


@pytest.mark.parametrize("launcher", ["slurm", "sbatch"])
def test_auto_is_refused_where_the_devices_are_unknown_at_submit_time(tmp_path, launcher):
    proc = run_cli(*FAST, "resources.fuse_variants=auto", f"launcher={launcher}", "dry_run=true", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "resources.fuse_variants=auto works with launcher=local only" in proc.stderr
    assert "set resources.fuse_variants=K" in proc.stderr and not (tmp_path / "runs").exists()


def test_auto_with_memory_sized_gpu_packing_is_refused(monkeypatch):
    import slurm_router.backends.local.launcher as local
    from slurm_router.errors import UserError

    monkeypatch.setattr(local, "detect_gpus", lambda: ["0"])
    cfg = compose([*FAST, "resources.fuse_variants=auto", "resources.tasks_per_gpu=0"], False)
    with pytest.raises(UserError, match="both size by predicted memory"):
        local.check_devices(cfg)
