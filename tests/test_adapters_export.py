"""Adapters out (issue 13): every variant leaves its adapter in peft's own format beside the base it trained on,
so transformers + peft alone load it and reproduce the report's held-out loss; the report names the winner's
adapter; `python -m slurm_router.export` merges it into a full checkpoint; bad inputs are one line, exit 2.

Real runs through the command (launcher=local): gpt2_tiny with a base stage (its cache is a save_pretrained
folder), gpt2_tiny without one (the seed-built base saved in the run dir), and model=hf on a tiny Llama."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import run_cli, run_dir_of
from tiny_checkpoints import make_checkpoint, prompt_completion_rows, write_jsonl

FAST = [
    "train.global_batch_size=8",
    "train.eval_batch_size=8",
    "train.eval_batches=2",
    "data.max_len=64",
    "data.max_documents=60",
    "launcher=local",
]
NO_EVERY = "train.eval_every=0"  # lora_ab evaluates every 25 steps: here only at the start and the end
# The base stage of 4 steps, then 6 steps a variant, evaluated every 2, checkpointed at step 4 (the resume test);
# a high lr, so that a variant's best held-out loss is not always its last
WITH_BASE = [
    "base.enabled=true",
    "base.steps=4",
    "base.global_batch_size=8",
    "train.steps=6",
    "train.eval_every=2",
    "train.checkpoint_every=4",
    "train.lr=2e-2",
    *FAST,
]
TOL = 1e-5


def _run(tmp: Path, *args: str) -> Path:
    proc = run_cli("+experiment=lora_ab", *args, f"run_root={tmp / 'runs'}", cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("adapters_gpt2")
    return _run(tmp, *WITH_BASE, f"base.cache_dir={tmp / 'cache'}")


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("adapters_llama")
    checkpoint = make_checkpoint(tmp / "llama", "llama")
    data = write_jsonl(tmp / "train.jsonl", prompt_completion_rows(96))
    return _run(
        tmp,
        "model=hf",
        f"model.name_or_path={checkpoint}",
        "data=jsonl",
        f"data.path={data}",
        "data.prompt_field=prompt",
        "data.completion_field=completion",
        "data.val_fraction=0.1",
        "train.steps=4",
        NO_EVERY,
        *[a for a in FAST if not a.startswith("data.max_documents")],
    ), checkpoint


# ---- what the test reuses from the worker: its data and batching, nothing of its model code ------------------
def _task_cfg(run_dir: Path, variant: str):
    from omegaconf import OmegaConf

    return OmegaConf.create(json.loads((run_dir / "tasks" / variant / "task.json").read_text())["config"])


def held_out_loss(model, run_dir: Path, variant: str) -> float:
    """The token-weighted loss of `model` on the held-out batches the worker evaluated (same seed, same data)."""
    from slurm_router.train.data import build_corpus, eval_batches
    from slurm_router.train.loss import token_loss_sum
    from slurm_router.train.tokenizer import make_tokenizer
    from slurm_router.worker.microbatch import batch_tensors

    cfg = _task_cfg(run_dir, variant)
    tok = make_tokenizer(cfg.model)
    corpus = build_corpus(cfg.data, tok)
    total, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for ids in eval_batches(corpus.val, cfg.train.eval_batches, cfg.train.eval_batch_size, cfg.seed):
            inputs, labels, n_targets, index = batch_tensors(corpus.val, ids, tok.pad_id, torch.device("cpu"))
            loss, k = token_loss_sum(model, inputs, labels, 0, n_targets, index)
            total, n = total + float(loss), n + k
    return total / n


def load_adapter(adapter: Path):
    """Base + adapter with transformers and peft alone: the base is the one adapter_config.json names."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)


def export(*args) -> subprocess.CompletedProcess:
    return run_cli(*map(str, args), module="slurm_router.export")


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "report" / "summary.json").read_text())


def _evals(run_dir: Path, variant: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "tasks" / variant / "events-rank0.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == "eval"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- pure parts ---------------------------------------------------------------------------------------------
def test_the_transformers_byte_tokenizer_encodes_as_the_byte_tokenizer():
    from slurm_router.train.byte_tokenizer import transformers_byte_tokenizer
    from slurm_router.train.sources import stdlib_documents
    from slurm_router.train.tokenizer import ByteTokenizer

    hf, byte = transformers_byte_tokenizer(), ByteTokenizer()
    texts = ["", " ", "  \t\n\r", "héllo ☃ 日本 \U0001f600", "a<|endoftext|>b", bytes(range(1, 128)).decode()]
    texts += [text for _, (_, text) in zip(range(3), stdlib_documents())]
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == byte.encode(text).tolist(), text[:40]
        assert hf.decode(ids) == text
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id, len(hf)) == (256, 256, 256, byte.vocab_size)


