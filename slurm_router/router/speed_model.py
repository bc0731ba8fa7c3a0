"""Per-device throughput (cost units per second) learned from each step's observed compute time.

Three models, picked by `router.speed_model` (docs/design/router.md, "The router"):
  robust  (default) moves away from equal speeds only for differences that persist beyond the measured noise
  ema     an exponential moving average of cost/s per device (weight `router.speed_ema`): follows every step,
          noise included, so identical devices on a noisy machine get unequal shares
  none    every device equally fast: a speed-blind cost partition (the baseline for identical devices)

Every rank feeds its model the same all-gathered observations in the same order, and each model is plain
float arithmetic on them, so every rank reaches the same speeds (the router's determinism, router.py).
"""

from __future__ import annotations

import math
from collections import deque
from typing import cast

_MAD_TO_SD = 1.4826  # standard deviation of a normal = 1.4826 x its median absolute deviation
_MEDIAN_VAR = math.pi / 2  # variance of a median of n normal draws ~ (pi/2) sigma^2 / n


class SpeedModel:
    """`ema`: per device, an exponential moving average of the observed cost/s."""

    kind = "ema"

    def __init__(self, n_devices: int, ema: float = 0.3) -> None:
        if not 0 < ema <= 1:
            raise ValueError(f"speed ema={ema} must be in (0, 1]")
        self.ema = ema
        self._speed: list[float | None] = [None] * n_devices  # None = never observed

    def observe(self, device: int, cost: float, compute_s: float) -> None:
        """One step of `device`: it computed `cost` units in `compute_s` seconds (forward+backward, no sync wait:
        waiting for the slowest device says nothing about this one's speed)."""
        if compute_s <= 0 or cost <= 0:
            return  # an idle device (no samples this step) or a clock glitch carries no information
        observed = cost / compute_s
        old = self._speed[device]
        self._speed[device] = observed if old is None else (1 - self.ema) * old + self.ema * observed

    def speeds(self) -> list[float]:
        """Unseen devices get the mean of the seen ones (no evidence they differ), or 1.0 before any step."""
        seen = [s for s in self._speed if s is not None]
        default = sum(seen) / len(seen) if seen else 1.0
        return [default if s is None else s for s in self._speed]

    def state_dict(self) -> dict:
        return {"kind": self.kind, "ema": self.ema, "speed": list(self._speed)}

    def load_state_dict(self, d: dict) -> None:
        if d.get("kind", "ema") != self.kind:
            return  # another model's state (router.speed_model changed on resume): relearn in a few steps
        # A requeued job may come back with another device count: keep what overlaps, the rest is unseen.
        speed = [None if s is None else float(s) for s in d["speed"]]
        n = len(self._speed)
        self.ema = float(d.get("ema", self.ema))
        self._speed = (speed + [None] * n)[:n]


class EqualSpeedModel:
    """`none`: no learning; every device 1.0, so balanced is a pure cost partition."""

    kind = "none"

    def __init__(self, n_devices: int) -> None:
        self.n_devices = n_devices

    def observe(self, device: int, cost: float, compute_s: float) -> None:
        pass

    def speeds(self) -> list[float]:
        return [1.0] * self.n_devices

    def state_dict(self) -> dict:
        return {"kind": self.kind}

    def load_state_dict(self, d: dict) -> None:
        pass


