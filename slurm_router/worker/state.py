"""What a worker needs to stop at a step boundary and carry on later exactly where it stopped.

A checkpoint holds the trainable weights (LoRA adapters only, or the full model), the optimizer, every
rank's RNG states, the router's learned state, the losses so far and the next step to run. The learning
rate is a pure function of the step and so is the sampler (the global batch of step s never depends on
what ran before), so the step is the whole schedule and sampler position.

Signals (USR2 from Slurm or submitit, TERM on preemption or from the local launcher, INT on Ctrl-C) only
raise a flag here; the training loop all-reduces it with the step's stats so every rank stops after the
same step, and rank 0 saves.
"""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass
from typing import Callable, cast

import numpy as np
import torch
import torch.distributed as dist

from slurm_router.rundir.lifecycle import (
    EXIT_STOPPED,  # noqa: F401  (a worker's exit code after a stop signal)
    STOP_SIGNALS,
)

FORMAT = 1


@dataclass
class Stopped:
    """train()'s return after a stop signal: the checkpoint holds every step before `step`."""

    step: int
    signum: int


class StopFlag:
    """This worker process's stop request: the first stop signal it got (0: none). Only a flag: a signal can
    land inside a collective or a backward pass; the training loop acts at the step end."""

    def __init__(self):
        self.signum = 0

    def on_signal(self, signum, frame=None) -> None:
        self.signum = self.signum or signum

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.on_signal)
        # The job process spawns workers with these signals blocked (supervisor.spawn_blocked: one during
        # start-up waits instead of killing the worker): from here on they are welcome, and a pending one is
        # delivered now; the worker then stops before its first step (Worker.stopped_in_setup).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


_FLAG = StopFlag()  # one per worker process: signal handlers are per process


def install_stop_handlers() -> None:
    _FLAG.install()


def stop_requested() -> int:
    """The first stop signal received (0: none)."""
    return _FLAG.signum


def request_stop(signum: int) -> None:
    _FLAG.on_signal(signum)


def _rng_state(device: torch.device) -> dict:
    # Plain bytes, no tensors: all_gather_object pickles it, and torch.load(weights_only=True) reads bytes.
    np_state = cast(tuple, np.random.get_state())
    state = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tobytes(), *np_state[2:]),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    return state


def _bytes_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    random.setstate(_tuplify(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32).copy(), *rest))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]), device)


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def capture_around(
    payload: Callable[[], dict], router, next_step: int, world: int, device: torch.device, identity: dict
) -> dict | None:
    """Collective (every rank calls it): the checkpoint dict on rank 0, None elsewhere. What every checkpoint
    holds (format, the task's identity, the step, the router, every rank's RNG state, gathered: they are per
    rank) around the worker's own `payload` (called on rank 0: weights and optimizer are identical on every
    replica). The worker's payload is its member group's: a task alone's one entry at the top level, a fused
    task's one entry per member (worker/members.py)."""
    rngs = [None] * world
    dist.all_gather_object(rngs, _rng_state(device))
    if dist.get_rank() != 0:
        return None
    return {
        "format": FORMAT,
        **identity,
        "step": next_step,
        "world": world,
        **payload(),
        "router": router.state_dict(),
        "rng": rngs,
    }


def restore_around(
    state: dict, load_payload: Callable[[dict], None], router, rank: int, device: torch.device, identity: dict
) -> int:
    """Check a checkpoint is this task's, load the worker's payload (load_payload(state)), the router and this
    rank's RNG stream; returns the next step."""
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {state.get('format')!r}, this version reads {FORMAT}")
    for key, want in identity.items():
        if state.get(key) != want:
            raise ValueError(f"checkpoint is for {key}={state.get(key)!r}, this task has {key}={want!r}")
    load_payload(state)
    router.load_state_dict(state["router"])
    rngs = state["rng"]
    # Same world size: every rank continues its own RNG stream; otherwise all start from rank 0's.
    _set_rng_state(rngs[rank] if len(rngs) == dist.get_world_size() else rngs[0], device)
    return int(state["step"])