def test_a_folder_is_written_whole_or_not_at_all(tmp_path):
    from slurm_router.artifacts.adapters import write_folder

    target = tmp_path / "adapter"
    write_folder(target, lambda tmp: (tmp / "a.json").write_text("old"))

    def half(tmp):
        (tmp / "a.json").write_text("new")
        raise OSError(28, "No space left on device")

    from slurm_router.fileio import WriteError

    with pytest.raises(WriteError) as e:
        write_folder(target, half)
    assert "No space left on device" in str(e.value) and str(target) in str(e.value)
    assert (target / "a.json").read_text() == "old", "the previous folder stands"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"], "no temp folder is left"
    write_folder(target, lambda tmp: (tmp / "b.json").write_text("new"))
    assert [p.name for p in target.iterdir()] == ["b.json"]
    assert not write_folder(target, lambda tmp: (tmp / "c.json").write_text("x"), replace=False)
    assert [p.name for p in target.iterdir()] == ["b.json"] and len(list(tmp_path.iterdir())) == 1


# ---- a base stage, two variants ---------------------------------------------------------------------------------
@pytest.mark.integration
def test_every_variant_leaves_its_adapter_beside_the_base_it_trained_on(gpt2_run):
    for variant in ("r8", "r32"):
        task = gpt2_run / "tasks" / variant
        adapter = task / "adapter"
        assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
        base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert base == json.loads((task / "task.json").read_text())["base_weights"], "the base stage's cache"
        assert (Path(base) / "config.json").is_file() and (Path(base) / "model.safetensors").is_file()
        result = json.loads((task / "result.json").read_text())
        assert result["adapter"] == str(adapter) and result["base_model"] == base
        assert not list(task.glob(".adapter*")), "no temp folder is left"


@pytest.mark.integration
def test_base_plus_adapter_reproduce_the_reports_held_out_loss(gpt2_run):
    summary = _summary(gpt2_run)
    for variant in ("r8", "r32"):
        loss = held_out_loss(load_adapter(gpt2_run / "tasks" / variant / "adapter"), gpt2_run, variant)
        assert abs(loss - summary["variants"][variant]["val_loss"]) < TOL, variant


@pytest.mark.integration
def test_adapter_best_is_the_lowest_held_out_loss_and_reproduces_it(gpt2_run):
    best_steps = []
    for variant in ("r8", "r32"):
        trained = [e for e in _evals(gpt2_run, variant) if e["step"] > 0]
        assert [e["step"] for e in trained] == [2, 4, 6]
        best = min(trained, key=lambda e: e["val_loss"])
        folder = gpt2_run / "tasks" / variant / "adapter-best"
        record = json.loads((folder / "held_out.json").read_text())
        assert (record["step"], record["val_loss"]) == (best["step"], best["val_loss"])
        result = json.loads((gpt2_run / "tasks" / variant / "result.json").read_text())
        assert (result["adapter_best"], result["adapter_best_step"]) == (str(folder), best["step"])
        assert abs(held_out_loss(load_adapter(folder), gpt2_run, variant) - best["val_loss"]) < TOL
        best_steps.append(best["step"])
    assert best_steps != [6, 6], "train.lr=2e-2 overshoots: some variant's best is not its final adapter"


@pytest.mark.integration
def test_the_verdict_names_the_winner_and_its_adapter(gpt2_run):
    summary = _summary(gpt2_run)
    losses = {v: s["val_loss"] for v, s in summary["variants"].items()}
    won = min(losses, key=losses.get)
    adapter = str(gpt2_run / "tasks" / won / "adapter")
    assert summary["winner"]["variant"] == won and summary["winner"]["adapter"] == adapter
    assert summary["variants"][won]["adapter"] == adapter
    assert summary["variants"][won]["adapter_best"] == str(gpt2_run / "tasks" / won / "adapter-best")
    assert f"its adapter: {adapter}" in (gpt2_run / "report" / "report.md").read_text()


@pytest.mark.integration
def test_export_merges_the_winner_into_a_checkpoint_that_reproduces_the_loss(gpt2_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = _summary(gpt2_run)
    won = summary["winner"]["variant"]
    proc = export(gpt2_run, "--merge", tmp_path / "merged")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{won}: the report's winner" in proc.stdout
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k for k in merged.state_dict()), "merged: a plain transformers model"
    assert abs(held_out_loss(merged, gpt2_run, won) - summary["variants"][won]["val_loss"]) < TOL
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").encode("hé", add_special_tokens=False) == [104, 195, 169]
    assert [p.name for p in tmp_path.iterdir()] == ["merged"], "no temp folder is left beside OUT"
    # --best, of the other variant, into an empty folder that exists
    other = next(v for v in summary["variants"] if v != won)
    (tmp_path / "best").mkdir()
    proc = export(gpt2_run, other, "--best", "--merge", tmp_path / "best")
    assert proc.returncode == 0, proc.stderr[-2000:]
    best = json.loads((gpt2_run / "tasks" / other / "adapter-best" / "held_out.json").read_text())["val_loss"]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "best")
    assert abs(held_out_loss(merged, gpt2_run, other) - best) < TOL


def _refused(proc, *words: str) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert all(w in proc.stderr for w in words), proc.stderr
    return proc.stderr


