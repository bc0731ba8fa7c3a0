"""Throughput: the same model, data and batches through (a) a bare transformers + peft loop and (b) a
slurm_router job on one device, then (c) the job with its speed switches on; and co-located variants.

    python benchmarks/throughput.py                 # GPU if present (GPT-2-small shape), else CPU (small shape)
    python benchmarks/throughput.py --quick         # fewer steps (smoke)
    python benchmarks/throughput.py --repeats 5     # each configuration 5 times, interleaved (default 3)

Writes benchmarks/results/throughput-<device>.md and .json (and into --out DIR too). One clock on both sides:
tokens/s = real tokens of the steps after the warm-up / wall time from the end of the last warm-up step to
the end of the last step (the bare loop: perf_counter around those steps; the job: the wall-clock `time` of
its step rows, so data loading, routing, syncs and event writes between steps all count; no evaluation
falls inside the window). --profile adds one torch.profiler step of the bare loop and of the job (defaults):
their top operators by self device time go to throughput-<device>-profile.txt. MFU uses 4N FLOPs per
token for LoRA (forward 2N + backward through activations 2N; frozen weights get no weight gradient) over
the device's dense bf16 peak. The configurations run interleaved (a b c d, a b c d, ...) so that a noisy
machine slows them alike; the table gives the median over the repeats and the range beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from provenance import RESULTS, check, header, write  # noqa: E402

from slurm_router.worker.profile import PROFILE_OUT_ENV, PROFILE_STEP_ENV, top_operators  # noqa: E402


def shapes(device: str) -> dict:
    if device == "cuda":  # GPT-2 small, LoRA r16 on c_attn and c_proj (the reference loop)
        return dict(n_layer=12, n_head=12, n_embd=768, vocab=50257, batch=16, seq=512, steps=100, warmup=10)
    return dict(n_layer=4, n_head=4, n_embd=256, vocab=8192, batch=8, seq=256, steps=24, warmup=4)


def bare_loop(s: dict, device: str, compile_model: bool = False, profile_to: list | None = None) -> dict:
    """What users write by hand: model(..., labels=...), AdamW, bf16 autocast on GPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=s["vocab"],
        n_positions=max(1024, s["seq"]),
        n_embd=s["n_embd"],
        n_layer=s["n_layer"],
        n_head=s["n_head"],
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )
    model = get_peft_model(
        GPT2LMHeadModel(cfg),
        LoraConfig(r=16, lora_alpha=32, target_modules=["c_attn", "c_proj"], task_type="CAUSAL_LM"),
    ).to(device)
    if compile_model:
        model = torch.compile(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, min(256, s["vocab"]), (s["batch"], s["seq"]), generator=gen) for _ in range(4)]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def one_step(step: int) -> None:
        x = batches[step % 4].to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = None
    for step in range(s["warmup"] + s["steps"]):
        if step == s["warmup"]:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        one_step(step)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if profile_to is not None:  # after the timed window: it does not count
        profile_to.append("## a: bare loop, one step\n" + top_operators(lambda: one_step(0), torch.device(device))[1])
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "tokens_per_s": s["steps"] * s["batch"] * s["seq"] / dt,
        "n_params": n_params,
        "peak_mem_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
    }


def job(s: dict, tmp: Path, extra: list[str], profile_to: list | None = None) -> dict:
    """The real command, one device, the same shapes (fixed-length synthetic samples: no padding)."""
    steps = s["steps"] + s["warmup"] + (1 if profile_to is not None else 0)  # the profiled step comes last
    args = [
        sys.executable,
        "-m",
        "slurm_router",
        "base.enabled=false",
        "data=synthetic",
        "data.length_dist=fixed",
        f"data.mean_len={s['seq']}",
        f"data.max_len={s['seq']}",
        "data.n_samples=2048",
        "model.kind=gpt2",
        f"model.n_layer={s['n_layer']}",
        f"model.n_head={s['n_head']}",
        f"model.n_embd={s['n_embd']}",
        f"model.vocab_size={s['vocab']}",
        f"model.n_positions={max(1024, s['seq'])}",
        "model.lora.r=16",
        "model.lora.alpha=32",
        f"train.global_batch_size={s['batch']}",
        f"train.steps={steps}",
        "train.eval_batches=1",
        "train.eval_batch_size=2",
        "train.eval_every=0",
        "train.lr=1e-4",
        f"run_root={tmp}",
        "launcher.cpu_slots=1",
        *extra,
    ]
    from slurm_router.worker.cpu import THREADS_ENV

    env = {**os.environ, THREADS_ENV: str(os.cpu_count())}
    prof_file = tmp / f"profile-{time.time_ns()}.txt"
    if profile_to is not None:
        env.update({PROFILE_STEP_ENV: str(steps - 1), PROFILE_OUT_ENV: str(prof_file)})
    out = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    run_dir = Path(out.stdout.strip().splitlines()[-1].split("run_dir: ", 1)[1])
    rows = [json.loads(line) for line in (run_dir / "tasks" / "main" / "events-rank0.jsonl").read_text().splitlines()]
    steps_rows = sorted((r for r in rows if r["event"] == "step"), key=lambda r: r["step"])
    timed = [r for r in steps_rows if s["warmup"] <= r["step"] < s["warmup"] + s["steps"]]
    wall_s = timed[-1]["time"] - steps_rows[s["warmup"] - 1]["time"]
    if profile_to is not None:
        profile_to.append("## b: slurm_router job (defaults), one step (worker rank 0)\n" + prof_file.read_text())
    peaks = [r.get("mem_peak_bytes") for r in rows if r.get("mem_peak_bytes")]
    return {
        "tokens_per_s": sum(r["n_tokens"] for r in timed) / wall_s,
        "wall_s": wall_s,
        "peak_mem_bytes": max(peaks) if peaks else None,
        "micro_batches_per_step": statistics.median(sum(r["n_micro"]) for r in timed),
        "t_step_s_median": statistics.median(r["t_step_s"] for r in timed),
        "busy_s_median": statistics.median(r["busy_s"] for r in timed),
        "t_sync_wait_s_median": statistics.median(r["t_sync_wait_s"] for r in timed),
    }


