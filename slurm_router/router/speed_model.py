"""Per-device throughput (cost units per second) as an exponential moving average of observed steps."""
from __future__ import annotations


class SpeedModel:
    def __init__(self, n_devices: int, ema: float = 0.3) -> None:
        if not 0 < ema <= 1:
            raise ValueError(f"speed ema={ema} must be in (0, 1]")
        self.ema = ema
        self._speed: list[float | None] = [None] * n_devices   # None = never observed

    def observe(self, device: int, cost: float, compute_s: float) -> None:
        """One step of `device`: it computed `cost` units in `compute_s` seconds (forward+backward, no sync wait:
        waiting for the slowest device says nothing about this one's speed)."""
        if compute_s <= 0 or cost <= 0:
            return   # an idle device (no samples this step) or a clock glitch carries no information
        observed = cost / compute_s
        old = self._speed[device]
        self._speed[device] = observed if old is None else (1 - self.ema) * old + self.ema * observed

    def speeds(self) -> list[float]:
        """Unseen devices get the mean of the seen ones (no evidence they differ), or 1.0 before any step."""
        seen = [s for s in self._speed if s is not None]
        default = sum(seen) / len(seen) if seen else 1.0
        return [default if s is None else s for s in self._speed]

    def state_dict(self) -> dict:
        return {"ema": self.ema, "speed": list(self._speed)}

    def load_state_dict(self, d: dict) -> None:
        # A requeued job may come back with another device count: keep what overlaps, the rest is unseen.
        speed = [None if s is None else float(s) for s in d["speed"]]
        n = len(self._speed)
        self.ema = float(d.get("ema", self.ema))
        self._speed = (speed + [None] * n)[:n]