class RobustSpeedModel:
    """`robust`: each device's speed relative to the others, kept only where it stands out of the noise.

    Per step (a round: every device's observation, in device order), each device's log speed minus the mean
    log speed of the devices that computed that step: load that slows every worker alike cancels. Then:
      level     per device, the median of its last `window` relative log speeds: an outlier step moves it
                not at all, a lasting change after window/2 steps
      center    the median of the devices' levels: the typical device (with one slow device among many, the
                bulk of equal ones, not a mean that the slow one drags down)
      noise     sigma^2 of one step's relative log speed, pooled over devices from the residuals about each
                device's level (robust: 1.4826 x their median absolute value), blended with a prior of
                `prior_noise` worth `prior_weight` residuals that fades as steps accumulate, so the first
                steps do not trust a tiny sample. A level's own variance is v = (pi/2) sigma^2 / n (a median
                of n steps)
      shrinkage each device's offset from the center times max(0, 1 - z^2 v / offset^2): an empirical-Bayes
                (positive-part James-Stein) weight per device, 0 while the offset is within z of its noise,
                -> 1 when it stands far out. Per device, not pooled, so one slow device among 512 stands out
                as well as among 2; z = sqrt(2 ln D), at least 1 (the universal threshold): the largest of D
                identical devices' noise stays under it, so a big fleet does not single out its luckiest one
    speed = exp(pool level + center + shrunk offset), the pool level being the median of the steps' mean log
    speed, so speeds stay in cost/s. Identical devices: every offset within noise, equal speeds. A real 2x
    device: its offset of log 2 stands out within a few steps and its weight goes to ~1.
    """

    kind = "robust"

    def __init__(
        self,
        n_devices: int,
        window: int = 8,
        prior_noise: float = 0.25,
        prior_weight: float = 2.0,
        min_z: float | None = None,
    ) -> None:
        if window < 2:
            raise ValueError(f"speed window={window} must be >= 2")
        self.n_devices, self.window = n_devices, window
        self.prior_noise, self.prior_weight = prior_noise, prior_weight
        self.min_z = min_z if min_z is not None else max(1.0, math.sqrt(2 * math.log(max(n_devices, 1))))
        self._n_seen = 0  # relative observations ever (the prior fades with them, not the window)
        self._rel: list[deque[float]] = [deque(maxlen=window) for _ in range(n_devices)]
        self._level: deque[float] = deque(maxlen=window)  # the steps' mean log speed
        self._pending: dict[int, float | None] = {}  # this round so far: device -> log speed (None: idle)
        self._cached: list[float] | None = None

    def observe(self, device: int, cost: float, compute_s: float) -> None:
        if device in self._pending:  # a device reports again: the previous step's round is complete
            self._close_round()
        ok = compute_s > 0 and cost > 0  # an idle device or a clock glitch carries no information
        self._pending[device] = math.log(cost / compute_s) if ok else None
        if len(self._pending) == self.n_devices:
            self._close_round()
        self._cached = None

    def _close_round(self) -> None:
        present = {d: y for d, y in self._pending.items() if y is not None}
        self._pending = {}
        if not present:
            return
        mean_y = math.fsum(present.values()) / len(present)
        self._level.append(mean_y)
        if len(present) >= 2:  # one device alone says nothing about how it compares
            for d in sorted(present):
                self._rel[d].append(present[d] - mean_y)
            self._n_seen += len(present)

    def speeds(self) -> list[float]:
        if self._cached is None:
            if self._pending:  # a round still open (the caller plans mid-round): count it as closed
                saved = (
                    self._pending,
                    [deque(r, self.window) for r in self._rel],
                    deque(self._level, self.window),
                    self._n_seen,
                )
                self._close_round()
                self._cached = self._estimate()
                self._pending, self._rel, self._level, self._n_seen = saved
            else:
                self._cached = self._estimate()
        return list(self._cached)

    def relative(self) -> tuple[float, list[tuple[float, float, float]]]:
        """(center, per device (offset from the center, its variance v, shrinkage weight)): what the speeds are
        made of. An unseen device: offset 0, v infinite, weight 0."""
        levels = [_median(r) if r else None for r in self._rel]
        seen = [m for m in levels if m is not None]
        center = _median(seen)
        sigma2 = self._noise(levels)
        out = []
        for r, m in zip(self._rel, levels):
            if m is None:
                out.append((0.0, math.inf, 0.0))
                continue
            off, v = m - center, _MEDIAN_VAR * sigma2 / len(r)
            out.append((off, v, max(0.0, 1.0 - self.min_z**2 * v / (off * off)) if off else 0.0))
        return center, out

    def _noise(self, levels: list[float | None]) -> float:
        residuals: list[float] = []
        for r, m in zip(self._rel, levels):
            if len(r) >= 2:  # the smallest residual is the one degree of freedom the median took
                residuals += sorted(abs(x - cast(float, m)) for x in r)[1:]
        data = (_MAD_TO_SD * _median(residuals)) ** 2 if residuals else 0.0
        n = max(0, self._n_seen - sum(1 for r in self._rel if r))  # less one per device, for its level
        return (self.prior_weight * self.prior_noise**2 + n * data) / (self.prior_weight + n)

    def _estimate(self) -> list[float]:
        base = _median(self._level) if self._level else 0.0
        center, per_device = self.relative()
        return [math.exp(base + center + w * off) for off, _, w in per_device]

    def state_dict(self) -> dict:
        return {
            "kind": self.kind,
            "window": self.window,
            "rel": [list(r) for r in self._rel],
            "level": list(self._level),
            "n_seen": self._n_seen,
            "pending": {str(d): y for d, y in self._pending.items()},
        }

    def load_state_dict(self, d: dict) -> None:
        if d.get("kind") != self.kind:
            return  # another model's state (router.speed_model changed on resume): relearn in a few steps
        # A requeued job may come back with another device count: keep what overlaps, the rest is unseen.
        rel = [deque((float(x) for x in r), self.window) for r in d["rel"]][: self.n_devices]
        self._rel = rel + [deque(maxlen=self.window) for _ in range(self.n_devices - len(rel))]
        self._level = deque((float(x) for x in d["level"]), self.window)
        self._n_seen = int(d.get("n_seen", 0))
        self._pending = {
            int(k): (None if y is None else float(y))
            for k, y in d.get("pending", {}).items()
            if int(k) < self.n_devices
        }
        self._cached = None


# router.speed_model's choices, by name: (n_devices, ema weight) -> a model. The one list of them (config reads it).
SPEED_MODELS = {
    "robust": lambda n_devices, ema: RobustSpeedModel(n_devices),
    "ema": lambda n_devices, ema: SpeedModel(n_devices, ema),
    "none": lambda n_devices, ema: EqualSpeedModel(n_devices),
}


def make_speed_model(kind: str, n_devices: int, ema: float = 0.3):
    if kind not in SPEED_MODELS:
        raise ValueError(f"router.speed_model={kind!r} is not valid: choose one of {', '.join(SPEED_MODELS)}")
    return SPEED_MODELS[kind](n_devices, ema)


def _median(xs) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return 0.0
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
