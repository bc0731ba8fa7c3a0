"""Seed replicates (`seeds=3`) and Hydra sweeps (`-m KEY=a,b`): the grid's variant names, the plan (one array job
for variants x seeds), and real runs: here, and on the Slurm test cluster (skipped without sbatch).

The unit tests at the top take seconds; the real runs (integration, slurm) train tiny models."""

import json
import re
import shutil
import subprocess

import pytest
from conftest import run_cli, run_dir_of, step_losses

from slurm_router.__main__ import main
from slurm_router.config.compose import compose
from slurm_router.config.schema import NAME_RE
from slurm_router.config.sweep import fit_name, format_value, short_keys
from slurm_router.config.variants import validate
from slurm_router.launch.plan import make_plan
from slurm_router.rundir.spec import TaskSpec


def grid(*args: str) -> dict:
    """The variants `python -m slurm_router -m ARGS` would run: name -> its config."""
    return validate(compose(list(args), multirun=True))


def plan(*args: str, tmp_path, multirun: bool = False):
    cfg = compose([*args, f"base.cache_dir={tmp_path / 'cache'}"], multirun)
    return make_plan(cfg, validate(cfg), "run", str(tmp_path / "run"))


# ---- naming and grid expansion (fast) ----


def test_a_grid_is_named_from_its_overrides():
    variants = grid("model.lora.r=4,8", "train.lr=1e-3,3e-3")
    assert list(variants) == ["r4_lr1e-3", "r4_lr3e-3", "r8_lr1e-3", "r8_lr3e-3"]
    assert (variants["r8_lr3e-3"].model.lora.r, variants["r8_lr3e-3"].train.lr) == (8, 3e-3)


def test_range_choice_and_quoting_behave_as_in_hydra():
    assert list(grid("train.steps=range(2,8,2)")) == ["steps2", "steps4", "steps6"]
    assert [v.train.lr for v in grid("train.lr=choice(0.5,1e-4)").values()] == [0.5, 1e-4]
    quoted = grid("data=text_dir", "data.path='a,b','/x y/z'")  # a quoted comma is part of the value
    assert {n: v.data.path for n, v in quoted.items()} == {"path-a-b": "a,b", "path-x-y-z": "/x y/z"}
    assert list(grid("model.lora.target_modules=[c_attn],[c_attn,c_proj]")) == [
        "target_modules-c_attn",
        "target_modules-c_attn+c_proj",
    ]
    assert list(grid("train.lr=range(0.25,1,0.25)")) == ["lr0.25", "lr0.5", "lr0.75"]


def test_the_grid_multiplies_the_experiment_and_fixed_overrides_apply_to_all():
    variants = grid("+experiment=lora_ab", "train.lr=1e-3,3e-3", "train.steps=7", "model.lora.alpha=4")
    assert list(variants) == ["r8_lr1e-3", "r8_lr3e-3", "r32_lr1e-3", "r32_lr3e-3"]
    assert {v.model.lora.r for n, v in variants.items() if n.startswith("r32")} == {32}
    assert {v.train.steps for v in variants.values()} == {7}
    # the experiment's own variant settings win over a fixed override, as without -m (alpha is set per variant)
    assert {v.model.lora.alpha for v in variants.values()} == {16, 64}


def test_a_config_group_can_be_swept():
    variants = grid("router=round_robin,balanced", "router.speed_ema=0.3", "train.lr=1e-3,2e-3")
    assert list(variants) == [
        "router-round_robin_lr1e-3",
        "router-round_robin_lr2e-3",
        "router-balanced_lr1e-3",
        "router-balanced_lr2e-3",
    ]
    assert [v.router.policy for v in variants.values()] == ["round_robin"] * 2 + ["balanced"] * 2
    assert {v.router.speed_ema for v in variants.values()} == {0.3}
    assert list(grid("router=glob(*)")) == [
        "router-affinity",
        "router-balanced",
        "router-least_loaded",
        "router-round_robin",
    ]


def test_value_names_are_short_exact_and_file_system_safe():
    assert [format_value(v) for v in (1e-3, 3e-4, 2.5e-4, 0.5, 100.0, -1, True, None, "a/b c", [1, "x"])] == [
        "1e-3",
        "3e-4",
        "2.5e-4",
        "0.5",
        "100",
        "-1",
        "true",
        "null",
        "a-b-c",
        "1+x",
    ]
    assert short_keys(["model.lora.r", "train.lr", "model.lora.dropout"]) == ["r", "lr", "dropout"]
    assert short_keys(["train.lr", "base.lr"]) == ["train.lr", "base.lr"]
    long = [fit_name("x" * 60 + suffix) for suffix in ("_a1", "_a2")]
    assert long[0] != long[1] and all(len(n) <= 64 and NAME_RE.match(n) for n in long)
    assert list(grid("train.warmup_steps=0,1", "model.lora.use_dora=true,false")) == [
        "warmup_steps0_use_dora-true",
        "warmup_steps0_use_dora-false",
        "warmup_steps1_use_dora-true",
        "warmup_steps1_use_dora-false",
    ]


