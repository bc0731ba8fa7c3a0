"""Peers: the job beside what users would run instead, side by side in one run, counted the same way.

Same model (the default gpt2_tiny shape, byte tokenizer), the same samples (the job's own corpus code builds
them for every side), batch, LoRA rank and alpha, lr, steps and threads. Tokens/s on every side = real tokens
of the steps after WARMUP / wall time from the end of step WARMUP-1 to the end of the last step (the job: its
step rows' wall clock; the peers: a TrainerCallback's clock at each step end, real tokens counted by the
collator). Runs are interleaved (every configuration once, then again) so a noisy machine slows all alike;
each runs in a process of its own.

    python benchmarks/peers.py                        # stdlib corpus and a prompt/completion set, 3 repeats
    python benchmarks/peers.py --repeats 1 --steps 40 # quicker

Peers: HF Trainer + peft with the random sampler (the job's math: random global batches), with
`group_by_length` (batches of similar length: it changes which samples share a batch, the job must not),
with `batch_rebalance` where the installed transformers has it; TRL's SFTTrainer with `padding_free` where
trl is installed. Writes benchmarks/results/peers-<device>.md and .json.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jobrun import run_job  # noqa: E402
from provenance import RESULTS, header, write  # noqa: E402

WARMUP = 5
THREADS = 2
SHAPE = dict(n_layer=2, n_head=4, n_embd=128, vocab=257, n_positions=512)  # conf/model/gpt2_tiny.yaml
TRAIN = dict(batch=16, lr=5e-3, r=8, alpha=16)


# ---- the corpora ------------------------------------------------------------------------------------------
def prompt_completion_file(path: Path, limit: int = 4000) -> Path:
    """From the standard library's source: prompt = a function's signature line, completion = its docstring."""
    rows = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in f.parts or "test" in f.parts:
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)):
                args = ", ".join(a.arg for a in node.args.args)
                rows.append({"prompt": f'def {node.name}({args}):\n    """', "completion": doc + '"""\n'})
        if len(rows) >= limit:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:limit]), encoding="utf-8")
    return path


def data_overrides(corpus: str, pc_path: Path) -> list[str]:
    if corpus == "stdlib":
        return ["data=stdlib"]
    return ["data=jsonl", f"data.path={pc_path}", "data.prompt_field=prompt", "data.completion_field=completion"]


def window_rate(step_end_times: list[float], tokens: list[int]) -> float:
    """Real tokens of steps WARMUP.. over the wall time from the end of step WARMUP-1 to the last step's end."""
    return sum(tokens[WARMUP:]) / (step_end_times[-1] - step_end_times[WARMUP - 1])


# ---- the job (its real command) ---------------------------------------------------------------------------
def job(corpus: str, pc_path: Path, steps: int, packing: str, tmp: Path) -> dict:
    return run_job(
        [
            "base.enabled=false",
            *data_overrides(corpus, pc_path),
            f"train.steps={steps}",
            f"train.global_batch_size={TRAIN['batch']}",
            f"train.lr={TRAIN['lr']}",
            f"model.lora.r={TRAIN['r']}",
            f"model.lora.alpha={TRAIN['alpha']}",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.eval_batch_size=4",
            f"train.packing={packing}",
        ],
        tmp,
        WARMUP,
        THREADS,
    )


# ---- the peers (each in a process of its own: python peers.py --peer NAME ...) ---------------------------
def _samples(corpus: str, pc_path: Path):
    """The job's own training split (the same corpus code and settings), as (tokens, target mask) pairs."""
    from omegaconf import OmegaConf

    from slurm_router.config.schema import DataConfig
    from slurm_router.train.data import build_corpus
    from slurm_router.train.tokenizer import ByteTokenizer

    cfg = (
        DataConfig(kind="stdlib")
        if corpus == "stdlib"
        else DataConfig(kind="jsonl", path=str(pc_path), prompt_field="prompt", completion_field="completion")
    )
    tok = ByteTokenizer()
    split = build_corpus(OmegaConf.structured(cfg), tok).train
    return [(split.sample(i).tolist(), split.target_mask(i).tolist()) for i in range(len(split))], tok


