"""The base cache is a verified artifact (issue 12, finding 4): a save_pretrained folder (issue 13) whose
model.safetensors has a sha256 sidecar and is checked before every use; a damaged, truncated or missing cache is
named in one line and trained again, never used; a cache deleted before resume= is rebuilt by the resume; an
unwritable or too small base.cache_dir stops the run before anything trains (exit 2, one line, no run dir)."""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of

from slurm_router.artifacts import base_cache
from slurm_router.errors import UserError

# A base stage of 4 steps and one LoRA variant of 2: a run is two task start-ups (~40 s on 2 busy cores).
FAST = [
    "base.enabled=true",
    "base.steps=4",
    "base.global_batch_size=8",
    "train.steps=2",
    "train.global_batch_size=8",
    "train.eval_batch_size=8",
    "train.eval_batches=2",
    "data.max_len=64",
    "data.max_documents=60",
]


def _model():
    """A GPT-2 of a few thousand weights, as a base stage would save one."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(vocab_size=257, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=256, eos_token_id=256)
    )


def _flip_a_byte(path: Path) -> None:
    """Damage in place: same size, one byte changed (what a bad disk or a stray write does)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda w: None, None),
        (_flip_a_byte, "sha256 mismatch"),
        (lambda w: w.write_bytes(w.read_bytes()[:1000]), "1000 bytes, expected"),
        (lambda w: w.unlink(), "model.safetensors is missing"),
        (lambda w: w.with_name("model.json").unlink(), "no sidecar model.json"),
        (lambda w: w.with_name("config.json").unlink(), "config.json is missing"),
        (lambda w: w.with_name("tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda w: w.with_name("meta.json").unlink(), base_cache.ABSENT),
    ],
    ids=["whole", "bit-flip", "truncated", "weights-deleted", "no-sidecar", "no-config", "no-tokenizer", "no-meta"],
)
def test_check_names_every_kind_of_damage(tmp_path, damage, why):
    folder = tmp_path / "abc"
    base_cache.save(_model(), folder, {"val_loss": 1.5})
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "generation_config.json",
        "meta.json",
        "model.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["abc"], "no temp folder is left beside it"
    damage(base_cache.weights_file(folder))
    got = base_cache.check(folder)
    assert got == why if why in (None, base_cache.ABSENT) else why in got, got