def test_a_sweep_of_100_is_one_array_job_per_stage(tmp_path, capsys):
    """Submitted with launcher=sbatch (dry run: rendered, not submitted): one script, --array over 100 tasks."""
    code = main(
        [
            "-m",
            "model.lora.r=range(4,44,4)",
            "train.lr=choice(1e-4,2e-4,3e-4,5e-4,1e-3,2e-3,3e-3,5e-3,1e-2,2e-2)",
            "data=synthetic",
            "data.n_samples=64",
            "launcher=sbatch",
            "launcher.dry_run=true",
            f"run_root={tmp_path}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    run_dir = run_dir_of(subprocess.CompletedProcess([], 0, out, ""))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert [s["name"] for s in manifest["stages"]] == ["variants"] and len(manifest["tasks"]) == 100
    scripts = list(run_dir.glob("submit*.sbatch"))
    assert len(scripts) == 1 and re.search(r"^#SBATCH --array=0-99\b", scripts[0].read_text(), re.M)


def test_bad_sweep_syntax_from_the_real_command_is_one_line_naming_it(tmp_path):
    proc = run_cli("-m", "model.lora.r=4,8", "train.lr=range(1,", f"run_root={tmp_path}", cwd=tmp_path, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: cannot read the override 'train.lr=range(1,'"), lines[0]
    assert not any(tmp_path.rglob("manifest.json"))


# ---- seed replicates: the plan (fast) ----


def test_seeds_are_more_tasks_of_the_same_stage(tmp_path):
    base, variants = plan("+experiment=lora_ab", "seeds=3", tmp_path=tmp_path)
    assert [t.name for t in base.tasks] == ["base"] and base.tasks[0].seed == 0
    assert [t.name for t in variants.tasks] == ["r8-s0", "r8-s1", "r8-s2", "r32-s0", "r32-s1", "r32-s2"]
    assert [t.index for t in variants.tasks] == list(range(6))
    assert [t.variant for t in variants.tasks] == ["r8"] * 3 + ["r32"] * 3
    assert [t.seed for t in variants.tasks] == [0, 1, 2] * 2
    assert {t.config["seed"] for t in variants.tasks} == {0}  # the base's seed: same base, same eval batches
    listed = plan("+experiment=lora_ab", "seeds=[0,5,9]", "seed=3", tmp_path=tmp_path)[1].tasks
    assert [(t.name, t.seed) for t in listed[:3]] == [("r8-s0", 0), ("r8-s5", 5), ("r8-s9", 9)]
    assert [t.seed for t in plan("seeds=2", "seed=4", tmp_path=tmp_path)[-1].tasks] == [4, 5]


def test_one_seed_is_todays_plan(tmp_path):
    (variants,) = plan("+experiment=lora_ab", "base.enabled=false", tmp_path=tmp_path)
    assert [(t.name, t.variant, t.seed) for t in variants.tasks] == [("r8", "r8", 0), ("r32", "r32", 0)]


def test_seeds_times_a_sweep(tmp_path):
    (variants,) = plan("train.lr=1e-3,3e-3", "seeds=2", tmp_path=tmp_path, multirun=True)
    assert [t.name for t in variants.tasks] == ["lr1e-3-s0", "lr1e-3-s1", "lr3e-3-s0", "lr3e-3-s1"]


def test_old_task_files_load_with_the_configs_seed(tmp_path):
    (variants,) = plan("seed=7", tmp_path=tmp_path)
    fields = json.loads(variants.tasks[0].to_json())
    del fields["seed"]  # a task.json written before replicates existed
    assert TaskSpec(**fields).seed == 7


def test_the_manifest_records_each_tasks_seed_and_variant(tmp_path):
    from slurm_router.rundir.manifest import create_run_dir

    cfg = compose(["+experiment=lora_ab", "seeds=2", f"base.cache_dir={tmp_path / 'cache'}"])
    stages = make_plan(cfg, validate(cfg), "run", str(tmp_path / "run"))
    manifest = create_run_dir(cfg, "run", tmp_path / "run", stages, "local")
    tasks = manifest.data["tasks"]
    assert {n: (t["variant"], t["seed"]) for n, t in tasks.items() if n != "base"} == {
        "r8-s0": ("r8", 0),
        "r8-s1": ("r8", 1),
        "r32-s0": ("r32", 0),
        "r32-s1": ("r32", 1),
    }
    assert json.loads((tmp_path / "run" / "tasks" / "r32-s1" / "task.json").read_text())["seed"] == 1
    from slurm_router.scheduler.task_view import local_status

    assert [t.variant for t in local_status(manifest.data)] == list(tasks)  # one status row per task


def test_the_training_seed_moves_the_lora_init_not_the_base():
    import torch

    from slurm_router.train.data import GlobalBatchSampler
    from slurm_router.train.model import build_model

    cfg = compose(["model.lora.target_modules=[c_attn]"])
    a, b = (build_model(cfg.model, 257, 0, lora_seed=s) for s in (0, 1))
    same = build_model(cfg.model, 257, 0)  # no lora_seed: seeded as before replicates
    for (name, pa), pb, ps in zip(a.named_parameters(), b.parameters(), same.parameters()):
        assert torch.equal(pa, ps), name
        assert torch.equal(pa, pb) == ("lora_A" not in name), name
    first = [GlobalBatchSampler(100, 8, s).batch(0) for s in (0, 1)]
    assert first[0] != first[1]


# ---- real runs ----

TINY = [
    "train.steps=3",
    "train.eval_batches=2",
    "train.eval_batch_size=8",
    "data.max_documents=60",
    "train.global_batch_size=4",
]


def _events(task_dir, kind):
    rows = [json.loads(line) for line in (task_dir / "events-rank0.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == kind]


@pytest.mark.integration
def test_a_sweep_runs_its_variants_named_by_their_overrides(tmp_path):
    proc = run_cli("-m", "model.lora.r=4,8", "train.lr=1e-3,3e-3", *TINY, f"run_root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    names = ["r4_lr1e-3", "r4_lr3e-3", "r8_lr1e-3", "r8_lr3e-3"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert {n: t["state"] for n, t in manifest["tasks"].items()} == dict.fromkeys(names, "completed")
    for name in names:
        start = _events(run_dir / "tasks" / name, "start")[0]
        assert start["lr"] == float(name.split("lr")[1]) and start["variant"] == name


@pytest.mark.integration
def test_lora_ab_with_three_seeds(tmp_path, base_cache):
    proc = run_cli(
        "+experiment=lora_ab",
        "seeds=3",
        "base.steps=8",
        *TINY,
        f"base.cache_dir={base_cache}",
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 variant(s) r8, r32 x 3 training seeds (0, 1, 2) = 6 tasks" in proc.stdout
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    tasks = {n: t for n, t in manifest["tasks"].items() if t["stage"] == "variants"}
    assert sorted(tasks) == sorted(f"{v}-s{s}" for v in ("r8", "r32") for s in (0, 1, 2))
    assert all(t["state"] == "completed" for t in tasks.values())
    assert {n: t["seed"] for n, t in tasks.items()} == {n: int(n[-1]) for n in tasks}
    dirs = {n: run_dir / "tasks" / n for n in tasks}
    start_val = {n: _events(d, "eval")[0] for n, d in dirs.items()}
    assert {e["step"] for e in start_val.values()} == {0}
    # the same base and the same held-out batches for every replicate: one step-0 held-out loss
    assert len({e["val_loss"] for e in start_val.values()}) == 1
    losses = {n: step_losses(d) for n, d in dirs.items()}
    for v in ("r8", "r32"):  # the data order (and LoRA init) move with the seed
        assert len({tuple(losses[f"{v}-s{s}"]) for s in (0, 1, 2)}) == 3
        assert len({losses[f"{v}-s{s}"][0] for s in (0, 1, 2)}) == 3
    for s in (0, 1, 2):  # and only with the seed: step 0 is the base on one batch
        assert losses[f"r8-s{s}"][0] == pytest.approx(losses[f"r32-s{s}"][0], rel=1e-6)
    # export: the winner's adapter is its best seed's; a variant of 3 replicates is named by one of them
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    won = run_cli(str(run_dir), module="slurm_router.export")
    assert won.returncode == 0 and f"tasks/{summary['winner']['task']}/adapter" in won.stdout, won.stderr
    which = run_cli(str(run_dir), "r8", "--merge", str(tmp_path / "out"), module="slurm_router.export")
    assert which.returncode == 2 and "r8 ran 3 training seeds: name one of its replicates (r8-s0" in which.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slurm
@pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)
def test_three_seeds_on_slurm_are_one_array_job_of_six_tasks(tmp_path):
    proc = run_cli(
        "+experiment=lora_ab",
        "seeds=3",
        "base.steps=8",
        *TINY,
        "launcher=slurm",
        "launcher.wait=true",
        "launcher.timeout_min=10",
        f"base.cache_dir={tmp_path / 'cache'}",
        f"run_root={tmp_path}",
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    manifest = json.loads((run_dir_of(proc) / "manifest.json").read_text())
    (job,) = [j for j in manifest["jobs"] if j["stage"] == "variants"]
    assert job["array"] and len(job["tasks"]) == 6
    out = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-o", "JobID,State", "-j", job["job_id"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = dict(line.split("|")[:2] for line in out.splitlines() if line)
    assert sorted(rows) == sorted(f"{job['job_id']}_{i}" for i in range(6)), rows
    assert set(rows.values()) == {"COMPLETED"}, rows
    assert sorted(t["variant"] for t in job["tasks"]) == sorted(f"{v}-s{s}" for v in ("r8", "r32") for s in range(3))


def test_a_variant_with_no_overrides_is_the_experiment_itself():
    """`variants={a: {}, b: null}` (an A/A pair): each is the experiment's config as it is, not a traceback."""
    variants = validate(compose(["+experiment=lora_ab", "++variants={a: {}, b: null}"]))
    assert list(variants) == ["r8", "r32", "a", "b"]
    assert variants["a"].model.lora.r == variants["b"].model.lora.r == 8 and variants["a"].train.lr == 5e-3
