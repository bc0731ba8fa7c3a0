"""K LoRA variants fused over one base (slurm_router/train/fused_lora.py) against the same K variants trained as
separate processes on the same cores, side by side in one run: total tokens/s and peak memory (RSS).

    python benchmarks/fused.py                                   # K = 2, 4, 8, default model; GPT-2-small memory, K = 4
    python benchmarks/fused.py --ks 4 --steps 12 --small-steps 2 --out /tmp/fused.md

Separate: K processes, each one variant with one torch thread, two at a time (the local launcher's CPU slots on
this machine: one worker per core). Fused: one process, all K variants, as many torch threads as cores. Every
process trains the same variants (ranks, learning rates, training seeds differ) on the standard library corpus,
batch 16, packed rows, the same steps; tokens/s is real tokens over the wall time from the first timed step to the
last, after `--warmup` steps (each process's own clock; for the separate ones the union of their windows, which
holds the later processes' start-up, as the local launcher pays it). Peak memory is
each process's max RSS: the separate ones summed, the fused one alone. The GPT-2-small shape (12 x 768) runs few
steps: its row is for memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import REPO, check, header, write  # noqa: E402

SHAPES = {"default": (2, 4, 128), "gpt2_small": (12, 12, 768)}  # n_layer, n_head, n_embd
BATCH, MAX_LEN = 16, 256
# variant k: (r, alpha, lr, training seed)
VARIANTS = [(8, 16, 5e-3, 1), (16, 32, 2e-3, 2), (4, 8, 1e-2, 3), (8, 32, 5e-3, 4)]


def variant(k: int) -> tuple[int, int, float, int]:
    r, alpha, lr, seed = VARIANTS[k % len(VARIANTS)]
    return r, alpha, lr, seed + 10 * (k // len(VARIANTS))


def train(shape: str, ks: list[int], steps: int, warmup: int, threads: int, per_variant: bool = False) -> dict:
    """Train variants `ks` (fused when several) for `steps`; tokens and the timed window of the steps after warmup.
    per_variant: the fused model runs one forward and backward per variant (its samples alone), accumulating."""
    import torch
    from omegaconf import OmegaConf

    from slurm_router.config.schema import DataConfig, ModelConfig
    from slurm_router.train import packed
    from slurm_router.train.data import GlobalBatchSampler, build_corpus
    from slurm_router.train.fused_lora import fuse, fused_loss, fused_packed_batch
    from slurm_router.train.loss import token_loss_sum
    from slurm_router.train.model import build_model, trainable_parameters
    from slurm_router.train.optim import make_optimizer
    from slurm_router.train.packed import packed_tensors
    from slurm_router.train.tokenizer import ByteTokenizer

    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    n_layer, n_head, n_embd = SHAPES[shape]
    split = build_corpus(OmegaConf.structured(DataConfig(max_documents=200, max_len=MAX_LEN)), ByteTokenizer()).train

    def model_of(k: int):
        r, alpha, _, seed = variant(k)
        cfg = OmegaConf.structured(ModelConfig)
        cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_positions = n_layer, n_head, n_embd, 1024
        cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules = r, alpha, ["c_attn", "c_proj"]
        return build_model(cfg, 257, seed=0, lora_seed=seed)

    if len(ks) == 1:  # a separate task: the variant's own peft model, as the worker trains it
        model = model_of(ks[0])
        packed.enable(model)
        params = trainable_parameters(model)
        opt = make_optimizer(params, variant(ks[0])[2], 0.0, cpu)
        sampler = GlobalBatchSampler(len(split), BATCH, variant(ks[0])[3])
    else:
        fm = fuse([model_of(k) for k in ks])
        packed.enable(fm.model)
        opts = [make_optimizer(m.params, variant(k)[2], 0.0, cpu) for m, k in zip(fm.members, ks)]
        samplers = [GlobalBatchSampler(len(split), BATCH, variant(k)[3]) for k in ks]
    tokens, t0 = 0, time.time()
    for step in range(steps):
        if step == warmup:
            tokens, t0 = 0, time.time()
        if len(ks) == 1:
            ids = sampler.batch(step)
            inputs, labels, n, index, kwargs = packed_tensors(split, ids, cpu)
            loss_sum, _ = token_loss_sum(model, inputs, labels, 0, n, index, kwargs)
            (loss_sum / n).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += int(sum(int(split.lengths[i]) for i in ids))
            continue
        ids = [s.batch(step) for s in samplers]
        parts = [[g if j == k else [] for j, g in enumerate(ids)] for k in range(len(ids))] if per_variant else [ids]
        for part in parts:
            batch = fused_packed_batch(split, part, cpu)
            total, _ = fused_loss(fm, batch, batch.n_targets)
            total.backward()
            tokens += sum(batch.n_tokens)
        for member, opt in zip(fm.members, opts):
            torch.nn.utils.clip_grad_norm_(member.params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    t1 = time.time()
    return {
        "tokens": tokens,
        "t0": t0,
        "t1": t1,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run(
    shape: str, ks: list[int], steps: int, warmup: int, threads: int, per_variant: bool = False
) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--worker", shape, ",".join(map(str, ks)), str(steps), str(warmup), str(threads)]
    argv += ["per_variant"] if per_variant else []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"worker exited {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def separate(shape: str, k: int, steps: int, warmup: int, cores: int) -> dict:
    """K one-variant processes, `cores` at a time, one thread each."""
    done, running, queue = [], [], list(range(k))
    while queue or running:
        while queue and len(running) < cores:
            running.append(run(shape, [queue.pop(0)], steps, warmup, 1))
        done.append(result(running.pop(0)))
    window = max(r["t1"] for r in done) - min(r["t0"] for r in done)
    return {"tokens_per_s": sum(r["tokens"] for r in done) / window, "rss_mb": sum(r["maxrss_mb"] for r in done)}


def fused(shape: str, k: int, steps: int, warmup: int, cores: int, per_variant: bool = False) -> dict:
    r = result(run(shape, list(range(k)), steps, warmup, cores, per_variant))
    return {"tokens_per_s": r["tokens"] / (r["t1"] - r["t0"]), "rss_mb": r["maxrss_mb"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        shape, ks, steps, warmup, threads = sys.argv[2:7]
        ids = [int(k) for k in ks.split(",")]
        per_variant = sys.argv[7:8] == ["per_variant"]
        print(json.dumps(train(shape, ids, int(steps), int(warmup), int(threads), per_variant)))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="2,4,8", help="numbers of variants, default model")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--small-k", type=int, default=4, help="variants of the GPT-2-small shape (0: skip it)")
    p.add_argument("--small-steps", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/fused-cpu.md"))
    args = p.parse_args()
    check(Path(args.out))
    cores = os.cpu_count() or 1
    rows = []
    cases = [("default", int(k), args.steps, args.warmup) for k in args.ks.split(",")]
    if args.small_k:
        cases.append(("gpt2_small", args.small_k, args.small_steps, 1))
    for shape, k, steps, warmup in cases:
        sep = separate(shape, k, steps, warmup, cores)
        fus = fused(shape, k, steps, warmup, cores)
        per = fused(shape, k, steps, warmup, cores, per_variant=True)
        rows.append((shape, k, sep, fus, per))
        print(shape, k, sep, fus, per, flush=True)
    command = "python benchmarks/fused.py " + " ".join(sys.argv[1:])
    lines = [
        "# Fused LoRA variants against separate processes (CPU)",
        "",
        *header(command.strip()),
        "",
        f"Separate: one process per variant, one torch thread each, {cores} at a time; fused: one process, "
        f"{cores} threads. Batch {BATCH} per variant (stdlib corpus, packed rows), LoRA on c_attn and c_proj, "
        "ranks 4-16, lr and seed per variant. Tokens/s: real tokens of every variant after the warm-up steps over "
        "the wall time of those steps; memory: peak RSS, the separate processes' summed.",
        "",
        "Two fused layouts: one row (every variant's samples in one packed row, one forward and backward a step) and "
        "per variant (the fused model runs one forward and backward per variant, its samples alone, gradients "
        "accumulated: the activations of one variant at a time).",
        "",
        "| model | variants | separate tokens/s | fused, one row | fused, per variant | separate RSS MiB | "
        "fused, one row | fused, per variant |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape, k, sep, fus, per in rows:
        t, m = sep["tokens_per_s"], sep["rss_mb"]
        lines.append(
            f"| {shape} | {k} | {t:,.0f} | {fus['tokens_per_s']:,.0f} ({fus['tokens_per_s'] / t:.2f}x) | "
            f"{per['tokens_per_s']:,.0f} ({per['tokens_per_s'] / t:.2f}x) | {m:,.0f} | "
            f"{fus['rss_mb']:,.0f} ({fus['rss_mb'] / m:.2f}x) | {per['rss_mb']:,.0f} ({per['rss_mb'] / m:.2f}x) |"
        )
    write(Path(args.out), "\n".join(lines), {"rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