def test_the_cache_is_a_checkpoint_transformers_loads_with_the_byte_tokenizer(tmp_path):
    """save_pretrained's folder: the same weights back with from_pretrained, and a tokenizer that encodes text as
    the byte tokenizer the base was trained with does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slurm_router.train.tokenizer import ByteTokenizer

    model, folder = _model(), tmp_path / "abc"
    base_cache.save(model, folder, {"val_loss": 1.5})
    back = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    tok = AutoTokenizer.from_pretrained(folder)
    text = "def f(x):\n\treturn x  # héllo ☃ 日本 \U0001f600 <|endoftext|>"
    assert tok.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text).tolist()
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (256, 256, ByteTokenizer.vocab_size)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_an_older_cache_layout_is_never_read(tmp_path):
    """format 1 (model.pt, a torch.save state dict) hashes elsewhere, and a folder of that layout is not whole."""
    from slurm_router.config.compose import compose

    cfg = compose([*FAST, f"base.cache_dir={tmp_path}"])
    assert base_cache.weights_path(cfg) == tmp_path / "base" / base_cache.base_hash(cfg)
    old = tmp_path / "old"
    old.mkdir()
    for name, text in (("model.pt", "x"), ("model.json", "{}"), ("meta.json", "{}")):
        (old / name).write_text(text)
    assert "model.safetensors is missing" in base_cache.check(old)


def test_a_worker_refuses_damaged_weights_in_one_line_and_unmarks_the_cache(tmp_path):
    folder = tmp_path / "abc"
    base_cache.save(_model(), folder, {"val_loss": 1.5})
    base_cache.verify_before_load(folder)  # whole: nothing to say
    _flip_a_byte(base_cache.weights_file(folder))
    with pytest.raises(base_cache.BaseCacheError) as e:
        base_cache.verify_before_load(folder)
    msg = str(e.value)
    assert "\n" not in msg and str(folder) in msg and "sha256 mismatch" in msg and "trains again" in msg
    assert base_cache.check(folder) == base_cache.ABSENT, "the next run must not reuse it"


def test_the_plan_trains_a_truncated_cache_again_and_says_so(tmp_path, capsys):
    from slurm_router.config.compose import compose
    from slurm_router.config.variants import validate
    from slurm_router.launch.plan import make_plan

    cfg = compose([*FAST, f"base.cache_dir={tmp_path}"])
    variants = validate(cfg)
    folder = base_cache.weights_path(cfg)
    base_cache.save(_model(), folder, {"val_loss": 1.5})
    stages = make_plan(cfg, variants, "r", str(tmp_path / "run"))
    assert stages[0].cached and stages[1].tasks[0].base_weights == str(folder)
    weights = base_cache.weights_file(folder)
    weights.write_bytes(weights.read_bytes()[:-7])
    stages = make_plan(cfg, variants, "r", str(tmp_path / "run"))
    assert [s.name for s in stages] == ["base", "variants"] and not stages[0].cached
    err = capsys.readouterr().err
    assert f"cached base model in {folder} is not usable (model.safetensors: " in err and "truncated" in err


def _real_cache(args: list[str]) -> Path:
    """The cache a base stage of this config writes (an untrained base: its weights are what matter here)."""
    from slurm_router.config.compose import compose
    from slurm_router.train.model import build_model
    from slurm_router.train.tokenizer import make_tokenizer

    cfg = compose(args)
    folder = base_cache.weights_path(cfg)
    model = build_model(cfg.model, make_tokenizer(cfg.model).vocab_size, cfg.seed, lora=False)
    base_cache.save(model, folder, {"val_loss": 9.9, "train_loss": 9.9, "steps": 4})
    return folder


def _rows(task_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (task_dir / "events-rank0.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == kind]


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """A real run over a cache damaged in place (same size, one byte changed): (its process, the cache folder)."""
    root = tmp_path_factory.mktemp("base_cache_run")
    args = [*FAST, f"base.cache_dir={root / 'cache'}", f"run_root={root}"]
    folder = _real_cache(args)
    assert base_cache.check(folder) is None
    _flip_a_byte(base_cache.weights_file(folder))  # before: loaded silently, and the A/B result changed
    return run_cli(*args, cwd=root), folder


def test_a_cache_damaged_in_place_is_named_and_trained_again_not_used(rebuilt):
    proc, weights = rebuilt
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sha256 mismatch" in proc.stderr and str(weights) in proc.stderr
    assert "reusing the cached base model" not in proc.stdout
    run_dir = run_dir_of(proc)
    base_end = _rows(run_dir / "tasks" / "base", "end")[-1]
    assert len(_rows(run_dir / "tasks" / "base", "step")) == 4, "the base stage trained again"
    assert base_cache.check(weights) is None, "and rewrote the cache, whole"
    assert json.loads(base_cache.meta_path(weights).read_text())["val_loss"] == base_end["val_loss"]
    # the variant started from the rebuilt base: its step-0 held-out loss is the base's final one
    step0 = _rows(run_dir / "tasks" / "main", "eval")[0]
    assert step0["step"] == 0 and step0["val_loss"] == pytest.approx(base_end["val_loss"], rel=1e-5)


def test_resume_after_the_cache_was_deleted_trains_the_base_again(rebuilt):
    proc, weights = rebuilt
    run_dir = run_dir_of(proc)
    # the variant did not finish (as after a failure), and the cache is deleted before the resume
    (run_dir / "tasks" / "main" / "result.json").unlink()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["tasks"]["main"]["state"] = "failed"
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    for f in weights.iterdir():
        f.unlink()
    resumed = run_cli(f"resume={run_dir}", cwd=run_dir)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    out = resumed.stdout + resumed.stderr
    assert "meta.json is gone" in resumed.stderr and "FileNotFoundError" not in out and "Traceback" not in out
    assert base_cache.check(weights) is None, "the resume rebuilt the cache"
    data = json.loads((run_dir / "manifest.json").read_text())
    assert {n: t["state"] for n, t in data["tasks"].items()} == {"base": "completed", "main": "completed"}


# ---- the cache folder, before anything trains ---------------------------------------------------------------
def _refused(tmp_path: Path, cache_dir: str) -> str:
    proc = run_cli(*FAST, f"base.cache_dir={cache_dir}", f"run_root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists(), "no run dir may be written"
    return proc.stderr


def test_a_cache_dir_that_is_a_file_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "afile").write_text("x")
    err = _refused(tmp_path, str(tmp_path / "afile"))
    assert "base.cache_dir=" in err and "a file, not a folder" in err


def test_a_cache_dir_too_small_for_the_weights_is_refused_before_anything_runs(tmp_path, tmpfs):
    err = _refused(tmp_path, str(tmpfs("2m")))
    assert "MiB free" in err and "weights need about" in err and "base.cache_dir=" in err


def test_a_read_only_cache_dir_is_refused_before_anything_runs(tmp_path, tmpfs):
    err = _refused(tmp_path, str(tmpfs("64m", "ro")))
    assert "Read-only file system" in err and "base.cache_dir=" in err


def test_check_room_passes_for_a_roomy_writable_folder(tmp_path):
    from slurm_router.config.compose import compose

    cfg = compose([*FAST, f"base.cache_dir={tmp_path}"])
    base_cache.check_room(cfg)  # nothing raised, and nothing left behind
    assert list(tmp_path.iterdir()) == []
    assert base_cache.estimate_bytes(cfg) > 2_000_000  # gpt2_tiny: ~2.1 MB of fp32 weights, plus margin
    with pytest.raises(UserError):
        base_cache.check_room(compose([*FAST, "base.cache_dir=/proc/nope"]))
