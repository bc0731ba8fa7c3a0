"""Value types shared by the routing policies and the Router facade.

Everything here is immutable (frozen dataclasses, named tuples) so that an Assignment computed on one worker can be
compared bit-for-bit with the one computed on another: every worker runs the router on the same all-gathered
state and must reach the same decision without talking to the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from .speed_model import SPEED_MODELS

# router.policy's choices, in order: each is the function of that name in policies.py (POLICIES is built from this)
POLICY_NAMES = ("round_robin", "least_loaded", "affinity", "balanced")
COST_NAMES = ("tokens", "tokens_attention")  # router/packing.py sample_costs computes each
ROW_COST_NAMES = ("fitted", "fixed")  # packed rows: terms fit from step times (router/cost_model.py), or the config's
# RouterSettings' numeric ranges, (low, high, low_inclusive), high None = unbounded: the one range check of the
# router's settings (the config check asks RouterSettings, and reads its messages)
ROUTER_RANGES = {
    "attention_weight": (0, None, True),
    "attention_ref_len": (1, None, True),
    "memory_headroom": (0, None, False),  # a user's config: at most 1 (config/schema.py RANGES)
    "max_tokens_per_microbatch": (1, None, True),
    "speed_ema": (0, 1, False),
    "microbatch_overhead_tokens": (0, None, True),
}


def out_of_range(key: str, value: Any, low: float, high: float | None, low_inclusive: bool) -> str | None:
    """Why `key=value` is outside [low, high] (or (low, high]), in one line; None when it is inside. The message
    every range check of the config uses."""
    lo = f">= {low}" if low_inclusive else f"> {low}"
    hi = f" and <= {high}" if high is not None else ""
    if isinstance(value, float) and math.isnan(value):  # nan passes every comparison below
        return f"{key}=nan is not a number: it must be {lo}{hi}"
    too_low = value < low if low_inclusive else value <= low
    if too_low or (high is not None and value > high):
        return f"{key}={value!r} is out of range: it must be {lo}{hi}"
    return None


def not_a_choice(key: str, value: Any, allowed) -> str | None:
    """Why `key=value` is not one of `allowed`, in one line; None when it is."""
    return None if value in allowed else f"{key}={value!r} is not valid: choose one of {', '.join(allowed)}"


@dataclass(frozen=True, slots=True)
class DeviceState:
    """What the router knows about one device of the job (index = rank)."""

    index: int
    speed: float = 1.0  # cost units per second (relative is enough); higher = faster
    mem_budget_bytes: int | None = None  # headroom x total memory; None = unlimited
    mem_free_bytes: int | None = None  # last telemetry reading, used by least_loaded only


class MicroBatch(NamedTuple):
    """One forward/backward of one device. Several per device = gradient accumulation.
    A NamedTuple, not a frozen dataclass: a big plan builds hundreds, and a tuple is built 3x faster."""

    sample_ids: tuple[int, ...]  # global sample ids, in global-batch order
    n_tokens: int  # real tokens
    n_padded_tokens: int  # len(sample_ids) * longest sample: what the device computes
    cost: float  # sum of the samples' costs (cost model of RouterSettings); a packed row adds its fixed cost
    predicted_mem_bytes: int | None = None  # memory model prediction; None = no model

    @property
    def n_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def max_len(self) -> int:
        return self.n_padded_tokens // len(self.sample_ids) if self.sample_ids else 0


@dataclass(frozen=True, slots=True)
class Assignment:
    """The router's decision for one global batch."""

    per_device: tuple[tuple[MicroBatch, ...], ...]  # index = device index; may be empty for a device
    # Samples that do not fit any device's budget (or the token cap) even alone. They are still assigned,
    # alone in their own micro-batch, because dropping a sample would change the training math; the worker
    # should expect an OOM-and-halve cycle or a warning for them.
    oversize_ids: tuple[int, ...] = ()

    @property
    def n_devices(self) -> int:
        return len(self.per_device)

    def planned_cost(self) -> list[float]:
        return [sum(mb.cost for mb in mbs) for mbs in self.per_device]

    def n_tokens(self) -> list[int]:
        return [sum(mb.n_tokens for mb in mbs) for mbs in self.per_device]

    def n_padded_tokens(self) -> list[int]:
        return [sum(mb.n_padded_tokens for mb in mbs) for mbs in self.per_device]

    def sample_ids(self, device: int) -> tuple[int, ...]:
        """All ids computed by `device`, micro-batch by micro-batch."""
        return tuple(sid for mb in self.per_device[device] for sid in mb.sample_ids)

    def cost_balance_ratio(self) -> float:
        """max / mean planned cost over all devices (idle ones included); 1.0 when nothing is planned."""
        return _max_over_mean(self.planned_cost())

    def time_balance_ratio(self, speeds: list[float]) -> float:
        """max / mean of planned cost / speed: the figure that matters on heterogeneous devices."""
        return _max_over_mean([c / s for c, s in zip(self.planned_cost(), speeds)])


