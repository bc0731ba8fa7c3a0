"""Help generated from the schema (issue 41, item 6), through the real command: `--help` lists the config groups and
their options and every key with its type, default and one line; `resume --help` and `status --help` are whole;
`--info` says where the configs come from; `--help-reference` is docs/reference.md, byte for byte (one source)."""

from pathlib import Path

import pytest
from conftest import REPO, run_cli

from slurm_router.config.reference import config_keys, groups, launcher_keys

pytestmark = pytest.mark.integration


def test_help_lists_the_groups_their_options_and_every_key(tmp_path):
    proc = run_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    out = proc.stdout
    for needle in ("dry_run=true", "--cfg job", "--config-dir DIR", "--info", "\n  init ", "\n  resume "):
        assert needle in out, needle
    assert "see conf/" not in out  # conf/ is inside site-packages after pip install
    section = out[out.index("config groups") : out.index("\nkeys (")]
    assert "  launcher   local*" in section and "  router     affinity" in section
    for group, options in groups():
        assert f"  {group} " in section, group
        for option, _, what in options:
            assert option in section and what, (group, option)
    lines = {line.split()[0]: line for line in out[out.index("\nkeys (") :].splitlines()[2:] if line.startswith("  ")}
    keys = [*config_keys(), *launcher_keys()]
    assert len(keys) > 100
    for k in keys:
        assert k.key in lines, k.key
        assert k.line, f"{k.key} has no comment in its schema class (config/schema.py): --help would show none"
    assert lines["train.lr"].split()[1:] == [
        "float",
        ">0,",
        "<=10",
        "0.002",
        "peak",
        "learning",
        "rate",
        "(AdamW),",
    ] + [
        "after",
        "warmup_steps",
    ]
    assert "[sbatch] render RUN_DIR/submit*.sbatch" in lines["launcher.dry_run"]
    assert lines["data.kind"].split()[1:3] == ["str", "stdlib"]
    # the columns never run into each other (issue 50, 12: `int, list or auto1`, `int 1-4096 or nullnull`)
    assert lines["seeds"].split()[1:6] == ["int,", "list", "or", "auto", "1"], lines["seeds"]
    assert all("nullnull" not in line and "auto1" not in line for line in lines.values())


def test_help_shows_the_users_own_options_with_config_dir(tmp_path):
    assert run_cli("init", "--name", "mine", cwd=tmp_path).returncode == 0
    out = run_cli("--config-dir", "conf", "--help", cwd=tmp_path).stdout
    assert "  experiment lora_ab" in out and "             mine          mine: an experiment of your own" in out
    info = run_cli("-cd", "conf", "--info", cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert f"search path (first wins): file://{Path(REPO) / 'conf'}, file://{tmp_path / 'conf'}" in info.stdout
    assert "defaults: tracker=none launcher=local router=balanced data=stdlib model=gpt2_tiny" in info.stdout


def test_resume_and_status_help_are_whole(tmp_path):
    resume = run_cli("resume", "--help", cwd=tmp_path)
    assert resume.returncode == 0 and resume.stderr == ""
    assert resume.stdout.startswith("usage: slurm-router resume RUN_DIR [launcher=local] [new_snapshot=true]")
    assert "new_snapshot=true" in resume.stdout and resume.stdout.rstrip().endswith("the config it started with.")
    status = run_cli("status", "--help", cwd=tmp_path)
    assert status.returncode == 0
    flat = " ".join(status.stdout.split())
    assert "each task's state, progress and log tail" in flat and "the recent runs (slurm_router.cli.run_list)." in flat
    init = run_cli("init", "--help", cwd=tmp_path)
    assert init.returncode == 0 and "then run with `--config-dir DIR +experiment=NAME`" in " ".join(init.stdout.split())


def test_the_reference_page_is_the_generators_output(tmp_path):
    proc = run_cli("--help-reference", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    page = (REPO / "docs" / "reference.md").read_text()
    assert proc.stdout == page, (
        "docs/reference.md differs from the schema's: regenerate it with "
        "python -m slurm_router --help-reference > docs/reference.md"
    )
    for k in [*config_keys(), *launcher_keys()]:
        assert f"| `{k.key}` |" in page, k.key
