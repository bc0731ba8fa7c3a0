"""Memory of a Llama-shaped ~1B-parameter model with its frozen weights in bf16 vs fp32 (model.dtype), LoRA r16
on peft's default layers (q_proj, v_proj), trained as on a GPU (bf16 autocast, fp32 LoRA weights, AdamW):

- predicted: the router's memory model seeded as a worker seeds it (train.model.memory_shape ->
  MemoryModel.from_model_bytes), the model built on the meta device (nothing allocated, runs anywhere);
- measured, when a GPU is there: torch.cuda.max_memory_allocated over one micro-batch's forward, backward and
  optimizer step (the second step: Adam's states exist), the same model with random weights.

    python benchmarks/memory_dtype.py                       # micro-batch 8 x 512 tokens
    python benchmarks/memory_dtype.py --batch 4 --seq 2048

Writes benchmarks/results/memory_dtype.md and .json (a GPU run adds its measured columns).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from provenance import RESULTS, check, header, write  # noqa: E402

# Llama-3.2-1B's shape (1.24B parameters, tied embeddings), from its config: no download
LLAMA_1B = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
GIB = float(1 << 30)


def lora_model(dtype: torch.dtype, device: str):
    """The model a LoRA variant trains: frozen weights in `dtype`, LoRA r16 in fp32 (peft casts it up)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA_1B), dtype=dtype)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=None, task_type="CAUSAL_LM")).train()


def predicted(dtype: torch.dtype, batch: int, seq: int) -> dict:
    from omegaconf import OmegaConf

    from slurm_router.router import MemoryModel
    from slurm_router.train.model import memory_shape

    model = lora_model(dtype, "meta")
    cfg = OmegaConf.create({"train": {"precision": "auto", "gradient_checkpointing": False}})
    shape = memory_shape(model, cfg, torch.device("cuda"))  # as a GPU worker sees it: bf16 autocast
    mem = MemoryModel.from_model_bytes(**shape, vocab_size=LLAMA_1B["vocab_size"])
    fixed, per_token, per_len2 = mem.coef
    return {
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "frozen_bytes": shape["frozen_bytes"],
        "trainable_bytes": shape["trainable_bytes"],
        "fixed_bytes": fixed,
        "per_token_bytes": per_token,
        "per_len2_bytes": per_len2,
        "predicted_peak_bytes": mem.predict(batch * seq, batch, seq),
        "predicted_no_len2_bytes": int(fixed + per_token * batch * seq),
    }


def measured(dtype: torch.dtype, batch: int, seq: int) -> dict:
    """One micro-batch on the GPU, as a worker computes it: bf16 autocast, fp32 loss, fused AdamW."""
    from slurm_router.train.optim import make_optimizer

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = lora_model(dtype, "cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, 1e-4, 0.0, torch.device("cuda"))
    ids = torch.randint(0, 256, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    weights_bytes = torch.cuda.memory_allocated()
    for step in range(2):
        if step == 1:
            torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="sum"
        )
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
    torch.cuda.synchronize()
    out = {"measured_weights_bytes": weights_bytes, "measured_peak_bytes": torch.cuda.max_memory_allocated()}
    del model, optimizer, params
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    check(RESULTS / "memory_dtype.md")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    rows = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        rows[name] = predicted(dtype, args.batch, args.seq)
        if gpu:
            rows[name].update(measured(dtype, args.batch, args.seq))
    b, f = rows["bf16"], rows["fp32"]
    command = f"python benchmarks/memory_dtype.py --batch {args.batch} --seq {args.seq}"
    head = header(command)
    lines = [
        "# Memory: bf16 vs fp32 frozen weights (Llama-shaped, ~1B parameters)",
        "",
        *head,
        "",
        f"{'GPU ' + gpu if gpu else 'No GPU: predicted only'}. Model: Llama-3.2-1B's shape built from its config "
        f"({b['n_params'] / 1e9:.2f}B parameters, hidden 2048, 16 layers, vocab 128256, tied embeddings), LoRA r16 on "
        f"q_proj and v_proj (peft's default; {b['n_trainable'] / 1e6:.2f}M trainable, fp32), AdamW; one micro-batch "
        f"of {args.batch} x {args.seq} tokens under bf16 autocast. Predicted: the router's memory model seeded as a "
        "worker seeds it, the model on the meta device (nothing allocated); the len^2 term assumes eager attention "
        "(SDPA/flash keep no scores, so the column without it is the closer one on a GPU).",
        "",
        "| frozen weights | weights GiB (frozen + LoRA) | fixed term GiB (weights + grads + Adam + autocast copies) | predicted peak GiB "
        "| predicted, no len^2 GiB |" + (" measured weights GiB | measured peak GiB |" if gpu else ""),
        "|---|---:|---:|---:|---:|" + ("---:|---:|" if gpu else ""),
    ]
    for name, r in rows.items():
        line = (
            f"| {name} | {(r['frozen_bytes'] + r['trainable_bytes']) / GIB:.2f} | {r['fixed_bytes'] / GIB:.2f} | "
            f"{r['predicted_peak_bytes'] / GIB:.2f} | {r['predicted_no_len2_bytes'] / GIB:.2f} |"
        )
        if gpu:
            line += f" {r['measured_weights_bytes'] / GIB:.2f} | {r['measured_peak_bytes'] / GIB:.2f} |"
        lines.append(line)
    lines += [
        "",
        f"Ratio bf16 / fp32: weights {(b['frozen_bytes'] + b['trainable_bytes']) / (f['frozen_bytes'] + f['trainable_bytes']):.3f}, "
        f"predicted peak {b['predicted_peak_bytes'] / f['predicted_peak_bytes']:.3f}, "
        f"predicted without len^2 {b['predicted_no_len2_bytes'] / f['predicted_no_len2_bytes']:.3f}"
        + (f", measured peak {b['measured_peak_bytes'] / f['measured_peak_bytes']:.3f}" if gpu else "")
        + ".",
    ]
    if gpu:
        lines.append(
            "Predicted / measured peak: "
            + ", ".join(
                f"{n} {r['predicted_peak_bytes'] / r['measured_peak_bytes']:.2f} "
                f"(no len^2: {r['predicted_no_len2_bytes'] / r['measured_peak_bytes']:.2f})"
                for n, r in rows.items()
            )
            + "."
        )
    else:
        lines.append(
            "No GPU here: the measured columns (torch.cuda.max_memory_allocated) come from running this on one."
        )
    data = {"gpu": gpu, "batch": args.batch, "seq": args.seq, "shape": LLAMA_1B, "rows": rows}
    write(RESULTS / "memory_dtype.md", "\n".join(lines), data)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
