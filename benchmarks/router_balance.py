"""Balance benchmark: balance ratio and useful-token fraction per policy over a grid of devices x batch sizes.

python benchmarks/router_balance.py        # prints the table; run_router_benchmarks.py collects it
"""

from __future__ import annotations

from router_common import (
    POLICIES,
    fleet,
    gpt2_small_memory,
    mean,
    microbatches_per_device,
    pools,
    sample_batches,
    useful_fraction,
)

from slurm_router.router import Router, RouterSettings
from slurm_router.router.partition import lower_bound

DEVICES = (2, 4, 8, 16, 64)
BATCHES = (8, 32, 128, 512, 1024)  # global batch sizes (samples per step)
N_BATCHES = 50
OVERHEADS = (0, 16, 64, 256, None)  # balanced's microbatch_overhead_tokens sweep (None = one micro-batch)


def _cells() -> list[tuple[int, int]]:
    cells = set()
    for d in DEVICES:
        cells.add((d, 8 * d))  # the target cell: 8 samples per device
        cells.update((d, n) for n in BATCHES if n >= d)
    return sorted(cells)


def run(n_batches: int = N_BATCHES) -> dict:
    rows = []
    for pool_name, pool in pools().items():
        for n_dev, n in _cells():
            batches = sample_batches(pool, n, n_batches, seed=1000 * n_dev + n)
            ids = list(range(n))
            devices = fleet([1.0] * n_dev)
            row = {
                "lengths": pool_name,
                "devices": n_dev,
                "batch": n,
                "per_device": n / n_dev,
                "best_possible_ratio": mean([lower_bound(b, n_dev) * n_dev / sum(b) for b in batches]),
            }
            for policy in POLICIES:
                router = Router(RouterSettings(policy=policy), n_dev, gpt2_small_memory())
                plans = [router.plan(ids, b, devices) for b in batches]
                row[policy] = {
                    "ratio": mean([a.cost_balance_ratio() for a in plans]),
                    "ratio_max": max(a.cost_balance_ratio() for a in plans),
                    "useful": mean([useful_fraction(a) for a in plans]),
                    "mb_per_device": mean([microbatches_per_device(a) for a in plans]),
                }
            rows.append(row)
    return {"rows": rows, "overhead_sweep": overhead_sweep(n_batches)}


def overhead_sweep(n_batches: int) -> list[dict]:
    """The padding / micro-batch-count trade-off of balanced (8 and 32 samples per device, 8 devices)."""
    out = []
    for pool_name, pool in pools().items():
        for per_device in (8, 32):
            n = 8 * per_device
            batches = sample_batches(pool, n, n_batches, seed=per_device)
            for ov in OVERHEADS:
                settings = RouterSettings(microbatch_overhead_tokens=ov if ov is not None else 1 << 30)
                plans = [Router(settings, 8).plan(range(n), b) for b in batches]
                out.append(
                    {
                        "lengths": pool_name,
                        "per_device": per_device,
                        "overhead_tokens": "inf" if ov is None else ov,
                        "useful": mean([useful_fraction(a) for a in plans]),
                        "mb_per_device": mean([microbatches_per_device(a) for a in plans]),
                        "ratio": mean([a.cost_balance_ratio() for a in plans]),
                    }
                )
    return out


def to_markdown(res: dict) -> str:
    lines = [
        "## Balance (equal devices; mean over %d random global batches per cell)" % N_BATCHES,
        "",
        "ratio = max/mean planned cost (1.00 = perfect); best = the same ratio for the pigeonhole lower "
        "bound of any partition (what no policy can beat); useful = real tokens / (D x max device padded "
        "tokens); mb = micro-batches per device.",
        "",
    ]
    for pool_name in dict.fromkeys(r["lengths"] for r in res["rows"]):
        lines += [
            f"### {pool_name}",
            "",
            "| D | batch | per dev | best | " + " | ".join(f"{p} ratio / useful / mb" for p in POLICIES) + " |",
            "|---:|---:|---:|---:|" + "---|" * len(POLICIES),
        ]
        for r in res["rows"]:
            if r["lengths"] != pool_name:
                continue
            cells = " | ".join(
                f"{r[p]['ratio']:.3f} / {r[p]['useful']:.3f} / {r[p]['mb_per_device']:.1f}" for p in POLICIES
            )
            mark = " **" if r["per_device"] == 8 else ""
            lines.append(
                f"| {r['devices']} | {r['batch']} | {r['per_device']:.4g}{mark} | "
                f"{r['best_possible_ratio']:.3f} | {cells} |"
            )
        lines.append("")
    lines += [
        "### balanced: padding vs micro-batch count (8 devices, `microbatch_overhead_tokens`)",
        "",
        "| lengths | per dev | overhead tokens | useful | mb/device | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["overhead_sweep"]:
        lines.append(
            f"| {r['lengths']} | {r['per_device']} | {r['overhead_tokens']} | {r['useful']:.3f} | "
            f"{r['mb_per_device']:.1f} | {r['ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(to_markdown(run()))
