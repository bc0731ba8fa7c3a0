"""A new user's own experiment, through the real command (issue 41, item 1): `init` writes a commented starter
experiment into an empty repo; `--config-dir DIR +experiment=NAME dry_run=true` shows its plan, then the same
command trains it and writes the report; `-cd` and `hydra.searchpath=[...]` are the same folder; `--cfg hydra` shows
the search path; an experiment not found lists the user's own. Mistakes in a user's folder: tests/test_bad_input_table.py."""

import json

import pytest
import yaml
from conftest import run_cli, run_dir_of

pytestmark = pytest.mark.integration

SMALL = ["train.steps=4", "base.steps=4", "data.max_documents=60", "train.eval_batches=2", "train.eval_every=2"]


def test_init_then_a_dry_run_then_a_real_run_from_the_users_own_folder(tmp_path, base_cache):
    repo = tmp_path / "repo"
    repo.mkdir()
    init = run_cli("init", cwd=repo)
    assert init.returncode == 0, init.stderr
    starter = repo / "conf" / "experiment" / "my_experiment.yaml"
    text = starter.read_text()
    assert text.startswith("# @package _global_\n")
    assert init.stdout.splitlines()[0].startswith("wrote conf/experiment/my_experiment.yaml: a commented starter")
    assert "--config-dir conf +experiment=my_experiment dry_run=true" in init.stdout
    loaded = yaml.safe_load(text)
    assert loaded["experiment"] == "my_experiment" and set(loaded["variants"]) == {"r8", "r32"}
    assert loaded["base"]["enabled"] is True  # LoRA over a trained base, not a random one

    again = run_cli("init", cwd=repo)  # never overwritten; one line, exit 2
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: {starter} exists: it is kept as it is; give another --name, or edit that file"
    ]
    assert starter.read_text() == text

    common = [*SMALL, f"base.cache_dir={base_cache}", f"run_root={tmp_path / 'runs'}"]
    dry = run_cli("--config-dir", "conf", "+experiment=my_experiment", "dry_run=true", *common, cwd=repo)
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert dry.stdout.startswith("experiment my_experiment: 2 variant(s) r8, r32;")
    assert "stage 1 base" in dry.stdout and "nothing was trained or submitted" in dry.stdout

    real = run_cli("--config-dir", "conf", "+experiment=my_experiment", *common, cwd=repo)
    assert real.returncode == 0, real.stdout[-3000:] + real.stderr[-3000:]
    run_dir = run_dir_of(real)
    assert run_dir.parent.name == "my_experiment"
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["experiment"] == "my_experiment" and set(summary["variants"]) == {"r8", "r32"}
    assert (run_dir / "report" / "report.md").is_file()
    # the run keeps its composed config: resume= and the Slurm jobs need not find the user's folder again
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["eval_every"] == 2


def test_init_into_a_named_folder_and_the_other_spellings_of_a_config_dir(tmp_path):
    init = run_cli("init", "configs", "--name", "rank_sweep", cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    assert (tmp_path / "configs" / "experiment" / "rank_sweep.yaml").is_file()
    for spelling in (["-cd", "configs"], ["--config-dir=configs"], [f"hydra.searchpath=[file://{tmp_path}/configs]"]):
        shown = run_cli(*spelling, "+experiment=rank_sweep", "--cfg", "hydra", cwd=tmp_path)
        assert shown.returncode == 0, (spelling, shown.stderr)
        hydra = yaml.safe_load(shown.stdout)["hydra"]
        assert hydra["searchpath"][-1] == f"file://{tmp_path}/configs"
        assert hydra["choices"]["experiment"] == "rank_sweep"
        assert "outputs" not in shown.stdout and "multirun" not in shown.stdout  # Hydra's dirs, never used here
    missing = run_cli("-cd", "configs", "+experiment=rank_swep", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: experiment=rank_swep: no such experiment in conf/experiment/ or {tmp_path}/configs/experiment/; "
        "choose one of: lora_ab, rank_sweep"
    ]
    clash = run_cli("init", "--name", "lora_ab", cwd=tmp_path)
    assert clash.returncode == 2 and "a built-in experiment has that name" in clash.stderr
    assert not (tmp_path / "conf").exists()