def peer(name: str, corpus: str, pc_path: Path, steps: int) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    samples, tok = _samples(corpus, pc_path)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=SHAPE["vocab"],
            n_positions=SHAPE["n_positions"],
            n_embd=SHAPE["n_embd"],
            n_layer=SHAPE["n_layer"],
            n_head=SHAPE["n_head"],
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
        )
    )
    model = get_peft_model(
        model,
        LoraConfig(r=TRAIN["r"], lora_alpha=TRAIN["alpha"], target_modules=["c_attn", "c_proj"], task_type="CAUSAL_LM"),
    )
    rows = [
        {"input_ids": s, "labels": [t if m and j else -100 for j, (t, m) in enumerate(zip(s, mask))]}
        for s, mask in samples
    ]
    ends: list[float] = []
    tokens: list[int] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    def collate(batch):
        width = max(len(b["input_ids"]) for b in batch)
        tokens.append(sum(len(b["input_ids"]) for b in batch))
        ids = torch.full((len(batch), width), tok.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[r, :n], labels[r, :n], mask[r, :n] = torch.tensor(b["input_ids"]), torch.tensor(b["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=TRAIN["batch"],
        max_steps=steps,
        learning_rate=TRAIN["lr"],
        warmup_steps=5,
        weight_decay=0.0,
        max_grad_norm=1.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    if name == "trl padding_free":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from slurm_router.train.byte_tokenizer import to_transformers

        data = Dataset.from_list([{"input_ids": s, "completion_mask": [int(m) for m in mask]} for s, mask in samples])
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(padding_free=True, max_length=None, completion_only_loss=corpus != "stdlib", **common),
            train_dataset=data,
            processing_class=to_transformers(tok, SHAPE["n_positions"]),
            callbacks=[Clock()],
        )
        original = trainer.data_collator

        def counting(batch):
            tokens.append(sum(len(b["input_ids"]) for b in batch))
            return original(batch)

        trainer.data_collator = counting
        trainer.train()
    else:
        from transformers import Trainer, TrainingArguments

        strategy = {
            "hf random": "random",
            "hf group_by_length": "group_by_length",
            "hf batch_rebalance": "batch_rebalance",
        }[name]
        trainer = Trainer(
            model=model,
            args=TrainingArguments(train_sampling_strategy=strategy, **common),
            train_dataset=rows,
            data_collator=collate,
            callbacks=[Clock()],
        )
        trainer.train()
    # the loader may run one batch ahead of the steps: the first len(ends) batches are the steps'
    return {"tokens_per_s": window_rate(ends, tokens[: len(ends)]), "steps": len(ends)}


def run_peer(name: str, corpus: str, pc_path: Path, steps: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--peer",
            name,
            "--corpus",
            corpus,
            "--pc-path",
            str(pc_path),
            "--steps",
            str(steps),
        ],
        capture_output=True,
        text=True,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def available_peers() -> list[str]:
    from transformers import TrainingArguments

    names = ["hf random", "hf group_by_length"]
    if "batch_rebalance" in (TrainingArguments.__doc__ or ""):
        names.append("hf batch_rebalance")
    if importlib.util.find_spec("trl") is not None:
        names.append("trl padding_free")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--corpora", default="stdlib,prompt_completion")
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--pc-path", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        print(json.dumps(peer(args.peer, args.corpus, args.pc_path, args.steps)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="peers-"))
    pc_path = prompt_completion_file(tmp / "prompt_completion.jsonl")
    configs = {
        "job, packed (train.packing=true)": lambda c: job(c, pc_path, args.steps, "true", tmp),
        "job, padded micro-batches (train.packing=false)": lambda c: job(c, pc_path, args.steps, "false", tmp),
    }
    for name in available_peers():
        configs[name] = lambda c, n=name: run_peer(n, c, pc_path, args.steps)
    corpora = args.corpora.split(",")
    runs = {(c, n): [] for c in corpora for n in configs}
    for _ in range(args.repeats):
        for c in corpora:
            for name, fn in configs.items():
                runs[(c, name)].append(fn(c))
                print(c, name, runs[(c, name)][-1], flush=True)
    command = f"python benchmarks/peers.py --repeats {args.repeats} --steps {args.steps} --corpora {args.corpora}"
    lines = [
        "# The job beside its peers (CPU)",
        "",
        *header(command),
        "",
        f"GPT-2 shape n_layer={SHAPE['n_layer']} n_embd={SHAPE['n_embd']} (byte vocabulary), LoRA r{TRAIN['r']} "
        f"alpha {TRAIN['alpha']} on c_attn and c_proj, batch {TRAIN['batch']}, lr {TRAIN['lr']}, {args.steps} "
        f"steps ({WARMUP} warm-up left out), {THREADS} torch threads on every side; {args.repeats} interleaved "
        "runs, median (min-max). Tokens/s: real tokens / wall time of the same steps on every side. "
        "prompt_completion: signatures -> docstrings of the standard library, loss on the completions only.",
        "",
    ]
    table = {}
    for c in corpora:
        ok = {n: [r["tokens_per_s"] for r in runs[(c, n)] if "tokens_per_s" in r] for n in configs}
        base = statistics.median(ok["job, packed (train.packing=true)"])
        lines += [f"## {c}", "", "| run | tokens/s | packed job / this |", "|---|---:|---:|"]
        for n in configs:
            if not ok[n]:
                lines.append(f"| {n} | did not run: {runs[(c, n)][0].get('error')} | |")
                continue
            med = statistics.median(ok[n])
            lines.append(f"| {n} | {med:,.0f} ({min(ok[n]):,.0f}-{max(ok[n]):,.0f}) | {base / med:.2f}x |")
            table[f"{c}/{n}"] = {"tokens_per_s": med, "runs": ok[n], "packed_job_ratio": base / med}
        extra = runs[(c, "job, packed (train.packing=true)")][0]
        lines += [
            "",
            f"Packed job: {extra['micro_batches_per_step']:.0f} micro-batch(es) per step, useful tokens "
            f"{100 * extra['useful_fraction']:.1f}%; padded job: "
            f"{runs[(c, 'job, padded micro-batches (train.packing=false)')][0]['micro_batches_per_step']:.0f} "
            f"micro-batches per step, useful "
            f"{100 * runs[(c, 'job, padded micro-batches (train.packing=false)')][0]['useful_fraction']:.1f}%.",
            "",
        ]
    lines.append(
        f"Load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} CPUs."
    )
    write(
        RESULTS / "peers-cpu.md",
        "\n".join(lines),
        {"rows": table, "raw": {f"{c}/{n}": v for (c, n), v in runs.items()}},
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
