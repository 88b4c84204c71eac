"""Multi-host settings that would be ignored are refused; a one-process distributed run is said.

A launch with a coordinator address, a process count or a process id (as config keys or as
JAX_* environment variables) but without `distributed=True` used to train alone, silently: on N
hosts, N independent runs. Now it is one config error naming `distributed`, before any compute.
"""

import socket

import pytest
from conftest import run_python
from test_train_cli import _valid_config, run_train

from opsd_jax import run_config


@pytest.mark.parametrize(
    "key, value",
    [("coordinator_address", "127.0.0.1:12345"), ("num_processes", 2), ("process_id", 0)],
)
def test_a_multi_host_key_without_distributed_is_named(tmp_path, key, value):
    config = _valid_config(tmp_path)
    run_config.validate(config, num_devices=1)  # the base is valid
    with config.unlocked():
        config[key] = value
    with pytest.raises(run_config.ConfigError) as error:
        run_config.validate(config, num_devices=1)
    assert f"{key}={value!r} without distributed=True" in str(error.value)
    with config.unlocked():
        config.distributed = True
    run_config.validate(config, num_devices=1)  # the same key is what a multi-host run sets


@pytest.mark.parametrize("name", ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"])
def test_a_jax_environment_variable_without_distributed_is_named(tmp_path, monkeypatch, name):
    config = _valid_config(tmp_path)
    monkeypatch.setenv(name, "1")
    with pytest.raises(run_config.ConfigError) as error:
        run_config.validate(config, num_devices=1)
    assert f"${name}='1' without distributed=True" in str(error.value)


def test_the_reviewed_launch_is_one_config_error_before_any_compute(tmp_path):
    # The launch from the review: three multi-host settings, no distributed=True.
    result = run_train(
        f"--config.results_dir={tmp_path}",
        "--config.coordinator_address=127.0.0.1:12345",
        "--config.num_processes=2",
        "--config.process_id=0",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "train.py: bad training config:",
        "  coordinator_address='127.0.0.1:12345', num_processes=2, process_id=0 without "
        "distributed=True: these are ignored and this process would train alone; set "
        "--config.distributed=True (or drop them)",
    ]
    assert "mesh" not in result.stdout  # stopped before building anything


def test_distributed_with_one_process_is_said(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A mesh for 3 devices on 1 stops the run at the device checks, right after the init.
    result = run_python(
        "train.py",
        "--config",
        "configs/smoke.py",
        f"--config.results_dir={tmp_path}",
        "--config.distributed=True",
        f"--config.coordinator_address=127.0.0.1:{port}",
        "--config.num_processes=1",
        "--config.process_id=0",
        "--config.num_replicate=3",
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "distributed=True with 1 process: JAX's distributed runtime started, and this run "
        "trains alone (num_processes=1)"
    ) in result.stdout.splitlines()
    assert "does not match the 1 devices" in result.stderr


def test_the_collector_refuses_multi_host_settings_it_would_ignore(tmp_path):
    """scripts/collect_traces.py splits the rows by --process_index / --process_count, without
    JAX's distributed runtime: given the training launch's multi-host settings instead, N hosts
    would each collect everything as process 0, into the same files."""
    result = run_python(
        "scripts/collect_traces.py",
        "--config",
        "configs/offline_tiny.py",
        f"--config.results_dir={tmp_path}",
        "--config.distributed=True",
        "--config.num_processes=2",
        "--config.process_id=1",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (
        "collect_traces.py: distributed=True: the collection runs without JAX's distributed "
        "runtime; give each host's process --process_index=I --process_count=N instead (and "
        "drop these)"
    )
    assert not (tmp_path / "toy").exists()  # refused before it wrote anything
