"""lora_ab on the checkpoints and data people bring (issue 13): tiny Llama-, Qwen2- and GPT-2-architecture
checkpoints made on the spot (tests/tiny_checkpoints.py), with chat data and with prompt/completion data, through
the real command. Each run must train on the target tokens only, compare its variants and hand over adapters."""

import json

import pytest
from conftest import run_cli, run_dir_of
from tiny_checkpoints import ARCHITECTURES, chat_rows, make_checkpoint, prompt_completion_rows, write_jsonl

FORMATS = {
    "chat": (chat_rows, ["data.messages_field=messages"]),
    "prompt_completion": (prompt_completion_rows, ["data.prompt_field=prompt", "data.completion_field=completion"]),
}
TINY = [
    "train.steps=6",
    "train.global_batch_size=8",
    "train.eval_batches=2",
    "train.eval_batch_size=8",
    "train.warmup_steps=1",
    "data.max_len=96",
    "data.val_fraction=0.1",
    "launcher=local",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


def _events(task_dir, kind):
    rows = [json.loads(line) for line in (task_dir / "events-rank0.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == kind]


@pytest.mark.integration
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_ab_on_a_local_checkpoint(arch, fmt, checkpoints, tmp_path):
    rows, fields = FORMATS[fmt]
    data = write_jsonl(tmp_path / "train.jsonl", rows(96))
    proc = run_cli(
        "+experiment=lora_ab",
        "model=hf",
        f"model.name_or_path={checkpoints[arch]}",
        "data=jsonl",
        f"data.path={data}",
        *fields,
        *TINY,
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert set(summary["variants"]) == {"r8", "r32"}
    for name in ("r8", "r32"):
        task = run_dir / "tasks" / name
        steps = _events(task, "step")
        assert len(steps) == 6
        # the loss counts target tokens only: the prompt (or the system and user turns) is never a target
        assert all(0 < s["n_target_tokens"] < s["n_tokens"] - s["n_samples"] for s in steps)
        assert all(s["loss"] == s["loss"] and s["loss"] > 0 for s in steps)
        start = _events(task, "start")[0]
        assert 0 < start["n_trainable_params"] < start["n_params"] / 4  # LoRA only: peft's defaults
        adapter = task / "adapter"
        assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(checkpoints[arch])
    verdict = (run_dir / "report" / "report.md").read_text()
    assert "adapter" in verdict and str(run_dir / "tasks") in verdict
