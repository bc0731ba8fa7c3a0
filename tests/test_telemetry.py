"""Telemetry maps a worker's cuda:N to the physical GPU NVML knows (index or UUID), and reads CPU workers.

    pytest tests/test_telemetry.py
"""
import pytest
import torch

from slurm_router.telemetry import Telemetry


@pytest.mark.parametrize("visible, local, physical", [
    ("2,3", 1, 3), ("GPU-6f1c,GPU-77aa", 1, "GPU-77aa"), ("MIG-1234", 0, "MIG-1234"), ("", 0, 0), ("5", 0, 5)])
def test_visible_devices_map_to_nvml_ids(monkeypatch, visible, local, physical):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert Telemetry._physical_index(local) == physical


def test_cpu_worker_reads_process_memory():
    t = Telemetry(torch.device("cpu"))
    assert 0 < t.peak_bytes() < t.total_bytes() and 0 < t.free_bytes() <= t.total_bytes()
    assert t.util() >= 0
