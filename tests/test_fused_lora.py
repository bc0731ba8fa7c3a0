"""Fused multi-LoRA (slurm_router/train/fused_lora.py): K variants over one base in one forward and backward
train exactly as each would alone: per step, per variant, the same loss within 1e-5 (fp32, CPU), and adapters
that peft alone loads onto the base and that compute what the separate run's adapter computes."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from slurm_router.config.schema import DataConfig, ModelConfig
from slurm_router.train import packed
from slurm_router.train.data import GlobalBatchSampler, build_corpus
from slurm_router.train.fused_lora import fuse, fused_loss, fused_packed_batch, save_adapter, why_not_fusable
from slurm_router.train.loss import token_loss_sum
from slurm_router.train.model import build_model, trainable_parameters
from slurm_router.train.optim import make_optimizer
from slurm_router.train.packed import packed_tensors
from slurm_router.train.tokenizer import ByteTokenizer

CPU = torch.device("cpu")
STEPS, BATCH, CLIP, DECAY = 4, 6, 1.0, 0.01
# (r, alpha, lr, training seed, target layers): ranks, scalings, learning rates, seeds and target layers differ
TARGETS = {
    "gpt2": (["c_attn", "c_proj"], ["c_attn"], ["c_attn", "c_proj", "c_fc"]),
    "llama": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]),
}
SHAPES = [(4, 8, 5e-3, 1), (8, 32, 1e-2, 2), (2, 4, 2e-3, 3)]
ARCH = {"checkpoint": None}  # model=hf's folder for the llama case (made once per module)


def _model_cfg(r: int, alpha: int, targets: list[str]):
    cfg = OmegaConf.structured(ModelConfig)
    if ARCH["checkpoint"]:
        cfg.kind, cfg.name_or_path = "hf", str(ARCH["checkpoint"])
    else:
        cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_positions = 2, 4, 64, 512
    cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules = r, alpha, 0.0, targets
    return cfg


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def arch(request, tmp_path_factory):
    """(the variants, the training split, the vocabulary size) of a tiny GPT-2 built from a config, or of a
    tiny Llama checkpoint (model=hf)."""
    from slurm_router.train.tokenizer import make_tokenizer

    ARCH["checkpoint"] = None
    if request.param == "llama":
        from tiny_checkpoints import make_checkpoint

        ARCH["checkpoint"] = make_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt", "llama")
    tokenizer = make_tokenizer(_model_cfg(4, 8, ["c_attn"])) if ARCH["checkpoint"] else ByteTokenizer()
    split = build_corpus(OmegaConf.structured(DataConfig(max_documents=30, max_len=96)), tokenizer).train
    variants = [(*shape, targets) for shape, targets in zip(SHAPES, TARGETS[request.param])]
    yield variants, split, tokenizer.vocab_size
    ARCH["checkpoint"] = None


def _variant_model(r, alpha, seed, targets, vocab):
    return build_model(_model_cfg(r, alpha, targets), vocab, seed=0, lora_seed=seed)


def _alone(split, variant, vocab) -> tuple[list[float], torch.nn.Module]:
    r, alpha, lr, seed, targets = variant
    model = _variant_model(r, alpha, seed, targets, vocab)
    packed.enable(model)
    params = trainable_parameters(model)
    opt = make_optimizer(params, lr, DECAY, CPU)
    sampler, losses = GlobalBatchSampler(len(split), BATCH, seed), []
    for step in range(STEPS):
        inputs, labels, n, index, kwargs = packed_tensors(split, sampler.batch(step), CPU)
        loss_sum, _ = token_loss_sum(model, inputs, labels, 0, n, index, kwargs)
        (loss_sum / n).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss_sum.detach()) / n)
    return losses, model


def _fused(split, variants, vocab):
    fm = fuse([_variant_model(r, alpha, seed, targets, vocab) for r, alpha, _, seed, targets in variants])
    packed.enable(fm.model)
    opts = [make_optimizer(m.params, v[2], DECAY, CPU) for m, v in zip(fm.members, variants)]
    samplers = [GlobalBatchSampler(len(split), BATCH, v[3]) for v in variants]
    losses: list[list[float]] = [[] for _ in variants]
    for step in range(STEPS):
        batch = fused_packed_batch(split, [s.batch(step) for s in samplers], CPU)
        total, sums = fused_loss(fm, batch, batch.n_targets)
        total.backward()
        for member, opt in zip(fm.members, opts):
            torch.nn.utils.clip_grad_norm_(member.params, CLIP)  # the norm over this variant's weights only
            opt.step()
            opt.zero_grad(set_to_none=True)
        for k, (s, n) in enumerate(zip(sums, batch.n_targets)):
            losses[k].append(s / n)
    return losses, fm


def test_fused_variants_train_exactly_as_alone_and_save_what_peft_loads(arch, tmp_path):
    variants, split, vocab = arch
    fused_losses, fm = _fused(split, variants, vocab)
    for k, variant in enumerate(variants):
        alone_losses, alone_model = _alone(split, variant, vocab)
        assert fused_losses[k] == pytest.approx(alone_losses, rel=1e-5), (k, fused_losses[k], alone_losses)
        assert all(math.isfinite(x) for x in alone_losses) and alone_losses[-1] < alone_losses[0] + 0.5
        # the fused variant's adapter, loaded by peft alone onto a fresh base, computes what its separate run's does
        save_adapter(fm.members[k], tmp_path / f"v{k}")
        from peft import PeftModel

        base = build_model(_model_cfg(*variant[:2], variant[4]), vocab, seed=0, lora=False)
        loaded = PeftModel.from_pretrained(base, str(tmp_path / f"v{k}")).eval()
        ids = torch.tensor([list(range(1, 40))])
        with torch.no_grad():
            want = alone_model.eval()(input_ids=ids, use_cache=False).logits
            got = loaded(input_ids=ids, use_cache=False).logits
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_a_variant_with_dropout_or_dora_is_not_fused():
    cfg = OmegaConf.structured(ModelConfig)  # the built-in GPT-2 shape
    cfg.n_layer, cfg.n_head, cfg.n_embd = 1, 2, 32
    cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules = 4, 8, ["c_attn"]
    cfg.lora.dropout = 0.1
    assert "dropout" in why_not_fusable(build_model(cfg, 257, seed=0))
    cfg.lora.dropout, cfg.lora.use_dora = 0.0, True
    assert "DoRA" in why_not_fusable(build_model(cfg, 257, seed=0))
    assert why_not_fusable(build_model(cfg, 257, seed=0, lora=False)) is not None
