"""Packed rows: the row cost fit from step times (RouterSettings.row_cost="fitted") against the configured one.

Simulated (no processes, no GPU, seeded): a device's true time for a step is the sum over its packed rows of
    per_token_s * tokens + per_len2_s * sum_i len_i^2 + fixed_s
over its speed, times lognormal noise (sigma). Both routers plan the same global batches (train.packing on,
policy balanced, robust speed model) and learn speeds from the same noisy times; the fitted one also fits the
row's three terms (slurm_router/router/cost_model.py). Figures per fleet and noise:
  terms      the fitted attention (per len^2) and fixed (per row) terms, in tokens, against the true ones
  balance    slowest / fastest busy device per step, from the noise-free true times: what the plan achieves
  step time  mean true step time (the slowest device) of fitted over fixed: below 1 = the fitted cost is faster
Steps after WARMUP_STEPS count; the mean over SEEDS seeds.

    python benchmarks/router_packed.py            (run_router_benchmarks.py writes router_packed.md)
"""

from __future__ import annotations

import math
import random

from router_common import mean
from workloads import lognormal_lengths, sample_batches, stdlib_lengths

from slurm_router.router import Router, RouterSettings

# The true row: ~31k tokens/s (benchmarks/packed_rows.py's gpt2_tiny on 2 CPU threads, as last measured), a micro-batch's fixed cost
# worth 400 tokens (the probe: far above the default microbatch_overhead_tokens=16), and attention adding
# len/2048 per token (assumed: +25% at 512 tokens).
PER_TOKEN_S = 32e-6
TRUE_PER_LEN2_TOKENS = 1 / 2048
TRUE_FIXED_TOKENS = 400.0
FLEETS = (  # name, speeds, global batch, token cap (router.max_tokens_per_microbatch), lengths
    ("1 : 0.5", (1.0, 0.5), 16, None, "stdlib"),
    ("1 : 0.5", (1.0, 0.5), 16, None, "long-tailed"),
    ("1 : 0.25", (1.0, 0.25), 8, None, "long-tailed"),
    ("1 : 1 : 0.5 : 0.25", (1.0, 1.0, 0.5, 0.25), 32, None, "long-tailed"),
    ("1 : 0.5, token cap 512", (1.0, 0.5), 32, 512, "long-tailed"),
    ("1 : 1", (1.0, 1.0), 16, None, "long-tailed"),
)
CONVERGENCE_FLEET = 1  # FLEETS[1]'s convergence at every noise; the others' noise-free
NOISES = (0.0, 0.02, 0.1)  # sigma of log step time: ~GPU-steady, and a busy shared CPU (router_noise.md)
N_STEPS = 80
WARMUP_STEPS = 20
SEEDS = (0, 1, 2)
CONVERGENCE_STEPS = (4, 8, 12, 16, 24, 32, 48, 80)


def _pools() -> dict[str, tuple[int, ...]]:
    return {
        "stdlib": stdlib_lengths(),  # the default job's corpus: 512-byte pieces, most of them full
        "long-tailed": tuple(lognormal_lengths(20_000, mean_len=96, sigma=1.0, min_len=8, max_len=1024, seed=7)),
    }


def true_seconds(rows, lengths_by_id: dict[int, int], speed: float) -> float:
    """A device's noise-free time for its rows."""
    total = 0.0
    for mb in rows:
        len2 = sum(lengths_by_id[i] ** 2 for i in mb.sample_ids)
        total += PER_TOKEN_S * (mb.n_tokens + TRUE_PER_LEN2_TOKENS * len2 + TRUE_FIXED_TOKENS)
    return total / speed


