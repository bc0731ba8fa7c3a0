"""Packed micro-batches (train.packing, slurm_router/train/packed.py): the same math as padded ones.

- one packed row computes the padded batch's token-loss sum, target count and LoRA gradients within 1e-5
  (fp32, CPU): plain text, prompt/completion and chat data (chat needs a checkpoint's chat template); GPT-2,
  Llama and Qwen2 tiny checkpoints; the plain
  and the chunked loss; samples of equal lengths (one SDPA call for them) and of different ones;
- no attention crosses a sample boundary: changing one sample's tokens leaves every other sample's loss as it was;
- the router lays a device's share into the fewest rows the token cap and memory allow, every sample once, and
  an out-of-memory row halves by tokens;
- the real command: per-step losses packed vs padded within 1e-5, on 1 and 2 devices, with no padding and one
  micro-batch per device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_cli, run_dir_of, step_losses
from omegaconf import OmegaConf
from tiny_checkpoints import chat_rows, make_checkpoint, prompt_completion_rows, write_jsonl

from slurm_router.config.schema import DataConfig, ModelConfig
from slurm_router.router import MemoryModel, RouterSettings
from slurm_router.router.packing import Batch, pack_rows, split_for_oom
from slurm_router.train.data import build_corpus
from slurm_router.train.loss import token_loss_sum
from slurm_router.train.packed import enable, packed_tensors, why_not_packable
from slurm_router.train.tokenizer import ByteTokenizer, make_tokenizer
from slurm_router.worker.microbatch import batch_tensors

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root / arch, arch) for arch in ("llama", "qwen2", "gpt2")}


def _gpt2(vocab: int = 257):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=vocab, n_positions=512, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
    )


def _hf_model(folder):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    return model.train()


def _split(tmp_path, kind: str, tokenizer):
    if kind == "plain":
        return build_corpus(
            OmegaConf.structured(DataConfig(kind="stdlib", max_len=96, max_documents=40)), tokenizer
        ).train
    if kind == "prompt_completion":
        path = write_jsonl(tmp_path / "pc.jsonl", prompt_completion_rows(24))
        fields = {"prompt_field": "prompt", "completion_field": "completion"}
    else:
        path = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
        fields = {"messages_field": "messages"}
    return build_corpus(
        OmegaConf.structured(DataConfig(kind="jsonl", path=str(path), max_len=256, **fields)), tokenizer
    ).train


def _loss_and_grads(model, tensors, chunk: int, model_kwargs=None):
    model.zero_grad(set_to_none=True)
    loss, n = token_loss_sum(model, tensors[0], tensors[1], chunk, tensors[2], tensors[3], model_kwargs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), n, grads


def _pick(split, n: int = 7) -> list[int]:
    """Samples of different lengths, and two of one length (the batched SDPA path) where the split has them."""
    lengths = np.asarray(split.lengths)
    ids = list(range(min(n, len(split))))
    values, counts = np.unique(lengths, return_counts=True)
    if (counts > 1).any():
        same = np.flatnonzero(lengths == values[np.argmax(counts)])[:2].tolist()
        ids = sorted(set(ids) | set(same))
    return ids


def _assert_same(model, split, ids, pad_id, chunk):
    padded = batch_tensors(split, ids, pad_id, CPU)
    loss_pad, n_pad, g_pad = _loss_and_grads(model, padded, chunk)
    inputs, labels, n_targets, index, kwargs = packed_tensors(split, ids, CPU)
    assert inputs.shape == (1, sum(len(split.sample(i)) for i in ids)), "a packed row holds real tokens only"
    loss_pack, n_pack, g_pack = _loss_and_grads(model, (inputs, labels, n_targets, index), chunk, kwargs)
    assert n_pack == n_pad == split.count_targets(ids)
    assert loss_pack == pytest.approx(loss_pad, rel=1e-5)
    assert g_pack.keys() == g_pad.keys() and g_pad
    for name in g_pad:
        rel = float((g_pack[name] - g_pad[name]).norm() / g_pad[name].norm().clamp_min(1e-30))
        assert rel < 1e-5, (name, rel)


@pytest.mark.parametrize("kind", ["plain", "prompt_completion"])
def test_a_packed_row_is_the_padded_batch_on_gpt2(tmp_path, kind):
    tok = ByteTokenizer()
    split = _split(tmp_path, kind, tok)
    model = _lora(_gpt2())
    assert why_not_packable(model) is None
    enable(model)
    for chunk in (0, 16):
        _assert_same(model, split, _pick(split), tok.pad_id, chunk)


@pytest.mark.parametrize("kind", ["plain", "prompt_completion"])
def test_held_out_losses_of_a_packed_task_are_the_padded_ones(tmp_path, kind):
    """The worker's evaluation (held_out_sums): a task that packs rows scores each held-out batch as one packed row
    under inference_mode; each batch's loss sum and target count are the padded batch's, to 1e-6."""
    from types import SimpleNamespace

    from slurm_router.worker.evaluation import held_out_sums

    tok = ByteTokenizer()
    split = _split(tmp_path, kind, tok)
    model = _lora(_gpt2())
    enable(model)
    batches = [_pick(split), list(range(7, 7 + min(9, len(split) - 7)))]
    cfg = OmegaConf.create({"train": {"precision": "fp32", "loss_chunk_tokens": 0}})
    member = SimpleNamespace(k=0)
    sums = {
        packed: held_out_sums(
            SimpleNamespace(members=[member], alive=[member], model=model, fused=None, packed=packed),
            split,
            batches,
            tok.pad_id,
            cfg,
            CPU,
            0,
            1,
        )  # fmt: skip
        for packed in (False, True)
    }
    assert sums[True][0, 1::2].tolist() == sums[False][0, 1::2].tolist() == [split.count_targets(b) for b in batches]
    assert torch.allclose(sums[True], sums[False], rtol=1e-6, atol=0), (sums[True], sums[False])
    assert model.training, "the model is back in training mode"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("kind", ["plain", "chat"])
def test_a_packed_row_is_the_padded_batch_on_checkpoints(tmp_path, checkpoints, arch, kind):
    tok = make_tokenizer(OmegaConf.structured(ModelConfig(kind="hf", name_or_path=str(checkpoints[arch]))))
    split = _split(tmp_path, kind, tok)
    model = _lora(_hf_model(checkpoints[arch]))
    enable(model)
    _assert_same(model, split, _pick(split), tok.pad_id, 0)


def test_no_attention_crosses_a_sample_boundary(tmp_path):
    """Change every token of one sample: the other samples' per-token losses in the row stay bitwise the same."""
    import torch.nn.functional as F

    tok = ByteTokenizer()
    split = _split(tmp_path, "plain", tok)
    model = _gpt2().eval()
    enable(model)
    ids = _pick(split, 5)
    inputs, labels, _, _, kwargs = packed_tensors(split, ids, CPU)
    spans = kwargs["packed_spans"]
    with torch.no_grad():
        before = F.cross_entropy(
            model(input_ids=inputs, **kwargs).logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="none"
        )
        changed = inputs.clone()
        s, e = spans[1]
        changed[0, s:e] = (changed[0, s:e] + 7) % 256
        after = F.cross_entropy(
            model(input_ids=changed, **kwargs).logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="none"
        )
    others = torch.ones_like(before, dtype=torch.bool)
    others[s - 1 : e] = False  # the changed sample's positions (and the target of its first token)
    assert torch.equal(before[others], after[others])
    assert not torch.equal(before[s : e - 1], after[s : e - 1])
    assert (labels[0, [a for a, _ in spans]] == -100).all(), "a sample's first token is never a target"


