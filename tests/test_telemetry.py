"""Telemetry maps a worker's cuda:N to the physical GPU NVML knows (index or UUID), and reads CPU workers.

pytest tests/test_telemetry.py
"""

import numpy as np
import psutil
import pytest
import torch

from slurm_router.worker.telemetry import Telemetry


@pytest.mark.parametrize(
    "visible, local, physical",
    [("2,3", 1, 3), ("GPU-6f1c,GPU-77aa", 1, "GPU-77aa"), ("MIG-1234", 0, "MIG-1234"), ("", 0, 0), ("5", 0, 5)],
)
def test_visible_devices_map_to_nvml_ids(monkeypatch, visible, local, physical):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert Telemetry._physical_index(local) == physical


def test_cpu_worker_reads_process_memory():
    """A CPU worker's memory is its process's resident set (it grows by what the process touches), within the
    machine's total and free memory."""
    t = Telemetry(torch.device("cpu"))
    total = psutil.virtual_memory().total
    assert isinstance(t.total_bytes(), int) and t.total_bytes() == total
    assert isinstance(t.free_bytes(), int) and 0 < t.free_bytes() <= total
    before = t.peak_bytes()
    assert isinstance(before, int) and 0 < before < total
    block = np.ones(256 << 20, dtype=np.uint8)  # 256 MiB, every page touched
    grown = t.peak_bytes() - before
    assert 200 << 20 <= grown <= 400 << 20, f"the resident set grew by {grown / 2**20:.0f} MiB for a 256 MiB block"
    del block


def test_cpu_worker_util_is_this_process_cpu_percent_since_the_last_read():
    """util() on a CPU worker: the percent of one core this process used since the previous read: near 100
    while it computes, near 0 while it sleeps (a float, never above 100 x the cores)."""
    import time

    t = Telemetry(torch.device("cpu"))
    end = time.process_time() + 0.5  # 0.5 s of this process's own CPU time, however loaded the machine
    x = 0
    while time.process_time() < end:
        x += 1
    busy = t.util()
    time.sleep(0.5)
    idle = t.util()
    for value in (busy, idle):
        assert isinstance(value, float) and 0.0 <= value <= 100.0 * (psutil.cpu_count() or 1), value
    # busy: 0.5 s of CPU over the wall time it took (up to 4x longer on a machine loaded by 4 test files at once)
    assert busy >= 10.0, f"a busy loop read as {busy}% CPU"
    assert idle <= 5.0, f"a sleeping process read as {idle}% CPU"
    assert busy > 2 * idle
