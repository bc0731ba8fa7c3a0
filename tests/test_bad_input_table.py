"""Bad input, systematically: every row is a bad configuration, file or run directory, and each must exit 2
with one line on stderr naming the problem, no traceback, and nothing written (no run directory).

The command's own main() runs in process (the same code path as `python -m slurm_router ARGS`, minus
interpreter start-up: ~0.1 s a row instead of ~3 s); tests/test_bad_input.py covers the real subprocess.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurm_router.__main__ import main

FAST = ["train.steps=1", "base.steps=1"]


def _files(root: Path) -> dict[str, Path]:
    """Bad data files and run directories, made once per test in its tmp dir."""
    root.mkdir()
    (root / "emptydir").mkdir()
    (root / "a.txt").write_text("hello\n")
    (root / "empty.jsonl").write_bytes(b"")
    (root / "binary.jsonl").write_bytes(bytes(range(256)) * 40)
    (root / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    (root / "array.jsonl").write_text("[1, 2]\n")
    (root / "number.jsonl").write_text('{"text": 5}\n')
    (root / "dangling").mkdir()
    (root / "dangling" / "x.txt").symlink_to(root / "nowhere.txt")
    (root / "locked").mkdir()
    (root / "locked" / "x.txt").write_text("secret text\n\n" * 50)
    os.chmod(root / "locked" / "x.txt", 0)
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text("{}")
    (root / "not_a_run").mkdir()
    (root / "broken_run").mkdir()
    (root / "broken_run" / "manifest.json").write_text("{not json")
    (root / "no_config_run").mkdir()
    (root / "no_config_run" / "manifest.json").write_text(json.dumps({"stages": [], "tasks": {}}))
    return {p.name: p for p in root.iterdir()}


# (arguments, what the one line must say). {name} is a file or folder from _files(). FAST is appended unless
# the row sets train.steps itself or is a resume= row (which takes no other arguments).
CASES = [
    # out of range, wrong type, absurd sizes
    (["train.steps=0"], "train.steps=0 is out of range"),
    (["train.steps=1.5"], "train.steps: Value '1.5'"),
    (["train.steps=[1,2]"], "train.steps"),
    (["train.steps=99999999999999999999"], "train.steps"),
    (["train.global_batch_size=-3"], "train.global_batch_size=-3 is out of range"),
    (["train.checkpoint_every=-1"], "train.checkpoint_every=-1 is out of range"),
    (["train.keep_checkpoints=0"], "train.keep_checkpoints=0 is out of range"),
    (["train.precision=fp8"], "choose one of auto, fp32, bf16"),
    (["train.lr=nan"], "train.lr=nan is not a number"),
    (["train.lr=inf"], "train.lr=inf is out of range"),
    (["data.val_fraction=1.5"], "data.val_fraction=1.5 is out of range"),
    (["data.max_len=1"], "data.max_len=1 is out of range"),
    (["data.max_len=100000000"], "data.max_len=100000000 is out of range"),
    (["data=synthetic", "data.n_samples=999999999999"], "data.n_samples=999999999999 is out of range"),
    (["data=synthetic", "data.mean_len=2000000"], "data.mean_len=2000000 is out of range"),
    (["data.max_documents=0"], "data.max_documents=0 is out of range"),
    (["model.n_layer=100000"], "model.n_layer=100000 is out of range"),
    (["model.lora.dropout=2"], "model.lora.dropout=2.0 is out of range"),
    (["model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    (["model.lora.target_modules=[nosuchlayer]"], "'nosuchlayer' is not a layer"),
    (["router.memory_headroom=0"], "router.memory_headroom=0.0 is out of range"),
    (["router.device_slowdown=[1,-1]"], "must be all > 0"),
    (["router.affinity_boundaries=[64,32]"], "strictly increasing"),
    (["launcher=sbatch", "launcher.dry_run=true", "launcher.timeout_min=0"], "launcher.timeout_min=0 is out of range"),
    (["launcher=sbatch", "launcher.dry_run=true", "launcher.max_requeues=-1"], "launcher.max_requeues=-1 is out of range"),
    (["launcher=sbatch", "launcher.dry_run=true", "launcher.signal_delay_s=99999"], "launcher.signal_delay_s=99999 is out of range"),
    (["seed=-1"], "seed=-1 is out of range"),
    (["resources.devices_per_task=100000"], "resources.devices_per_task=100000 is out of range"),
    # unknown options and keys, wrong shapes
    (["launcher=nope"], "launcher=nope: no such launcher in conf/launcher/; choose one of: local, sbatch, slurm"),
    (["model=nope"], "model=nope: no such model"),
    (["train.nope=1"], "unknown key 'train.nope'"),
    (["variants=5"], "variants"),
    (["+variants.x=3"], "variants.x must be a mapping of overrides"),
    (["+variants.x.variants.y.train.lr=1"], "a variant cannot declare variants"),
    (["+variants.base.train.lr=1"], "'base' is the name of the base stage"),
    (["launcher=sbatch", "launcher.dry_run=true", "+launcher.additional_parameters.bad_key=1"], "extra_sbatch key"),
    # an option of another launcher, or of none; a dotted key under a plain value
    (["launcher=slurm", "launcher.dry_run=true"], "launcher.dry_run does not apply to launcher=slurm: it is an "
                                                  "option of launcher=sbatch only"),
    (["launcher.partition=gpu"], "launcher.partition does not apply to launcher=local: it is an option of "
                                 "launcher=slurm, launcher=sbatch only"),
    (["+launcher.partition=gpu"], "launcher.partition does not apply to launcher=local"),
    (["launcher=slurm", "launcher.cpu_slots=2"], "it is an option of launcher=local only"),
    (["launcher=sbatch", "launcher.nope=1"], "unknown key 'launcher.nope': valid keys for launcher=sbatch are"),
    (["experiment.seeds=2"], "experiment is a string, the experiment's name, set by conf/experiment/NAME.yaml: "
                             "pick one with +experiment=NAME"),
    (["experiment=lora_ab"], "pick one with +experiment=NAME"),
    (["train.lr.x=1"], "train.lr is a number and has no keys under it: set train.lr=VALUE"),
    # hostile names: never run by a shell, never a path outside the run dir
    (["+variants.$(touch pwned).train.lr=1"], "+variants."),
    (["+variants.../escape.train.lr=1"], "+variants."),
    (["+variants.a b.train.lr=1"], "+variants.a"),
    (["+experiment=../lora_ab"], "experiment"),
    # files: missing, empty, binary, not UTF-8, wrong shape, unreadable, not what was asked for
    (["data=text_dir", "data.path={emptydir}"], "has no training text"),
    (["data=text_dir", "data.path={a.txt}"], "is not a folder"),
    (["data=text_dir", "data.path={dangling}"], "has no training text"),
    (["data=text_dir", "data.path={locked}"], "locked"),
    (["data=jsonl", "data.path={empty.jsonl}"], "has no training text"),
    (["data=jsonl", "data.path={binary.jsonl}"], "is not UTF-8"),
    (["data=jsonl", "data.path={latin1.jsonl}"], "is not UTF-8"),
    (["data=jsonl", "data.path={array.jsonl}"], "no string field 'text'"),
    (["data=jsonl", "data.path={number.jsonl}"], "no string field 'text'"),
    (["data=jsonl", "data.path={emptydir}"], "is not a file"),
    (["model=hf", "model.name_or_path={hf}"], "cannot load its tokenizer"),
    # resume= of something that is not a resumable run
    (["resume=/nonexistent/run"], "no such directory"),
    (["resume="], "resume= needs a run directory"),
    (["resume={not_a_run}"], "no manifest.json there"),
    (["resume={broken_run}"], "the manifest is damaged"),
    (["resume={no_config_run}"], "config.yaml is missing or damaged"),
    (["resume={broken_run}", "train.steps=3"], "takes no other arguments"),
]


def _ids():
    return [" ".join(a)[:60] for a, _ in CASES]


@pytest.mark.parametrize("args, expect", CASES, ids=_ids())
def test_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys, args, expect):
    files = _files(tmp_path / "f")
    if "{locked}" in " ".join(args) and os.access(files["locked"] / "x.txt", os.R_OK):
        pytest.skip("chmod 000 does not stop this user (root) from reading: unreadable files cannot be made here")
    for name, path in files.items():
        args = [a.replace("{" + name + "}", str(path)) for a in args]
    if not any(a.startswith(("train.steps=", "resume=")) for a in args):
        args += FAST
    runs = tmp_path / "runs"
    if not any(a.startswith("resume=") for a in args):
        args.append(f"run_root={runs}")
    monkeypatch.chdir(tmp_path)
    code = main(args)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expect in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert not runs.exists() or not any(runs.rglob("manifest.json")), "a run directory was half-made"
    assert not any(tmp_path.rglob("pwned")), "a hostile name ran a shell command"


def test_the_table_is_large_and_new():
    """At least 30 rows, none repeating tests/test_bad_input.py's."""
    old = (Path(__file__).parent / "test_bad_input.py").read_text()
    assert len(CASES) >= 30
    repeats = [a for a, _ in CASES if f"{a!r}".replace("'", '"') in old or repr(a) in old]
    assert not repeats, repeats
