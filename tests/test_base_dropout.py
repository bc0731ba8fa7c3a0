"""model.base_dropout (slurm_router/train/base_dropout.py) on checkpoints that ship dropout, as the public GPT-2
does (resid_pdrop, embd_pdrop, attn_pdrop 0.1): by default the base's dropout is set to 0, so fusing, packing and
the device count leave every step's loss as it was (the router's invariant); model.base_dropout=keep trains with
it, and the plan runs its variants unfused, saying why. Real multi-process workers (gloo) through the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import read_json, run_cli, run_dir_of, step_losses
from omegaconf import OmegaConf
from tiny_checkpoints import make_checkpoint

from slurm_router.config.schema import ModelConfig
from slurm_router.train.model import build_model

RTOL = 1e-5  # as tests/test_fused_run.py and tests/test_packed.py
PUBLIC_GPT2 = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}  # openai-community/gpt2's config.json
ZERO_LINE = (
    "base dropout: set to 0 (model.base_dropout=zero; the checkpoint ships attn_pdrop=0.1, embd_pdrop=0.1, "
    "resid_pdrop=0.1; model.base_dropout=keep keeps it)"
)


def _with_dropout(folder: Path, arch: str, rates: dict) -> Path:
    ckpt = make_checkpoint(folder, arch)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **rates}))
    return ckpt


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return _with_dropout(tmp_path_factory.mktemp("gpt2"), "gpt2", PUBLIC_GPT2)


@pytest.mark.parametrize("arch,rates", [("gpt2", PUBLIC_GPT2), ("llama", {"attention_dropout": 0.1})])
def test_the_loaded_base_draws_no_mask_unless_kept(tmp_path, arch, rates):
    """GPT-2's nn.Dropout layers and Llama's attention_dropout (a float its attention reads): two training-mode
    forwards of one input agree by default, and differ with model.base_dropout=keep."""
    ckpt = _with_dropout(tmp_path / arch, arch, rates)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    for mode, same in (("zero", True), ("keep", False)):
        cfg = OmegaConf.structured(ModelConfig(kind="hf", name_or_path=str(ckpt), base_dropout=mode))
        model = build_model(cfg, 512, seed=0)
        assert model.training
        first, second = (model(input_ids=ids).logits for _ in range(2))
        assert torch.equal(first, second) is same, (arch, mode)


def _run(tmp_path: Path, ckpt: Path, *args: str):
    common = [
        "+experiment=lora_ab",
        "base.enabled=false",
        "model=hf",
        f"model.name_or_path={ckpt}",
        "data.max_documents=30",
        "data.max_len=128",
        "train.steps=4",
        "train.global_batch_size=8",
        "train.warmup_steps=0",
        "train.lr=1e-2",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.eval_batch_size=4",
        "launcher.cpu_slots=2",
    ]
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = run_cli(*common, *args, f"run_root={tmp_path / 'runs'}", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, run_dir_of(proc)


def _curves(run_dir: Path) -> dict[str, list[float]]:
    return {name: step_losses(run_dir / "tasks" / name) for name in ("r8", "r32")}


@pytest.fixture(scope="module")
def padded(tmp_path_factory, gpt2):
    """The reference: each variant alone, on 1 device, in padded micro-batches."""
    return _run(tmp_path_factory.mktemp("padded"), gpt2, "train.packing=false", "router=round_robin")


@pytest.fixture(scope="module")
def packed(tmp_path_factory, gpt2):
    return _run(tmp_path_factory.mktemp("packed"), gpt2, "train.packing=true")


def _same(curves: dict, reference: dict) -> None:
    for name in ("r8", "r32"):
        assert len(curves[name]) == len(reference[name]) == 4, (name, curves, reference)
        assert curves[name] == pytest.approx(reference[name], rel=RTOL), name


@pytest.mark.integration
def test_the_plan_says_the_checkpoints_dropout_is_set_to_0(padded):
    proc, _ = padded
    assert proc.stdout.splitlines().count(ZERO_LINE) == 1, proc.stdout[-3000:]


@pytest.mark.integration
def test_packed_rows_train_the_padded_curve(padded, packed):
    _same(_curves(packed[1]), _curves(padded[1]))


@pytest.mark.integration
def test_two_devices_train_the_one_device_curve(tmp_path, gpt2, padded):
    _, run_dir = _run(tmp_path, gpt2, "train.packing=false", "resources.devices_per_task=2", "router=balanced")
    _same(_curves(run_dir), _curves(padded[1]))


@pytest.mark.integration
def test_fused_variants_train_their_separate_curves(tmp_path, gpt2, packed):
    _, run_dir = _run(tmp_path, gpt2, "train.packing=true", "resources.fuse_variants=2")
    assert read_json(run_dir / "manifest.json")["tasks"]["r32"]["fused_into"] == "r8"
    _same(_curves(run_dir), _curves(packed[1]))


@pytest.mark.integration
def test_kept_dropout_runs_the_variants_unfused_and_trains(tmp_path, gpt2, packed):
    proc, run_dir = _run(tmp_path, gpt2, "train.packing=true", "resources.fuse_variants=2", "model.base_dropout=keep")
    lines = proc.stdout.splitlines()
    assert any(line.startswith("base dropout: kept (model.base_dropout=keep: attn_pdrop=0.1") for line in lines)
    unfused = [line for line in lines if line.startswith("resources.fuse_variants: variant r")]
    assert [line.split()[2] for line in unfused] == ["r8", "r32"], proc.stdout[-3000:]
    assert all("runs unfused: model.base_dropout=keep: the checkpoint's dropout" in line for line in unfused)
    manifest = read_json(run_dir / "manifest.json")
    assert {manifest["tasks"][n]["state"] for n in ("r8", "r32")} == {"completed"}
    assert not manifest["tasks"]["r32"].get("fused_into")
    kept, zero = _curves(run_dir), _curves(packed[1])
    assert all(len(kept[n]) == 4 and all(map(torch.isfinite, torch.tensor(kept[n]))) for n in kept)
    assert kept["r8"] != pytest.approx(zero["r8"], rel=RTOL), "the kept dropout drew no mask"


@pytest.mark.integration
def test_a_checkpoint_without_dropout_gets_no_line(tmp_path):
    ckpt = make_checkpoint(tmp_path / "gpt2", "gpt2")  # dropout 0 (its summary_first_dropout: no causal LM reads it)
    proc = run_cli(
        "model=hf", f"model.name_or_path={ckpt}", "data.max_documents=30", "dry_run=true", f"run_root={tmp_path}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "base dropout" not in proc.stdout
