"""One run per directory (opsd_jax/io/run_lock.py): a second run refuses, naming the holder; a
dead holder's lock is taken over, by one run only; train.py locks its results_dir and its
checkpoint_dir, refuses before any compute and releases on exit."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import builders
import numpy as np
import pytest
from test_train_cli import run_train

from opsd_jax.io import checkpoint as ckpt_lib
from opsd_jax.io import run_lock


def dead_holder(**fields) -> dict:
    """A lock's fields naming a process of this host that is gone: our own pid, but a process
    start that is not ours (a reused id)."""
    gone = dict(
        host=socket.gethostname(),
        pid=os.getpid(),
        process_start="1",
        started="2026-01-01T00:00:00",
        command="train.py",
    )
    return {**gone, **fields}


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
    stale = dead_holder()
    (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps(stale))
    said = []
    run_lock.acquire([tmp_path], say=said.append).release()
    assert said and "no longer running" in said[0]


def test_of_two_runs_taking_over_one_dead_lock_only_the_first_holds_it(tmp_path, monkeypatch):
    """Two runs find the same dead holder; the faster one takes the lock over while the slower
    one is still between its check and its takeover. The slower one must then be refused like
    any second run, not move the new lock aside and hold the directory too."""
    (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps(dead_holder()))
    check_running, checks, faster = run_lock._running, [], []

    def slow_check(pid, start):
        checks.append(pid)
        if len(checks) == 1:  # the slower run's check: the faster run takes over meanwhile
            faster.append(run_lock.acquire([tmp_path], say=lambda line: None))
        return check_running(pid, start)

    monkeypatch.setattr(run_lock, "_running", slow_check)
    said = []
    with pytest.raises(
        run_lock.RunLockError, match=f"in use by another run: process {os.getpid()}"
    ):
        run_lock.acquire([tmp_path], say=said.append)
    assert said == []  # the slower run took nothing over
    lock_file = json.loads((tmp_path / run_lock.LOCK_NAME).read_text())
    assert lock_file == dataclasses.asdict(faster[0].holder)
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_lock.LOCK_NAME]  # no claim left
    faster[0].release()


def test_an_interrupted_takeover_names_the_files_to_delete(tmp_path):
    """A run killed inside its takeover, before it removed the dead lock, leaves its claim
    (`run.lock.takeover-<pid>-<start>`): the next run says which two files to delete."""
    lock_path = tmp_path / run_lock.LOCK_NAME
    dead = dead_holder()
    claim = tmp_path / f"{run_lock.LOCK_NAME}.takeover-{dead['pid']}-{dead['process_start']}"
    lock_path.write_text(json.dumps(dead))
    claim.write_text(json.dumps(dead_holder(process_start="2", command="train.py (killed)")))
    with pytest.raises(run_lock.RunLockError, match=f"interrupted.*delete {lock_path} and {claim}"):
        run_lock.acquire([tmp_path])
    assert json.loads(lock_path.read_text()) == dead  # untouched
    lock_path.unlink()
    claim.unlink()
    run_lock.acquire([tmp_path]).release()


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
    assert sorted(tmp_path.iterdir()) == []  # the directories the lock made, left empty, go


def test_a_locked_checkpoint_dir_saves_prunes_and_restores(tmp_path):
    """A run holds its checkpoint_dir by a run.lock inside it (and takeover claims live there
    for a moment): neither orbax nor checkpoint_format.step_dirs may take them for a step."""
    directory = tmp_path / "checkpoints"
    lock = run_lock.acquire([directory])
    (directory / f"{run_lock.LOCK_NAME}.takeover-1-2").write_text("{}")
    with ckpt_lib.Checkpointer(directory, save_every=1, max_to_keep=1) as checkpointer:
        for step in (1, 2):
            assert checkpointer.save(
                step, builders.small_train_state(step), data_state=None, config={}
            )
        checkpointer.wait_until_finished()
        assert ckpt_lib.step_dirs(ckpt_lib.epath_of(directory)) == ([2], [])
    # A restarted run's manager (it removes half-written steps) keeps the lock too.
    with ckpt_lib.Checkpointer(directory, save_every=1) as checkpointer:
        state, _, _ = checkpointer.restore(ckpt_lib.abstract_like(builders.small_train_state(0)))
    assert int(state.step) == 2 and np.array_equal(state.params["w"], np.full((4, 2), 2.0))
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["2", run_lock.LOCK_NAME, f"{run_lock.LOCK_NAME}.takeover-1-2"]
    lock_file = json.loads((directory / run_lock.LOCK_NAME).read_text())
    assert lock_file == dataclasses.asdict(lock.holder)
    lock.release()


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


def test_train_refuses_a_results_dir_whose_checkpoints_another_run_holds(tmp_path):
    """Run B (results_dir r2, checkpoint_dir r1/checkpoints) holds r1/checkpoints; run A on
    results_dir r1 would write its checkpoints there too, so it must refuse although nobody
    holds r1 itself, and give r1 back."""
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    run_b = run_lock.acquire([r2, r1 / "checkpoints"])  # this test process plays run B
    try:
        result = run_train(f"--config.results_dir={r1}", "--config.total_steps=2", timeout=300)
    finally:
        run_b.release()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"train.py: {r1 / 'checkpoints'} is in use by another run")
    assert f"process {os.getpid()} on host" in lines[-1] and "Traceback" not in result.stderr
    assert not (r1 / run_lock.LOCK_NAME).exists()  # r1's lock was given back
