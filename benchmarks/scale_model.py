"""The scale model's figures: what grows with the device count D, measured here where this machine can, the
rest as arithmetic (docs/design/scale.md, "At scale").

Measured (this machine, CPU):
  - one balanced plan of 8 samples per device, and the robust speed model's update for D devices, D = 8..512
  - the per-step all-gather of StepStats rows and the gradient all-reduce, gloo over loopback, 2 processes
Arithmetic: bytes per step of the LoRA vs full gradient all-reduce (gpt2-small, a 1B and a 7B model) and
ring all-reduce times at NVLink and InfiniBand bandwidths.

    python benchmarks/scale_model.py [--out benchmarks/results]      # ~1 minute
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from pathlib import Path

from provenance import check, header, write
from router_common import machine_info, median
from workloads import lognormal_lengths, sample_batches

from slurm_router.router import Router, RouterSettings
from slurm_router.worker.step_stats import StepStats

DEVICES = (8, 64, 512)
# Gradient sizes (parameters). gpt2-small: counted with peft (model=gpt2_small, LoRA r=8 on c_attn and c_proj,
# as conf/model/gpt2_small.yaml names them; attn.c_proj and mlp.c_proj both match). 1B and 7B: Llama-3.2-1B
# (hidden 2048, 16 layers, MLP 8192, 8 KV heads of 64) and Llama-2-7B (hidden 4096, 32 layers, MLP 11008),
# LoRA r=8 on q, k, v, o: r x (in + out) per adapted matrix.
MODELS = {
    "gpt2-small (124M)": {"full": 124_439_808, "lora_r8": 811_008},
    "1B (Llama-3.2-1B shape)": {"full": 1_235_814_400, "lora_r8": 16 * 8 * ((2048 + 2048) * 2 + (2048 + 512) * 2)},
    "7B (Llama-2-7B shape)": {"full": 6_738_415_616, "lora_r8": 32 * 8 * (4096 + 4096) * 4},
}
# Bus bandwidth an all-reduce gets per GPU (round, optimistic figures): 8 GPUs = one H100 node over NVLink 4
# (NCCL all-reduce bus bandwidth ~ 400 GB/s); 64 and 512 GPUs = 8 and 64 nodes, where the ring crosses
# InfiniBand NDR 400 Gb/s with one NIC per GPU (50 GB/s line rate).
BANDWIDTH = {8: 400e9, 64: 50e9, 512: 50e9}


def plan_times(reps: int = 5) -> list[dict]:
    pool = lognormal_lengths(50_000, seed=1234)
    rows = []
    for n_dev in DEVICES:
        n = 8 * n_dev
        router = Router(RouterSettings(), n_dev)
        rng = random.Random(0)
        plan_s, learn_s = [], []
        for lengths in sample_batches(pool, n, reps, seed=n_dev):
            t0 = time.perf_counter()
            a = router.plan(range(n), lengths)
            plan_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for d, c in enumerate(a.planned_cost()):  # every rank's router learns every device's row
                router.observe_step(d, c, c / 1e4 * math.exp(rng.gauss(0, 0.05)), None, a.per_device[d])
            router.speed_model.speeds()
            learn_s.append(time.perf_counter() - t0)
        rows.append(
            {
                "devices": n_dev,
                "samples": n,
                "plan_ms": 1e3 * median(plan_s),
                "learn_ms": 1e3 * median(learn_s),
                "stats_bytes_per_device": 8 * StepStats.width(),
                "gathered_bytes": 8 * StepStats.width() * n_dev,
            }
        )
    return rows


def _collectives(rank: int, world: int, port: int, sizes: list[int], q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    row = torch.zeros(StepStats.width(), dtype=torch.float64)
    out = [torch.zeros_like(row) for _ in range(world)]
    for _ in range(20):
        dist.all_gather(out, row)
    t = []
    for _ in range(200):
        t0 = time.perf_counter()
        dist.all_gather(out, row)
        t.append(time.perf_counter() - t0)
    res = {"gather_us": 1e6 * median(t)}
    for n in sizes:
        buf = torch.ones(n, dtype=torch.float32)
        dist.all_reduce(buf)
        t = []
        for _ in range(3 if n > 10_000_000 else 20):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            t.append(time.perf_counter() - t0)
        res[f"allreduce_{n}_ms"] = 1e3 * median(t)
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()


def collectives(world: int = 2) -> dict:
    import torch.multiprocessing as mp

    sizes = [MODELS["gpt2-small (124M)"]["lora_r8"], MODELS["gpt2-small (124M)"]["full"]]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29_500 + os.getpid() % 1000
    procs = [ctx.Process(target=_collectives, args=(r, world, port, sizes, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join()
    res["world"] = world
    res["sizes"] = sizes
    return res


def ring_ms(n_bytes: float, n_gpus: int, bandwidth: float) -> float:
    """Bandwidth term of a ring all-reduce: each GPU sends and receives 2 (N-1)/N of the buffer."""
    return 1e3 * 2 * (n_gpus - 1) / n_gpus * n_bytes / bandwidth


def _ms(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def to_markdown(res: dict) -> str:
    la0, la1 = res["load"], res.get("load_after", res["load"])
    lines = [
        "# Scale model figures",
        "",
        *res["header"],
        "",
        f"Load average (1/5/15 min) {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f} before, "
        f"{la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} after (other work on the machine slows the measured times).",
        "",
        "## Per step, on every rank (measured, pure Python)",
        "",
        "| D | samples (8/device) | balanced plan ms | speed model: D observations + update ms | "
        "StepStats gathered per rank |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in res["plan"]:
        lines.append(
            f"| {r['devices']} | {r['samples']} | {r['plan_ms']:.2f} | {r['learn_ms']:.2f} | "
            f"{r['gathered_bytes']:,} B ({r['stats_bytes_per_device']} B x D) |"
        )
    c = res["collectives"]
    lora, full = c["sizes"]
    lines += [
        "",
        f"## Collectives on this machine (gloo, loopback, {c['world']} processes)",
        "",
        f"- all-gather of one StepStats row: {c['gather_us']:.0f} us",
        f"- all-reduce of gpt2-small's LoRA r8 gradients ({4 * lora / 1e6:.2f} MB fp32): "
        f"{c[f'allreduce_{lora}_ms']:.1f} ms",
        f"- all-reduce of gpt2-small's full gradients ({4 * full / 1e6:.0f} MB fp32): "
        f"{c[f'allreduce_{full}_ms']:.0f} ms "
        f"({2 * (c['world'] - 1) / c['world'] * 4 * full / c[f'allreduce_{full}_ms'] / 1e6:.2f} GB/s bus)",
        "",
        "## Gradient all-reduce per step (arithmetic: fp32 gradients; ring bandwidth term 2 (N-1)/N x bytes / "
        "bus bandwidth, latency not included; 8 GPUs over NVLink at 400 GB/s, 64 and 512 over InfiniBand NDR "
        "at 50 GB/s per GPU)",
        "",
        "| model | gradients | MB per step | " + " | ".join(f"{g} GPUs ms" for g in DEVICES) + " |",
        "|---|---|---:|" + "---:|" * len(DEVICES),
    ]
    for name, sizes in MODELS.items():
        for kind, n in (("LoRA r8", sizes["lora_r8"]), ("full", sizes["full"])):
            b = 4 * n
            cells = " | ".join(_ms(ring_ms(b, g, BANDWIDTH[g])) for g in DEVICES)
            lines.append(f"| {name} | {kind} ({n / 1e6:,.4g}M) | {b / 1e6:,.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    check(Path(args.out) / "scale_model.md")
    command = "python benchmarks/scale_model.py"
    res = {
        "command": command,
        "header": header(command),
        "machine_info": machine_info(),
        "load": os.getloadavg(),
        "plan": plan_times(),
        "collectives": collectives(),
    }
    res["load_after"] = os.getloadavg()
    write(Path(args.out) / "scale_model.md", to_markdown(res), res)
    print(to_markdown(res))


if __name__ == "__main__":
    main()