def simulate(row_cost: str, speeds, batches, cap, noise: float, seed: int) -> list[dict]:
    """One router over the batches; per step its plan's true times, micro-batches and fitted terms."""
    rng = random.Random(seed)
    router = Router(RouterSettings(packed=True, row_cost=row_cost, max_tokens_per_microbatch=cap), len(speeds))
    out = []
    for lengths in batches:
        ids = list(range(len(lengths)))
        a = router.plan(ids, lengths)
        by_id = dict(zip(ids, lengths))
        true = [true_seconds(rows, by_id, s) if rows else 0.0 for rows, s in zip(a.per_device, speeds)]
        for d, rows in enumerate(a.per_device):
            measured = true[d] * math.exp(rng.gauss(0.0, noise)) if rows else 0.0
            router.observe_step(d, sum(mb.cost for mb in rows), measured, None, rows)
        busy = [t for t in true if t > 0]
        used = router.planning_settings()
        out.append(
            {
                "step_s": max(true),
                "balance": max(busy) / min(busy),
                "microbatches": sum(len(rows) for rows in a.per_device),
                "terms": router.cost_model.token_terms() if router.cost_model is not None else None,
                "used": [used.attention_weight / used.attention_ref_len, used.microbatch_overhead_tokens],
            }
        )
    return out


def run(n_steps: int = N_STEPS, seeds=SEEDS) -> dict:
    pools = _pools()
    rows = []
    for i, (name, speeds, batch, cap, pool) in enumerate(FLEETS):
        for noise in NOISES:
            per: dict[str, list[list[dict]]] = {"fixed": [], "fitted": []}
            for seed in seeds:
                batches = sample_batches(pools[pool], batch, n_steps, seed=1000 + seed)
                for mode in per:
                    per[mode].append(simulate(mode, speeds, batches, cap, noise, seed))
            row: dict = {"fleet": name, "lengths": pool, "speeds": list(speeds), "batch": batch, "noise": noise}
            for mode, runs in per.items():
                kept = [s for r in runs for s in r[WARMUP_STEPS:]]
                row[mode] = {
                    "balance": mean([s["balance"] for s in kept]),
                    "step_s": mean([s["step_s"] for s in kept]),
                    "microbatches": mean([s["microbatches"] for s in kept]),
                }
            finals = [r[-1]["terms"] for r in per["fitted"] if r[-1]["terms"] is not None]
            row["fitted"]["terms"] = [mean([t[0] for t in finals]), mean([t[1] for t in finals])] if finals else None
            row["fitted"]["used"] = [mean([r[-1]["used"][j] for r in per["fitted"]]) for j in (0, 1)]
            row["step_time_fitted_over_fixed"] = row["fitted"]["step_s"] / row["fixed"]["step_s"]
            if noise == 0.0 or i == CONVERGENCE_FLEET:
                row["convergence"] = _errors(per["fitted"], n_steps)
            rows.append(row)
    return {
        "true": {
            "per_token_s": PER_TOKEN_S,
            "per_len2_tokens": TRUE_PER_LEN2_TOKENS,
            "fixed_tokens": TRUE_FIXED_TOKENS,
        },
        "steps": n_steps,
        "warmup_steps": WARMUP_STEPS,
        "seeds": list(seeds),
        "rows": rows,
    }


def _errors(runs: list[list[dict]], n_steps: int) -> dict[str, list[float] | None]:
    """Per convergence step: the worst relative error over seeds of the fitted (attention, fixed) terms (raw,
    before the shrinkage toward the configured values); None while some seed has no fit."""
    out: dict[str, list[float] | None] = {}
    for k in CONVERGENCE_STEPS:
        if k > n_steps:
            continue
        terms = [r[k - 1]["terms"] for r in runs]
        if any(t is None for t in terms):
            out[str(k)] = None
            continue
        out[str(k)] = [
            max(abs(t[0] / TRUE_PER_LEN2_TOKENS - 1) for t in terms),
            max(abs(t[1] / TRUE_FIXED_TOKENS - 1) for t in terms),
        ]
    return out