def _max_over_mean(values: list[float]) -> float:
    total = sum(values)
    if total <= 0:
        return 1.0
    return max(values) * len(values) / total


@dataclass
class RouterSettings:
    """Router knobs. Field names match config.schema.RouterConfig so `RouterSettings.from_config(cfg.router)` works."""

    policy: str = "balanced"  # round_robin | least_loaded | affinity | balanced
    cost: str = "tokens"  # tokens | tokens_attention
    # cost(n) = n + attention_weight * n^2 / attention_ref_len  (only with cost="tokens_attention").
    # Per token and layer a transformer spends ~24 h^2 FLOPs in its matmuls and ~4 n h in attention scores,
    # so attention_weight=1 with attention_ref_len = 6 * hidden_size makes the cost proportional to FLOPs.
    attention_weight: float = 0.0
    attention_ref_len: int = 4608  # 6 x 768 (GPT-2 small)
    memory_headroom: float = 0.85  # budget = headroom x total device memory
    max_tokens_per_microbatch: int | None = None  # hard cap on padded tokens of one micro-batch, every policy
    affinity_boundaries: tuple[int, ...] = ()  # length bucket edges for affinity; () = powers of two
    # robust: speeds move away from equal only for differences that persist beyond the measured noise;
    # ema: an EMA of each device's cost/s (weight speed_ema), follows noise too; none: all devices equal
    speed_model: str = "robust"
    speed_ema: float = 0.3  # weight of the newest observation in the speed EMA (speed_model=ema)
    # Fixed cost of one extra micro-batch, in padded-token equivalents (kernel launches, optimizer-free
    # forward/backward overhead). balanced/affinity/least_loaded start a new micro-batch only when the padding
    # it saves exceeds this. 0 = never pad (one micro-batch per distinct length).
    microbatch_overhead_tokens: int = 16
    # Packed micro-batches (train.packing, set by the worker): a device's samples go end to end into the fewest
    # rows that fit the memory budget and the token cap, no padding (router/packing.py pack_rows). A row costs its
    # samples' costs plus microbatch_overhead_tokens, and balanced/affinity charge that fixed cost once to every
    # device they give samples to.
    packed: bool = False
    # Packed mode: fitted = a row's per-token, attention (per len^2) and fixed terms are fit from the measured step
    # times (router/cost_model.py) and replace cost, attention_weight and microbatch_overhead_tokens once enough
    # steps are in; fixed = the configured values throughout.
    row_cost: str = "fitted"

    def __post_init__(self) -> None:
        """The one check of the router's settings: ValueError, one line naming router.KEY (config.checks turns it
        into the user's error)."""
        for key, allowed in (
            ("policy", POLICY_NAMES),
            ("cost", COST_NAMES),
            ("speed_model", SPEED_MODELS),
            ("row_cost", ROW_COST_NAMES),
        ):
            problem = not_a_choice(f"router.{key}", getattr(self, key), allowed)
            if problem:
                raise ValueError(problem)
        for key, limits in ROUTER_RANGES.items():
            value = getattr(self, key)
            problem = None if value is None else out_of_range(f"router.{key}", value, *limits)
            if problem:
                raise ValueError(problem)
        edges = tuple(int(e) for e in self.affinity_boundaries)
        if any(b <= a for a, b in zip(edges, edges[1:])) or any(e <= 0 for e in edges):
            raise ValueError(f"router.affinity_boundaries={list(edges)} must be positive and strictly increasing")
        self.affinity_boundaries = edges

    @classmethod
    def from_config(cls, cfg: Any) -> "RouterSettings":
        """Build from any object/mapping with matching attribute names; unknown extras are ignored."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        kwargs = {}
        for f in fields(cls):
            value = get(f.name, None)
            if value is not None:
                kwargs[f.name] = value
        if kwargs.get("affinity_boundaries") is not None:
            kwargs["affinity_boundaries"] = tuple(kwargs["affinity_boundaries"])
        return cls(**kwargs)