# ---- the router's packed mode ------------------------------------------------------------------------------
def _mem() -> MemoryModel:
    return MemoryModel(fixed_bytes=1000, per_token_bytes=10, per_len2_bytes=0.01)


def test_pack_rows_uses_the_fewest_rows_the_cap_and_memory_allow():
    lengths = [300, 250, 200, 120, 100, 60, 40, 30]
    ids = [10 + i for i in range(len(lengths))]
    costs = [float(n) for n in lengths]
    settings = RouterSettings(packed=True)
    batch = Batch(ids, lengths, costs, _mem())
    one = pack_rows(range(len(lengths)), batch, None, settings, [])
    assert len(one) == 1 and one[0].n_tokens == one[0].n_padded_tokens == sum(lengths)
    capped = pack_rows(range(len(lengths)), batch, None, RouterSettings(packed=True, max_tokens_per_microbatch=400), [])
    assert all(mb.n_tokens <= 400 for mb in capped)
    assert len(capped) == -(-sum(lengths) // 400) == 3, "first-fit decreasing fills rows to the cap"
    assert sorted(i for mb in capped for i in mb.sample_ids) == ids
    assert all(mb.n_padded_tokens == mb.n_tokens for mb in capped)
    budget = _mem().predict(500, 3, 166)
    by_memory = pack_rows(range(len(lengths)), batch, budget, settings, [])
    assert all(mb.predicted_mem_bytes <= budget for mb in by_memory) and len(by_memory) >= 3
    oversize: list[int] = []
    pack_rows([0, 7], batch, _mem().predict(100, 1, 100), settings, oversize)
    assert oversize == [0], "a sample that fits nowhere alone is reported, never dropped"


def test_an_out_of_memory_row_halves_by_tokens_with_every_sample_once():
    lengths = {1: 400, 2: 300, 3: 100, 4: 90, 5: 10}
    settings = RouterSettings(packed=True)
    batch = Batch(list(lengths), list(lengths.values()), [float(v) for v in lengths.values()], _mem())
    row = pack_rows(range(5), batch, None, settings, [])[0]
    a, b = split_for_oom(row, lengths, settings, _mem())
    assert sorted(a.sample_ids + b.sample_ids) == sorted(lengths)
    assert a.n_padded_tokens == a.n_tokens and b.n_padded_tokens == b.n_tokens
    assert abs(a.n_tokens - b.n_tokens) <= max(lengths.values())
    assert max(a.n_tokens, b.n_tokens) < row.n_tokens


# ---- the real command -----------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize(
    "devices,policy",
    [(1, "balanced"), (2, "round_robin"), (2, "least_loaded"), (2, "balanced"), (3, "affinity")],
)
def test_the_job_packed_trains_the_padded_loss_curve(tmp_path, devices, policy):
    common = [
        "base.enabled=false",
        "train.steps=5",
        "train.global_batch_size=12",
        "train.eval_batches=1",
        "train.eval_batch_size=4",
        "data.max_documents=60",
        f"resources.devices_per_task={devices}",
        f"router={policy}",
        f"run_root={tmp_path}",
        f"launcher.cpu_slots={max(2, devices)}",
    ]
    curves, rows = {}, {}
    for packing in ("false", "true"):
        out = run_cli(*common, f"train.packing={packing}", cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        task = run_dir_of(out) / "tasks" / "main"
        curves[packing] = step_losses(task)
        from slurm_router.rundir.events import read_events

        rows[packing] = [r for r in read_events(task / "events-rank0.jsonl") if r["event"] == "step"]
    assert len(curves["true"]) == 5
    for packed, padded in zip(curves["true"], curves["false"]):
        assert packed == pytest.approx(padded, rel=1e-5)
    assert all(r["n_pad_tokens"] == 0 for r in rows["true"]), "a packed row has no padding"
    assert all(n <= 1 for r in rows["true"] for n in r["n_micro"]), "one packed row per device"
    assert any(r["n_pad_tokens"] > 0 or max(r["n_micro"]) > 1 for r in rows["false"]), (
        "the padded run pays padding or extra micro-batches (else this test shows nothing)"
    )


def test_a_model_packed_rows_would_change_trains_padded_and_says_why(capsys):
    """Sliding-window attention: per-sample causal SDPA would attend past the window, so the task trains padded."""
    from transformers import MistralConfig, MistralForCausalLM

    from slurm_router.train.packed import choose_packing

    model = MistralForCausalLM(
        MistralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=16,
        )
    )
    train = OmegaConf.create({"packing": "auto", "compile": False})
    assert choose_packing(model, train, say=True) is False
    assert "sliding-window attention" in capsys.readouterr().out
    assert choose_packing(_gpt2(), train, say=True) is True
    assert choose_packing(_gpt2(), OmegaConf.create({"packing": "auto", "compile": True}), say=True) is False
