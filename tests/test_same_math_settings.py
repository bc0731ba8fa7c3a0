"""Two "same math" claims checked with the settings that could break them (issue 36, finding 10), through the command:

- packed rows with gradient checkpointing (train.gradient_checkpointing=true recomputes each layer in backward,
  with the packed attention's per-sample arguments) train the padded loss curve, on the GPT-2 built here and on
  a Llama checkpoint;
- fused variants that differ in weight decay, gradient clipping and warm-up each train their separate run's curve
  (each variant steps its own optimizer with its own settings: a member given its leader's would drift).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import event_rows, read_json, run_cli, run_dir_of, step_losses
from tiny_checkpoints import make_checkpoint

pytestmark = pytest.mark.integration
RTOL = 1e-5  # as tests/test_packed.py and tests/test_fused_run.py


def _run(tmp_path: Path, *args: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = run_cli(*args, f"run_root={tmp_path / 'runs'}", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_packed_rows_with_gradient_checkpointing_train_the_padded_curve(tmp_path, model):
    args = [
        "base.enabled=false",
        "train.steps=4",
        "train.global_batch_size=8",
        "train.eval_batches=1",
        "train.eval_batch_size=4",
        "data.max_documents=30",
        "data.max_len=128",
        "launcher.cpu_slots=1",
    ]
    if model == "llama":
        args += ["model=hf", f"model.name_or_path={make_checkpoint(tmp_path / 'llama', 'llama')}"]
    padded = step_losses(_run(tmp_path / "padded", *args, "train.packing=false") / "tasks" / "main")
    packed_dir = _run(tmp_path / "packed", *args, "train.packing=true", "train.gradient_checkpointing=true")
    rows = [r for r in event_rows(packed_dir / "tasks" / "main") if r["event"] == "step"]
    assert rows and all(r["n_pad_tokens"] == 0 for r in rows), "the checkpointed run did not train packed rows"
    assert len(padded) == 4 and step_losses(packed_dir / "tasks" / "main") == pytest.approx(padded, rel=RTOL)


# r8 (the leader) trains with the defaults, r32 (its member) with its own decay, clipping and warm-up
OWN_SETTINGS = [
    "train.weight_decay=0",
    "train.grad_clip=0",
    "train.warmup_steps=0",
    "variants.r32.train.weight_decay=0.5",
    "variants.r32.train.grad_clip=0.01",
    "variants.r32.train.warmup_steps=3",
]


def test_fused_variants_keep_their_own_decay_clipping_and_warmup(tmp_path):
    common = [
        "+experiment=lora_ab",
        "base.enabled=false",
        "train.steps=6",
        "train.global_batch_size=12",
        "train.lr=1e-2",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.eval_batch_size=4",
        "data.max_documents=40",
        "data.max_len=128",
        "launcher.cpu_slots=2",
        *OWN_SETTINGS,
    ]
    runs = {
        "alone": _run(tmp_path / "alone", *common),
        "fused": _run(tmp_path / "fused", *common, "resources.fuse_variants=2"),
    }
    assert read_json(runs["fused"] / "manifest.json")["tasks"]["r32"]["fused_into"] == "r8"
    for name in ("r8", "r32"):
        fused, alone = (step_losses(runs[k] / "tasks" / name) for k in ("fused", "alone"))
        assert len(fused) == 6 and fused == pytest.approx(alone, rel=RTOL), name
    lrs = {n: [r["lr"] for r in event_rows(runs["fused"] / "tasks" / n) if r["event"] == "step"] for n in ("r8", "r32")}
    assert lrs["r32"][:3] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2]) and lrs["r8"][0] == pytest.approx(1e-2), lrs
