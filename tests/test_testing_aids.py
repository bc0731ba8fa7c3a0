"""The testing aids are environment variables, never a user's setting (slurm_router/config/testing_aids.py): read
once, per variant or for every task; a bad value is one line naming the variable, before anything is written."""

from __future__ import annotations

import pytest

from slurm_router.__main__ import main
from slurm_router.config import testing_aids as aids
from slurm_router.config.testing_aids import TestingAids
from slurm_router.errors import UserError


@pytest.fixture
def fresh_aids():
    aids.testing_aids.cache_clear()
    yield
    aids.testing_aids.cache_clear()


def test_every_task_or_one_variant_and_ranks_in_turn():
    read = TestingAids.from_environ(
        {
            aids.DEVICE_SLOWDOWN_ENV: "4; r32=1,20",
            aids.CPU_MEMORY_CAP_ENV: "bad=1000",
            aids.MEMORY_HEADROOM_MAX_ENV: "4",
        }
    )
    assert [read.slowdown("r32", rank) for rank in range(3)] == [1.0, 20.0, 1.0]
    assert read.slowdown("base", 5) == 4.0
    assert (read.cpu_memory_cap("bad"), read.cpu_memory_cap("r8")) == (1000, None)
    assert read.memory_headroom_max == 4
    none = TestingAids.from_environ({})
    assert (none.slowdown("main", 1), none.cpu_memory_cap("main"), none.memory_headroom_max) == (1.0, None, 1)


@pytest.mark.parametrize(
    "name, value",
    [
        (aids.DEVICE_SLOWDOWN_ENV, "1,-1"),
        (aids.DEVICE_SLOWDOWN_ENV, "r32=fast"),
        (aids.CPU_MEMORY_CAP_ENV, "1e3"),
        (aids.CPU_MEMORY_CAP_ENV, "0"),
        (aids.MEMORY_HEADROOM_MAX_ENV, "nan"),
    ],
)
def test_a_bad_value_names_its_variable(name, value):
    with pytest.raises(UserError, match=f"^environment variable {name}: .* is not valid: give "):
        TestingAids.from_environ({name: value})


def test_the_command_refuses_a_bad_value_in_one_line(tmp_path, monkeypatch, capsys, fresh_aids):
    monkeypatch.setenv(aids.DEVICE_SLOWDOWN_ENV, "0")
    monkeypatch.chdir(tmp_path)
    assert main(["dry_run=true", f"run_root={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: environment variable {aids.DEVICE_SLOWDOWN_ENV}: '0' is not valid") and (
        "\n" not in err
    ), err
    assert not (tmp_path / "runs").exists()


def test_memory_headroom_above_1_only_with_its_variable(tmp_path, monkeypatch, capsys, fresh_aids):
    monkeypatch.chdir(tmp_path)
    args = ["dry_run=true", "router.memory_headroom=4", f"run_root={tmp_path / 'runs'}"]
    assert main(args) == 2
    assert "router.memory_headroom=4.0 is out of range: it must be > 0 and <= 1" in capsys.readouterr().err
    monkeypatch.setenv(aids.MEMORY_HEADROOM_MAX_ENV, "4")
    aids.testing_aids.cache_clear()
    assert main(args) == 0, capsys.readouterr()