def targets(res: dict) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for the packed cost model."""
    out = []
    k = "16"
    noise_free = [r for r in res["rows"] if r["noise"] == 0.0]
    worst = max(max(r["convergence"][k] or [math.inf]) for r in noise_free)
    out.append(
        (
            f"noise-free: the fitted attention and fixed terms within 1% of the true ones by step {k}, every fleet",
            f"{100 * worst:.2f}% worst",
            worst <= 0.01,
        )
    )
    ratio = max(r["step_time_fitted_over_fixed"] for r in res["rows"])
    out.append(
        (
            "fitted never slower than fixed: step time fitted / fixed <= 1.005, every fleet and noise",
            f"{ratio:.3f} worst, {min(r['step_time_fitted_over_fixed'] for r in res['rows']):.3f} best",
            ratio <= 1.005,
        )
    )
    hetero = [r for r in res["rows"] if r["lengths"] == "long-tailed" and min(r["speeds"]) < max(r["speeds"])]
    hetero = [r for r in hetero if r["fleet"] in ("1 : 0.5", "1 : 1 : 0.5 : 0.25")]
    worse = [r for r in hetero if r["fitted"]["balance"] >= r["fixed"]["balance"]]
    out.append(
        (
            "heterogeneous fleets, long-tailed lengths, one row each: fitted balance better than fixed, every noise",
            ", ".join(
                f"{r['fleet']} at {r['noise']:.2f}: {r['fixed']['balance']:.3f} -> {r['fitted']['balance']:.3f}"
                for r in hetero
            ),
            not worse,
        )
    )
    return out


def to_markdown(res: dict) -> str:
    t = res["true"]
    lines = [
        f"## Packed rows: the fitted row cost against the fixed default ({res['steps']} steps, figures from step "
        f"{res['warmup_steps'] + 1}, mean of {len(res['seeds'])} seeds)",
        "",
        f"True row: {t['per_token_s'] * 1e6:.0f} us a token, attention {t['per_len2_tokens']:.3g} tokens per len^2 "
        f"(len/2048 a token), fixed {t['fixed_tokens']:.0f} tokens a row. "
        'fixed = `RouterSettings(row_cost="fixed")` (the configured cost=tokens, microbatch_overhead_tokens=16); '
        "fitted = the default. Balance = slowest / fastest "
        "busy device, noise-free true times; step time = the slowest device's. Fitted terms: the last step's fit "
        "(mean of seeds) and, after the arrow, what the router planned with (each term shrunk toward its "
        "configured value by its standard error).",
        "",
        "| speeds | lengths | batch | noise | fitted attention / fixed (tokens) | balance fixed -> fitted | "
        "micro-batches fixed / fitted | step time fitted / fixed |",
        "|---|---|---:|---:|---|---|---|---:|",
    ]
    for r in res["rows"]:
        terms, used = r["fitted"]["terms"], r["fitted"]["used"]
        shown = "no fit" if terms is None else f"{terms[0]:.3g} / {terms[1]:.0f}"
        shown += f" -> {used[0]:.3g} / {used[1]:.0f}"
        lines.append(
            f"| {r['fleet']} | {r['lengths']} | {r['batch']} | {r['noise']:.2f} | {shown} | "
            f"{r['fixed']['balance']:.3f} -> {r['fitted']['balance']:.3f} | "
            f"{r['fixed']['microbatches']:.2f} / {r['fitted']['microbatches']:.2f} | "
            f"{r['step_time_fitted_over_fixed']:.3f} |"
        )
    steps = [k for k in CONVERGENCE_STEPS if k <= res["steps"]]
    lines += [
        "",
        "### Convergence: the fitted attention / fixed terms' relative error by step (the worst of the seeds)",
        "",
        "| speeds | lengths | noise | " + " | ".join(f"step {k}" for k in steps) + " |",
        "|---|---|---:|" + "---|" * len(steps),
    ]
    for r in res["rows"]:
        if "convergence" not in r:
            continue
        conv = r["convergence"]
        cells = [
            "no fit" if conv[str(k)] is None else f"{100 * conv[str(k)][0]:.1f}% / {100 * conv[str(k)][1]:.1f}%"
            for k in steps
        ]
        lines.append(f"| {r['fleet']} | {r['lengths']} | {r['noise']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(to_markdown(run()))
