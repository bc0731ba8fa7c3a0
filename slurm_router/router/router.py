"""The stateful facade the workers use: policies + speed model + memory model + per-device memory readings.

Every worker holds its own Router and feeds it the same all-gathered observations in the same order (every
device's step report, by device index), so all routers stay identical and plan identical assignments
without a coordinator. Nothing here reads a device: telemetry arrives through set_device_memory/observe_*.

    >>> r = Router(RouterSettings(policy="balanced"), n_devices=2)
    >>> a = r.plan([10, 11, 12, 13], [400, 30, 200, 170])
    >>> sorted(a.sample_ids(0) + a.sample_ids(1))
    [10, 11, 12, 13]
"""

from __future__ import annotations

from typing import Mapping, Sequence, cast

from .cost_model import RowCostModel
from .memory_model import MemoryModel
from .packing import split_for_oom as _split_for_oom
from .policies import POLICIES
from .speed_model import make_speed_model
from .types import Assignment, DeviceState, MicroBatch, RouterSettings

_STATE_VERSION = 1


class Router:
    def __init__(
        self, settings: RouterSettings | None = None, n_devices: int = 1, memory_model: MemoryModel | None = None
    ) -> None:
        if n_devices < 1:
            raise ValueError(f"n_devices={n_devices}: a job needs at least one device")
        self.settings = settings if settings is not None else RouterSettings()
        self.n_devices = n_devices
        self.memory_model = memory_model
        self.speed_model = make_speed_model(self.settings.speed_model, n_devices, self.settings.speed_ema)
        self._total_bytes: list[int | None] = [None] * n_devices
        self._free_bytes: list[int | None] = [None] * n_devices
        self._policy = POLICIES[self.settings.policy]
        # packed rows, row_cost="fitted": the row's terms fit from step times (router/cost_model.py)
        fit = self.settings.packed and self.settings.row_cost == "fitted"
        self.cost_model = RowCostModel(n_devices) if fit else None
        self._lengths_by_id: dict[int, int] = {}  # the last plan's, to read observed rows' sum of len^2

    # ---- state the workers report ------------------------------------------------------------------------
    def set_device_memory(self, device: int, total_bytes: int | None, free_bytes: int | None = None) -> None:
        """Latest telemetry of a device (read by its worker between steps). Budget = headroom x total."""
        self._total_bytes[device] = None if total_bytes is None else int(total_bytes)
        self._free_bytes[device] = None if free_bytes is None else int(free_bytes)

    def device_states(self) -> list[DeviceState]:
        speeds = self.speed_model.speeds()
        h = self.settings.memory_headroom
        return [
            DeviceState(
                d,
                speeds[d],
                None if self._total_bytes[d] is None else int(h * cast(int, self._total_bytes[d])),
                self._free_bytes[d],
            )
            for d in range(self.n_devices)
        ]

    # ---- decisions ---------------------------------------------------------------------------------------
    def plan(
        self, sample_ids: Sequence[int], lengths: Sequence[int], devices: Sequence[DeviceState] | None = None
    ) -> Assignment:
        """Split one global batch over the devices. devices=None: this router's own speed/memory state."""
        if devices is None:
            devices = self.device_states()
        elif len(devices) != self.n_devices:
            raise ValueError(f"{len(devices)} device states for a router of {self.n_devices} devices")
        if self.cost_model is not None:
            self._lengths_by_id = dict(zip(sample_ids, map(int, lengths)))
        return self._policy(list(lengths), list(sample_ids), devices, self.planning_settings(), self.memory_model)

    def planning_settings(self) -> RouterSettings:
        """The settings plans use: the configured ones, with the fitted row terms once the cost model has them."""
        return self.settings if self.cost_model is None else self.cost_model.settings_for(self.settings)

    def split_for_oom(
        self, mb: MicroBatch, lengths_by_id: Mapping[int, int] | Sequence[int]
    ) -> tuple[MicroBatch, MicroBatch]:
        """Halve an out-of-memory micro-batch (longest half first); costs/memory from this router's models."""
        return _split_for_oom(mb, lengths_by_id, self.planning_settings(), self.memory_model)

    # ---- learning ----------------------------------------------------------------------------------------
    def observe_step(
        self, device: int, cost: float, compute_s: float, peak_mem_bytes: int | None, microbatches: Sequence[MicroBatch]
    ) -> None:
        """One device's finished step: speed = cost / compute_s; the step's memory peak belongs to its largest
        micro-batch (gradient accumulation frees activations between micro-batches). Packed, fitted: the rows'
        tokens, sum of squared sample lengths and count feed the row cost model."""
        self.speed_model.observe(device, cost, compute_s)
        if self.cost_model is not None and microbatches:
            known = self._lengths_by_id
            ids = [sid for mb in microbatches for sid in mb.sample_ids]
            if all(sid in known for sid in ids):  # rows of another plan (none: a test's own rows) say nothing
                tokens = sum(mb.n_tokens for mb in microbatches)
                len2 = sum(known[sid] * known[sid] for sid in ids)
                self.cost_model.observe(device, tokens, len2, len(microbatches), compute_s)
        if self.memory_model is None or peak_mem_bytes is None or not microbatches:
            return
        largest = max(
            microbatches, key=lambda mb: (cast(MemoryModel, self.memory_model).predict_mb(mb), mb.n_padded_tokens)
        )
        n = len(largest.sample_ids)
        if n:
            self.memory_model.observe(largest.n_padded_tokens, n, largest.n_padded_tokens // n, peak_mem_bytes)

    def observe_oom(self, device: int, microbatch: MicroBatch) -> None:
        """`microbatch` did not fit on `device`: future predictions for that size exceed the device's memory."""
        if self.memory_model is None:
            return
        n = len(microbatch.sample_ids)
        if n:
            self.memory_model.observe_oom(
                microbatch.n_padded_tokens, n, microbatch.n_padded_tokens // n, self._total_bytes[device]
            )

    # ---- checkpoints (JSON-serialisable) -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": _STATE_VERSION,
            "n_devices": self.n_devices,
            "speed": self.speed_model.state_dict(),
            "memory": None if self.memory_model is None else self.memory_model.state_dict(),
            "row_cost": None if self.cost_model is None else self.cost_model.state_dict(),
            "total_bytes": list(self._total_bytes),
            "free_bytes": list(self._free_bytes),
        }

    def load_state_dict(self, d: dict) -> None:
        if d.get("version") != _STATE_VERSION:
            raise ValueError(f"router state version {d.get('version')!r}, expected {_STATE_VERSION}")
        self.speed_model.load_state_dict(d["speed"])
        if d.get("memory") is not None:
            if self.memory_model is None:
                self.memory_model = MemoryModel()
            self.memory_model.load_state_dict(d["memory"])
        if d.get("row_cost") is not None and self.cost_model is not None:
            self.cost_model.load_state_dict(d["row_cost"])
        # Memory readings describe the devices of the previous allocation; keep them only on the same count.
        if d.get("n_devices") == self.n_devices:
            self._total_bytes = list(d["total_bytes"])
            self._free_bytes = list(d["free_bytes"])
