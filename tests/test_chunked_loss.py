"""train.loss_chunk_tokens computes the model's own logits (issue 36, finding 2): the LM head as a module (Phi's
bias), then the post-processing transformers applies (Gemma-2's final soft-capping, Cohere's logit_scale, Granite's
logits_scaling), so the chunked loss equals the plain one; a model whose post-processing it cannot reproduce is
refused at submission in one line.

    pytest tests/test_chunked_loss.py
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli, run_dir_of, step_losses
from tiny_checkpoints import make_checkpoint, write_jsonl

from slurm_router.train.logits import why_not
from slurm_router.train.loss import target_positions, token_loss_sum

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_checkpoint(root / arch, arch) for arch in ("phi", "gemma2")}


def _batch(model, lengths, width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    inputs = torch.zeros((len(lengths), width), dtype=torch.int64)
    labels = torch.full((len(lengths), width), -100, dtype=torch.int64)
    for r, n in enumerate(lengths):
        inputs[r, :n] = labels[r, :n] = torch.randint(3, vocab, (n,), generator=gen)
    return inputs, labels


def _plain_and_chunked(model):
    inputs, labels = _batch(model, [9, 3, 16, 12], 16)
    n, index = target_positions([9, 3, 16, 12], 16)
    plain, _ = token_loss_sum(model, inputs, labels, 0, n, index)
    chunked, _ = token_loss_sum(model, inputs, labels, 7, n, index)
    return plain, chunked


@pytest.mark.parametrize("arch", ["phi", "gemma2"])
def test_chunked_loss_equals_the_plain_loss_on_checkpoints(checkpoints, arch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints[arch]).eval()
    if arch == "phi":
        assert model.lm_head.bias.abs().max() > 0.5  # the head's bias matters
    else:
        assert model.config.final_logit_softcapping == 0.1  # low enough to bend the logits
    plain, chunked = _plain_and_chunked(model)
    assert torch.allclose(plain, chunked, rtol=1e-5), (float(plain), float(chunked))
    # the gradients too: the chunked loss trains the same model
    model.zero_grad()
    plain.backward()
    g_plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _plain_and_chunked(model)[1].backward()
    assert all(torch.allclose(a, p.grad, rtol=1e-4, atol=1e-6) for a, p in zip(g_plain, model.parameters()))


@pytest.mark.parametrize(
    "kind,settings",
    [("cohere", {"logit_scale": 0.3}), ("granite", {"logits_scaling": 4.0}), ("gemma3_text", {"head_dim": 8})],
)
def test_chunked_loss_applies_the_scales_transformers_applies(kind, settings):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    extra = {"final_logit_softcapping": 0.5} if kind == "gemma3_text" else {}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **SMALL, **settings, **extra)).eval()
    plain, chunked = _plain_and_chunked(model)
    assert torch.allclose(plain, chunked, rtol=1e-5), (float(plain), float(chunked))


def test_a_post_processing_it_cannot_reproduce_is_named():
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        hcx = AutoModelForCausalLM.from_config(AutoConfig.for_model("hyperclovax", **SMALL))
        llama = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL))
    assert why_not(hcx) == "logits = self.lm_head(hidden_states) * self.config.logits_scaling"
    assert why_not(llama) is None


def _hyperclovax_checkpoint(folder: Path) -> Path:
    """A llama tokenizer over a HyperCLOVAX model (Llama with its logits multiplied by config.logits_scaling)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    make_checkpoint(folder, "llama")
    ids = json.loads((folder / "config.json").read_text())
    config = AutoConfig.for_model(
        "hyperclovax",
        **{**SMALL, "vocab_size": ids["vocab_size"]},
        logits_scaling=0.5,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_the_chunked_loss_on_a_model_it_cannot_reproduce_is_refused_in_one_line(tmp_path):
    folder = _hyperclovax_checkpoint(tmp_path / "hcx")
    runs = tmp_path / "runs"
    proc = run_cli("model=hf", f"model.name_or_path={folder}", "train.loss_chunk_tokens=64", f"run_root={runs}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: train.loss_chunk_tokens=64:"), proc.stderr
    assert "hyperclovax" in lines[0] and "drop train.loss_chunk_tokens" in lines[0]
    assert not runs.exists()


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["phi", "gemma2"])
def test_a_chunked_run_trains_the_plain_loss_curve(checkpoints, arch, tmp_path):
    rows = [{"text": f"row {i}: " + "lorem ipsum dolor " * (3 + i % 9)} for i in range(80)]
    proc = run_cli(
        "-m",
        "train.loss_chunk_tokens=0,16",
        "model=hf",
        f"model.name_or_path={checkpoints[arch]}",
        "data=jsonl",
        f"data.path={write_jsonl(tmp_path / 'train.jsonl', rows)}",
        "train.steps=3",
        "train.global_batch_size=8",
        "train.eval_batches=1",
        "data.max_len=64",
        "launcher=local",
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tasks = run_dir_of(proc) / "tasks"
    curves = {
        json.loads((t / "task.json").read_text())["config"]["train"]["loss_chunk_tokens"]: step_losses(t)
        for t in tasks.iterdir()
    }
    assert len(curves[0]) == 3 and curves[0] == pytest.approx(curves[16], rel=1e-5), curves
