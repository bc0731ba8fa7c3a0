"""Bad input: exit code 2, one line naming the key or file and the fix, no traceback, no run directory."""
import json

import pytest

from conftest import run_cli

FAST = ["train.steps=1", "base.steps=1"]


def _bad(tmp_path, *args):
    runs = tmp_path / "runs"
    proc = run_cli(*args, f"run_root={runs}", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(err) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not runs.exists() or not any(runs.rglob("manifest.json")), "a run directory was half-made"
    return err[0]


@pytest.mark.parametrize("args, expect", [
    (["+experiment=nope"], "experiment=nope: no such experiment"),
    (["router=fastest"], "choose one of: affinity, balanced, least_loaded, round_robin"),
    (["train.lrr=1"], "unknown key 'train.lrr'"),
    (["train.lr=0"], "train.lr=0"),
    (["train.lr=-1"], "out of range"),
    (["train.lr=abc"], "train.lr"),
    (["resources.devices_per_task=0"], "resources.devices_per_task=0"),
    (["router.policy=fastest"], "router.policy='fastest' is not valid"),
    (["data=text_dir"], "data.path is required"),
    (["data=text_dir", "data.path=/nonexistent/dir"], "'/nonexistent/dir' is not a folder"),
    (["data=jsonl", "data.path=/nonexistent.jsonl"], "is not a file"),
    (["model=hf"], "model.name_or_path is required"),
    (["model=hf", "model.name_or_path=/nonexistent"], "is not a directory"),
    (["+experiment=lora_ab", "+variants.r8.train.lrr=1"], "unknown key"),
    (["+experiment=lora_ab", "variants.r8.train.lr=-1"], "variants.r8: train.lr=-1"),
    (["model.n_embd=100", "model.n_head=3"], "multiple of model.n_head"),
    (["--frobnicate"], "unknown option --frobnicate"),
])
def test_bad_config_exits_2_with_one_line(tmp_path, args, expect):
    line = _bad(tmp_path, *args, *FAST)
    assert expect in line, line


def test_unknown_key_lists_valid_keys(tmp_path):
    line = _bad(tmp_path, "train.lrr=1")
    assert "global_batch_size" in line and "warmup_steps" in line


def test_empty_corpus(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("   \n\n")
    assert "no training text" in _bad(tmp_path, "data=text_dir", f"data.path={d}", *FAST)


def test_binary_and_non_utf8_files(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "x.bin").write_bytes(b"\0\1\2" * 100)
    assert "looks binary" in _bad(tmp_path, "data=text_dir", f"data.path={d}", *FAST)
    d2 = tmp_path / "latin"
    d2.mkdir()
    (d2 / "x.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    assert "not UTF-8" in _bad(tmp_path, "data=text_dir", f"data.path={d2}", *FAST)


def test_jsonl_without_text_field(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"body": "hello"}) + "\n")
    assert "data.text_field" in _bad(tmp_path, "data=jsonl", f"data.path={f}", *FAST)
    f.write_text("{not json\n")
    assert "not valid JSON" in _bad(tmp_path, "data=jsonl", f"data.path={f}", *FAST)