def _median_row(runs: list[dict]) -> dict:
    speeds = [r["tokens_per_s"] for r in runs]
    peaks = [r["peak_mem_bytes"] for r in runs if r.get("peak_mem_bytes")]
    return {
        **runs[0],
        "tokens_per_s": statistics.median(speeds),
        "tokens_per_s_min": min(speeds),
        "tokens_per_s_max": max(speeds),
        "tokens_per_s_runs": speeds,
        "peak_mem_bytes": max(peaks) if peaks else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration, interleaved")
    ap.add_argument("--profile", action="store_true", help="also profile one step of the bare loop and the job")
    ap.add_argument("--out", type=Path, help="write the result files into this folder, not benchmarks/results/")
    ap.add_argument("--only", help="the configurations to run, by letter (e.g. a,b,c); default all")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = args.out or RESULTS
    check(folder / f"throughput-{device}.md")
    s = shapes(device)
    if args.quick:
        s.update(steps=8, warmup=2)
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    from slurm_router.analysis.metrics import device_peak

    peak = device_peak({"device_name": gpu})[1] if gpu else None  # FLOP/s, dense bf16
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"throughput-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    chunk = "train.loss_chunk_tokens=4096"
    configs = {
        "a: bare loop": lambda: bare_loop(s, device),
        "b: slurm_router job (defaults)": lambda: job(s, tmp, []),
        "c: job + chunked loss": lambda: job(s, tmp, [chunk]),
        "d: job + chunked loss + compile": lambda: job(
            s, tmp, [chunk, "train.compile=true", "train.pad_to_multiple=64"]
        ),
    }
    if device == "cuda":
        configs["e: bare loop + compile"] = lambda: bare_loop(s, device, compile_model=True)
    if args.only:
        configs = {k: v for k, v in configs.items() if k[0] in args.only.split(",") or k.startswith("a:")}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(max(1, args.repeats)):
        for name, run in configs.items():
            runs[name].append(run())
    profiles: list[str] = []
    if args.profile:
        bare_loop(dict(s, steps=1, warmup=2), device, profile_to=profiles)
        job(dict(s, steps=1, warmup=2), tmp, [], profile_to=profiles)
    rows = {name: _median_row(rs) for name, rs in runs.items()}
    base = rows["a: bare loop"]["tokens_per_s"]
    n_params = rows["a: bare loop"]["n_params"]
    command = "python benchmarks/throughput.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Throughput ({device}{': ' + gpu if gpu else ''})",
        "",
        *header(command.strip()),
        "",
        f"Model: GPT-2 shape n_layer={s['n_layer']} n_embd={s['n_embd']} vocab={s['vocab']} "
        f"({n_params / 1e6:.1f}M params), LoRA r16 on c_attn and c_proj, batch {s['batch']} x {s['seq']} "
        f"tokens, {s['steps']} timed steps after {s['warmup']} warm-up; {args.repeats} interleaved runs of "
        "each, median (min-max). Tokens/s: real tokens of the timed steps / wall time of those steps, the "
        "same clock for the bare loop and the job (see the script's docstring).",
        "",
        "| run | tokens/s | ratio to bare loop | MFU (4N/token) | peak memory GiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        mfu = f"{100 * r['tokens_per_s'] * 4 * n_params / peak:.1f}%" if peak else "n/a"
        mem = f"{r['peak_mem_bytes'] / 2**30:.1f}" if r.get("peak_mem_bytes") and device == "cuda" else "n/a"
        spread = f"{r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}"
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} ({spread}) | {r['tokens_per_s'] / base:.2f} | {mfu} | {mem} |"
        )
    data = {"device": device, "gpu": gpu, "shapes": s, "rows": rows}
    write(folder / f"throughput-{device}.md", "\n".join(lines), data)
    if profiles:
        (folder / f"throughput-{device}-profile.txt").write_text("\n\n".join(profiles) + "\n")
    print("\n".join(lines))
    print("\n\n".join(profiles))


if __name__ == "__main__":
    main()
