"""One run per directory (opsd_jax/io/run_lock.py): a second run refuses, naming the holder; a
dead holder's lock is taken over; train.py refuses before any compute and releases on exit."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from test_train_cli import run_train

from opsd_jax.io import run_lock


def test_a_second_acquire_is_refused_and_names_the_holder(tmp_path):
    lock = run_lock.acquire([tmp_path])
    holder = json.loads((tmp_path / run_lock.LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(run_lock.RunLockError, match=f"process {os.getpid()} on host"):
        run_lock.acquire([tmp_path])
    lock.release()
    assert not (tmp_path / run_lock.LOCK_NAME).exists()
    run_lock.acquire([tmp_path]).release()  # free again


def test_the_lock_of_a_dead_process_is_taken_over_with_a_message(tmp_path):
    code = (
        "import sys, time; from opsd_jax.io import run_lock;"
        "run_lock.acquire([sys.argv[1]]); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(run_lock.RunLockError, match=f"process {holder.pid} "):
        run_lock.acquire([tmp_path])
    holder.kill()  # SIGKILL: no release; the zombie (not reaped yet) counts as gone
    for _ in range(500):  # the signal is asynchronous: wait until the kernel made it a zombie
        if (run_lock._proc_stat(holder.pid) or ["Z"])[0] == "Z":
            break
        time.sleep(0.01)
    said = []
    lock = run_lock.acquire([tmp_path], say=said.append)
    holder.wait()
    assert said and f"process {holder.pid}" in said[0] and "no longer running" in said[0]
    assert json.loads((tmp_path / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not list(tmp_path.glob("*.stale"))
    lock.release()


def test_a_reused_process_id_does_not_hold_the_lock(tmp_path):
    # Our own pid, but a process start that is not ours: the lock's process is gone.
    stale = dict(
        host=socket.gethostname(),
        pid=os.getpid(),
        process_start="1",
        started="2026-01-01T00:00:00",
        command="train.py",
    )
    (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps(stale))
    said = []
    run_lock.acquire([tmp_path], say=said.append).release()
    assert said and "no longer running" in said[0]


def test_a_lock_from_another_host_is_refused_with_what_to_check(tmp_path):
    other = dict(
        host="gpu-node-7",
        pid=4242,
        process_start=None,
        started="2026-01-01T00:00:00",
        command="train.py --config x",
    )
    (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(run_lock.RunLockError, match="process 4242 on host gpu-node-7.*delete"):
        run_lock.acquire([tmp_path])
    assert json.loads((tmp_path / run_lock.LOCK_NAME).read_text()) == other  # untouched


def test_every_directory_or_none(tmp_path):
    a, b = tmp_path / "results", tmp_path / "checkpoints"
    held = run_lock.acquire([b])
    with pytest.raises(run_lock.RunLockError):
        run_lock.acquire([a, b])
    assert not (a / run_lock.LOCK_NAME).exists()  # the first one was given back
    held.release()
    both = run_lock.acquire([a, b])
    assert (a / run_lock.LOCK_NAME).exists() and (b / run_lock.LOCK_NAME).exists()
    both.release()


def test_train_refuses_a_held_results_dir_before_any_compute(tmp_path):
    """The issue's case: a second run on a results_dir in use stops at once with one line
    naming the first run, and writes nothing there."""
    lock = run_lock.acquire([tmp_path])  # this test process plays the first run
    try:
        result = run_train(
            f"--config.results_dir={tmp_path}", "--config.total_steps=2", timeout=300
        )
    finally:
        lock.release()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("train.py: ") and f"process {os.getpid()} on host" in lines[-1]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no toy data, checkpoints, logs
