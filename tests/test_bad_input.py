"""Bad input: exit code 2, one line naming the key or file and the fix, no traceback, no run directory."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import run_cli, run_dir_of

FAST = ["train.steps=1"]  # (base.steps= would be refused where no base stage trains)
# A run that trains: one step of a tiny synthetic corpus (on one CPU worker, locally).
SMALL = [
    "data=synthetic",
    "data.n_samples=64",
    "data.max_len=64",
    "data.mean_len=20",
    "train.steps=1",
    "train.eval_batches=1",
]
TINY = [*SMALL, "launcher.cpu_slots=1"]


def _bad(tmp_path, *args, prefix: tuple[str, ...] = ()):
    """The command fails as a user's mistake should. `prefix` runs it under another command (setpriv)."""
    runs = tmp_path / "runs"
    if not any(a.startswith("run_root=") for a in args):
        args = (*args, f"run_root={runs}")
    if prefix:
        proc = subprocess.run(
            [*prefix, sys.executable, "-m", "slurm_router", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    else:
        proc = run_cli(*args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(err) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not any(tmp_path.rglob("manifest.json")), "a run directory was half-made"
    assert not any(tmp_path.rglob(".slurm_router-write-test-*")), "the write test was left behind"
    return err[0]


@pytest.mark.parametrize(
    "args, expect",
    [
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
    ],
)
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


def _without_root_override() -> tuple[str, ...]:
    """A prefix under which file permissions hold: nothing for a user, root less CAP_DAC_* for root (as in CI)."""
    if os.geteuid() != 0:
        return ()
    prefix = ("setpriv", "--bounding-set=-dac_override,-dac_read_search")
    if not shutil.which("setpriv") or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("this machine cannot make permissions hold: running as root without setpriv")
    return prefix


def test_unreadable_data_and_unwritable_run_root_are_one_line(tmp_path):
    prefix = _without_root_override()
    texts = tmp_path / "texts"
    (texts / "sub").mkdir(parents=True)
    (texts / "a.txt").write_text("readable text\n\n" * 20)
    (texts / "sub" / "b.txt").write_text("more text\n\n" * 20)
    (texts / "locked.txt").write_text("secret\n")
    os.chmod(texts / "locked.txt", 0)
    line = _bad(tmp_path, "data=text_dir", f"data.path={texts}", *FAST, prefix=prefix)
    assert f"data file {texts / 'locked.txt'} cannot be read (Permission denied)" in line, line
    os.chmod(texts / "locked.txt", 0o644)
    os.chmod(texts / "sub", 0)
    line = _bad(tmp_path, "data=text_dir", f"data.path={texts}", *FAST, prefix=prefix)
    assert f"data folder {texts / 'sub'} cannot be read (Permission denied)" in line, line
    os.chmod(texts / "sub", 0o755)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"text": "hello"}) + "\n")
    os.chmod(jsonl, 0)
    line = _bad(tmp_path, "data=jsonl", f"data.path={jsonl}", *FAST, prefix=prefix)
    assert f"data file {jsonl} cannot be read (Permission denied)" in line, line
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o555)
    line = _bad(tmp_path, f"run_root={readonly}/runs", *FAST, prefix=prefix)
    assert f"run_root='{readonly}/runs': cannot write in {readonly} (Permission denied): set run_root=" in line, line
    assert list(readonly.iterdir()) == []


def test_run_root_that_is_a_file_or_under_proc(tmp_path):
    (tmp_path / "notes.txt").write_text("a file")
    line = _bad(tmp_path, "run_root=notes.txt", *FAST)
    assert f"run_root='notes.txt': {tmp_path / 'notes.txt'} is a file, not a folder" in line, line
    assert "cannot write in /proc" in _bad(tmp_path, "run_root=/proc/runs", *FAST)


def test_dict_valued_override_reaches_the_rendered_sbatch(tmp_path):
    """The README's own syntax, as Hydra users write it, without '+'."""
    proc = run_cli(
        "launcher=sbatch",
        "launcher.dry_run=true",
        "launcher.additional_parameters={nice: 10}",
        *SMALL,
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "#SBATCH --nice=10" in (run_dir_of(proc) / "submit.sbatch").read_text().splitlines()


def test_a_variant_typo_is_refused_and_a_new_one_trains_and_shows_in_status(tmp_path):
    line = _bad(tmp_path, "+experiment=lora_ab", "variants.r9.train.lr=1e-3", *FAST)
    assert "no variant 'r9' (its variants: r8, r32)" in line and "+variants.r9.train.lr=1e-3" in line, line
    proc = run_cli("+variants.r9.train.lr=1e-3", *TINY, f"run_root={tmp_path / 'runs'}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = run_dir_of(proc)
    task = json.loads((run_dir / "manifest.json").read_text())["tasks"]["r9"]
    assert task["state"] == "completed" and isinstance(task["elapsed_s"], float)
    # status of a finished local run: the float elapsed_s once raised a traceback in format_duration
    status = run_cli(str(run_dir), module="slurm_router.status", cwd=tmp_path, timeout=120)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr[-2000:]
    assert "r9" in status.stdout and "COMPLETED" in status.stdout and "0:00:" in status.stdout, status.stdout


def _checkpoint(path, tokenizer: bool):
    """A tiny GPT-2 saved the way users save one, with or without its tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=300, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)
    if tokenizer:
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            ["some text to learn from"] * 10, vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False
        )
        PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(path)
    return path


def test_checkpoint_without_tokenizer_or_whole_weights_is_named_before_anything_is_written(tmp_path):
    data = [*SMALL, "launcher=sbatch", "launcher.dry_run=true"]  # a dry run: the checks, then render
    good = _checkpoint(tmp_path / "good", tokenizer=True)
    proc = run_cli(
        "model=hf", f"model.name_or_path={good}", *data, f"run_root={tmp_path / 'ok'}", cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.rmtree(tmp_path / "ok")
    bare = _checkpoint(tmp_path / "bare", tokenizer=False)
    line = _bad(tmp_path, "model=hf", f"model.name_or_path={bare}", *data)
    assert f"the checkpoint {bare} has no tokenizer (none of tokenizer.json" in line, line
    weights = good / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    line = _bad(tmp_path, "model=hf", f"model.name_or_path={good}", *data)
    assert f"weights file {weights} is truncated or damaged" in line, line


def test_jsonl_reads_as_the_format_defines(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(
        "".join(
            json.dumps({"text": f"row {i}\u2028with a line separator"}, ensure_ascii=False) + "\n" for i in range(20)
        )
        + "[1, 2]\n"
    )
    assert f"line 21 of {f} is a JSON array, not an object with a 'text' field" in _bad(
        tmp_path, "data=jsonl", f"data.path={f}", *FAST
    )
