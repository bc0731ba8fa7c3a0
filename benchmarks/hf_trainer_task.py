"""One variant x seed as a user would write it with transformers.Trainer + peft LoRA: the HF Trainer side of
benchmarks/hf_trainer_e2e.py (one process per variant and seed).

    python benchmarks/hf_trainer_task.py --lr 0.003 --seed 1 --steps 30 --eval-every 15 --out r.json

The model is the GPT-2 config slurm_router builds for model=gpt2_tiny (written out here as a user would, the base
initialised from the run's seed and the LoRA weights from the training seed + 1, as train/model.py does:
tests/test_hf_trainer_e2e.py checks the weights are equal). The data are slurm_router's own `data=stdlib` samples
and held-out batches (imported, so both sides train and judge on identical samples); the order of the training
samples is the Trainer's own seeded shuffle, not slurm_router's sampler. The schedule is linear warm-up then
cosine decay to 10% (Trainer's cosine_with_min_lr), AdamW, gradient norm clipped at 1. The Trainer evaluates at
step 0 and every --eval-every steps; after training one more pass over the same held-out batches records each
batch's summed token loss and token count, so that the decision can use slurm_router's statistics.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

T0 = time.monotonic()

OVERRIDES = ["+experiment=lora_ab", "base.enabled=false", "data=stdlib"]


def gpt2_lora(model_cfg, run_seed: int, seed: int, r: int, alpha: int):
    """The tiny GPT-2 from its config (no download) with peft LoRA on c_attn and c_proj."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(run_seed)
    config = GPT2Config(
        vocab_size=model_cfg.vocab_size,
        n_positions=model_cfg.n_positions,
        n_embd=model_cfg.n_embd,
        n_layer=model_cfg.n_layer,
        n_head=model_cfg.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=256,
        eos_token_id=256,
    )
    model = GPT2LMHeadModel(config)
    torch.manual_seed(seed + 1)
    lora = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["c_attn", "c_proj"], task_type="CAUSAL_LM"
    )
    return get_peft_model(model, lora)


def example(split, i: int) -> dict:
    ids = [int(t) for t in split.sample(i)]
    mask = split.target_mask(i)
    return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]}


def collate(rows: list[dict], pad_id: int = 256) -> dict:
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for k, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[k, :n] = torch.tensor(r["input_ids"])
        labels[k, :n] = torch.tensor(r["labels"])
        att[k, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": att}


def batch_losses(model, batches: list[list[dict]]) -> tuple[list[float], list[float]]:
    """Per held-out batch: summed token loss over its targets, and their count."""
    import torch

    sums, tokens = [], []
    model.eval()
    with torch.no_grad():
        for rows in batches:
            b = collate(rows)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float()
            target = b["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
            )
            sums.append(float(loss))
            tokens.append(float((target != -100).sum()))
    return sums, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import torch
    from transformers import Trainer, TrainingArguments

    from slurm_router.config.compose import compose
    from slurm_router.train.data import build_corpus, eval_batches
    from slurm_router.train.tokenizer import make_tokenizer

    torch.set_num_threads(a.threads)
    cfg = compose(OVERRIDES)
    corpus = build_corpus(cfg.data, make_tokenizer(cfg.model))
    held_ids = eval_batches(corpus.val, cfg.train.eval_batches, cfg.train.eval_batch_size, cfg.seed)
    held = [[example(corpus.val, i) for i in ids] for ids in held_ids]
    sources = [sorted({corpus.val.source(i) for i in ids}) for ids in held_ids]

    class Train(torch.utils.data.Dataset):
        def __len__(self):
            return len(corpus.train)

        def __getitem__(self, i):
            return example(corpus.train, i)

    model = gpt2_lora(cfg.model, cfg.seed, a.seed, a.r, a.alpha)
    args = TrainingArguments(
        output_dir=str(a.out.parent / (a.out.stem + "-trainer")),
        max_steps=a.steps,
        per_device_train_batch_size=cfg.train.global_batch_size,
        per_device_eval_batch_size=cfg.train.eval_batch_size,
        learning_rate=a.lr,
        warmup_steps=cfg.train.warmup_steps,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        weight_decay=cfg.train.weight_decay,
        max_grad_norm=cfg.train.grad_clip,
        eval_strategy="steps",
        eval_steps=a.eval_every,
        eval_on_start=True,
        logging_steps=a.eval_every,
        save_strategy="no",
        seed=a.seed,
        use_cpu=True,
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    evals: list[dict] = []

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Train(),
        eval_dataset=[row for rows in held for row in rows],
        data_collator=collate,
    )
    t_train = time.monotonic()
    trainer.train()
    evals = [{"step": h["step"], "eval_loss": h["eval_loss"]} for h in trainer.state.log_history if "eval_loss" in h]
    sums, tokens = batch_losses(model, held)
    out = {
        "lr": a.lr,
        "seed": a.seed,
        "r": a.r,
        "steps": a.steps,
        "evals": evals,
        "val_loss": sum(sums) / sum(tokens),
        "loss_sums": sums,
        "tokens": tokens,
        "sources": sources,
        "setup_s": t_train - T0,
        "wall_s_inside": time.monotonic() - T0,
    }
    a.out.write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