@pytest.mark.integration
def test_export_refuses_bad_input_in_one_line_and_writes_nothing(gpt2_run, tmp_path):
    out = tmp_path / "out"
    _refused(export(tmp_path, "--merge", out), str(tmp_path), "no manifest.json")
    _refused(export(gpt2_run, "r99", "--merge", out), "no variant 'r99'", "r8, r32")
    # a run whose tasks have not completed: no adapter yet
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(gpt2_run / "manifest.json", unfinished / "manifest.json")
    _refused(export(unfinished, "r32", "--merge", out), "r32: no adapter in", "has not completed")
    (out / "x").mkdir(parents=True)
    _refused(export(gpt2_run, "--merge", out), str(out), "exists and is not empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "unfinished"] and [p.name for p in out.iterdir()] == [
        "x"
    ]


@pytest.mark.integration
def test_export_after_the_base_moved_says_so_in_one_line(gpt2_run, tmp_path):
    """An adapter stores its base's absolute path: with the base stage's cache entry moved away, export names the
    missing base in one line (exit 2) and writes nothing; put back, the same command works."""
    won = _summary(gpt2_run)["winner"]["variant"]
    config = gpt2_run / "tasks" / won / "adapter" / "adapter_config.json"
    base = Path(json.loads(config.read_text())["base_model_name_or_path"])
    assert (base / "config.json").is_file() and base.parent == gpt2_run.parents[2] / "cache" / "base", base  # cached
    moved = tmp_path / "moved-base"
    shutil.move(base, moved)
    try:
        out = tmp_path / "merged"
        err = _refused(export(gpt2_run, "--merge", out), f"the base model of {config.parent}, {base}, is gone")
        assert "put that checkpoint back" in err, err
        assert [p.name for p in tmp_path.iterdir()] == ["moved-base"], "export wrote something"
        _refused(export(gpt2_run), f"{base}, is gone")  # without --merge (where the adapter and base are)
    finally:
        shutil.move(moved, base)
    again = export(gpt2_run, "--merge", out)
    assert again.returncode == 0 and (out / "config.json").is_file(), again.stderr[-2000:]


@pytest.mark.integration
def test_a_resumed_task_ends_with_the_same_adapters(gpt2_run):
    """The task is resumed from its step-4 checkpoint after losing its final adapter and result: it ends with
    the same files (its best so far is read back from adapter-best/, later evaluations repeat the same losses)."""
    task = gpt2_run / "tasks" / "r8"
    before = {
        f: _sha(task / f)
        for f in (
            "adapter/adapter_model.safetensors",
            "adapter-best/adapter_model.safetensors",
            "adapter-best/held_out.json",
        )
    }
    result = json.loads((task / "result.json").read_text())
    shutil.rmtree(task / "adapter")
    (task / "result.json").unlink()
    manifest = json.loads((gpt2_run / "manifest.json").read_text())
    manifest["tasks"]["r8"]["state"] = "failed"
    (gpt2_run / "manifest.json").write_text(json.dumps(manifest))
    proc = run_cli(f"resume={gpt2_run}", cwd=gpt2_run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any(
        r["event"] == "checkpoint_loaded"
        for r in map(json.loads, (task / "events-rank0.jsonl").read_text().splitlines())
    )
    assert {f: _sha(task / f) for f in before} == before
    assert json.loads((task / "result.json").read_text()) == result


# ---- no base stage: the seed-built base is saved once in the run dir ---------------------------------------------
@pytest.mark.integration
def test_without_a_base_stage_the_seed_built_base_is_saved_for_the_adapters(tmp_path):
    run_dir = _run(tmp_path, "base.enabled=false", "train.steps=3", NO_EVERY, *FAST)
    bases = {
        json.loads((run_dir / "tasks" / v / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
        for v in ("r8", "r32")
    }
    assert len(bases) == 1 and Path(bases.pop()).parent == run_dir / "base-init", "one base, shared"
    summary = _summary(run_dir)
    for variant in ("r8", "r32"):
        loss = held_out_loss(load_adapter(run_dir / "tasks" / variant / "adapter"), run_dir, variant)
        assert abs(loss - summary["variants"][variant]["val_loss"]) < TOL, variant
    assert not (run_dir / "tasks" / "r8" / "adapter-best").exists(), "no train.eval_every: the final adapter only"


# ---- model=hf: the adapter sits on the user's checkpoint --------------------------------------------------------
@pytest.mark.integration
def test_a_local_checkpoints_adapter_reproduces_the_loss_plain_and_merged(llama_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, checkpoint = llama_run
    summary = _summary(run_dir)
    won = summary["winner"]["variant"]
    for variant in ("r8", "r32"):
        adapter = run_dir / "tasks" / variant / "adapter"
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(checkpoint)
        loss = held_out_loss(load_adapter(adapter), run_dir, variant)
        assert abs(loss - summary["variants"][variant]["val_loss"]) < TOL, variant
    proc = export(run_dir, "--merge", tmp_path / "merged")
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert abs(held_out_loss(merged, run_dir, won) - summary["variants"][won]["val_loss"]) < TOL
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    # no train.eval_every: there is no adapter-best to export
    _refused(export(run_dir, "--best", "--merge", tmp_path / "best"), "adapter-best", "leave out --best")
    assert not (tmp_path / "best").exists()
