"""What a newcomer's first commands print (issue 41, findings 5, 7 and 10), through the real command: a path typed
as users type it (data.path=~/my_texts, spaces, '#', '&', accents) is read, or refused in one line naming the key
and how to quote it; the plan says when LoRA trains on a randomly initialised model; the fused plan agrees with
itself (the memory a fused task may use against the device's, each variant's lr, the K that auto chose, a line
for none fused) and a sweep of resources.fuse_variants names the key, not an internal variant."""

import re
from pathlib import Path

import pytest
import yaml
from conftest import run_cli, run_dir_of

pytestmark = pytest.mark.integration

FAST = ["train.steps=4", "data.max_documents=60", "train.eval_batches=2", "dry_run=true"]
RANDOM_BASE = (
    "note: no base stage and no checkpoint: LoRA fine-tunes a randomly initialised model (its losses compare "
    "settings, not fine-tuning); +experiment=lora_ab trains a base first, model=hf model.name_or_path=DIR uses yours"
)


def _texts(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(
            "\n".join(f"line {j} of document {i}: some words to train on" for j in range(400))
        )
    return folder


def test_a_path_with_a_tilde_and_the_characters_users_type_is_read(tmp_path):
    home = tmp_path / "home"
    _texts(home / "my_texts")
    proc = run_cli(
        "data=text_dir",
        "data.path=~/my_texts",
        *FAST,
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
        env={"HOME": str(home)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data text_dir ~/my_texts: " in proc.stdout.splitlines()[0]
    assert yaml.safe_load((run_dir_of(proc) / "config.yaml").read_text())["data"]["path"] == "~/my_texts"
    odd = _texts(tmp_path / "my texts #1 & café=new")
    proc = run_cli("data=text_dir", f"data.path={odd}", *FAST, f"run_root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert yaml.safe_load((run_dir_of(proc) / "config.yaml").read_text())["data"]["path"] == str(odd)


def test_a_sweep_of_paths_hydra_cannot_read_unquoted_is_one_line_saying_how_to_quote(tmp_path):
    proc = run_cli("-m", "data=text_dir", "data.path=~/a,~/b", *FAST, f"run_root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and not list(tmp_path.iterdir()), (proc.stdout, proc.stderr)
    assert proc.stderr.strip() == (
        "error: data.path=~/a,~/b: data.path holds '~', which Hydra reads only inside quotes: quote each value, "
        "inside the shell's quotes: \"data.path='~/a','~/b'\""
    )


def test_the_plan_says_when_lora_trains_on_a_randomly_initialised_model(tmp_path):
    for args in (["train.steps=4"], ["-m", "model.lora.r=4,8"]):  # the bare command, a sweep without a base
        proc = run_cli(*args, *FAST[1:], f"run_root={tmp_path}", cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.splitlines().count(RANDOM_BASE) == 1, proc.stdout + proc.stderr
    for args in (
        ["+experiment=lora_ab", "base.steps=4"],
        ["-m", "+experiment=lora_ab", "base.steps=4", "train.lr=1e-3,3e-3"],
    ):
        proc = run_cli(*args, *FAST, f"run_root={tmp_path}", cwd=tmp_path)
        assert proc.returncode == 0 and "randomly initialised" not in proc.stdout, proc.stdout + proc.stderr


def test_the_fused_plan_agrees_with_itself(tmp_path):
    proc = run_cli(
        "+experiment=lora_ab",
        "+variants.r4.model.lora.r=4",
        "+variants.r16.model.lora.r=16",
        "variants.r4.train.lr=1e-3",
        "resources.fuse_variants=auto",
        "launcher.cpu_slots=2",
        "base.steps=4",
        *FAST,
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    ram = re.search(r"devices are cpu: this machine's RAM \(CPU workers share it\), ([\d.]+) GiB", proc.stdout)
    auto = next(line for line in out if line.startswith("resources.fuse_variants=auto: K=2 for 4 variant task(s)"))
    allowed = re.search(
        r"of the ([\d.]+) GiB it may use \(router.memory_headroom=0.85 x this machine's RAM, ([\d.]+) GiB, over 2 slot\(s\)\)$",
        auto,
    )
    assert ram and allowed and allowed.group(2) == ram.group(1), auto  # one machine, one figure for its memory
    assert abs(float(allowed.group(1)) - 0.85 * float(ram.group(1)) / 2) < 0.01
    assert "resources.fuse_variants=auto (K=2): 4 variant task(s) run as 2 task(s): 4 fused into 2" in proc.stdout
    assert "  resources.fuse_variants=auto (K=2): 4 variant task(s) run as 2 task(s)" in proc.stdout
    assert not [line for line in out if "fuse_variants=2" in line], proc.stdout  # the user typed auto
    r4 = next(line for line in out if line.startswith("  r4, seed 0: "))
    assert r4.startswith("  r4, seed 0: 4 steps, global batch 16, lr 0.001 (r4), 0.005 (r16); "), r4
    r8 = next(line for line in out if line.startswith("  r8, seed 0: "))
    assert r8.startswith("  r8, seed 0: 4 steps, global batch 16, lr 0.005; "), r8


def test_a_fused_plan_with_nothing_fused_and_a_sweep_of_the_setting(tmp_path):
    proc = run_cli(
        "+experiment=lora_ab",
        "base.steps=4",
        "resources.fuse_variants=2",
        "model.lora.dropout=0.1",
        *FAST,
        f"run_root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "resources.fuse_variants=2: none of the 2 variant task(s) can be fused: each runs alone"
        in proc.stdout.splitlines()
    )
    assert "fused into 0" not in proc.stdout
    proc = run_cli(
        "-m",
        "+experiment=lora_ab",
        "resources.fuse_variants=1,2",
        *FAST,
        f"run_root={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and not (tmp_path / "sweep").exists(), proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "error: resources.fuse_variants=1,2: resources.fuse_variants cannot be swept: it groups the run's variants "
        "with each other, so it is one setting for the whole run: set it once (resources.fuse_variants=auto or K), "
        "or run each value on its own"
    )
