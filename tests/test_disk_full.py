"""A disk that fills (or refuses a write otherwise) ends a run with one line: the file, the
reason and the checkpoint to resume from. Nothing saved is lost: the half-written step is never
restored, and the relaunch resumes from the last complete one.

orbax saves in the background, so a failed save surfaces in the main thread later: at the next
save, wait_until_finished or close; each is checked in process, and the whole run end to end
(tests/train_with_full_disk.py fails the JSON writes of one step's save as a full disk does).
"""

import errno
import os
import re
import subprocess
import sys
import time

import builders
import pytest
import train_with_full_disk
from conftest import subprocess_env
from etils import epath
from test_train_cli import ROOT, run_train, train_command

import train
from opsd_jax.io import checkpoint as ckpt_lib
from opsd_jax.io import disk_errors
from opsd_jax.training.metrics import METRICS_FILE, MetricsLogger

# A slow file (train.py processes): outside the fast tier, pytest -m 'not slow'.
pytestmark = pytest.mark.slow

NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"
# tensorstore's error for an array write on a full disk, as orbax raises it again (captured on
# a 5 MB tmpfs); the key written is quoted too, and holds a '/'.
TENSORSTORE_FULL = (
    'RESOURCE_EXHAUSTED: Error writing "vit_model.layers.v_proj.kernel/0.0.0" in OCDBT database '
    'at local file "/run/checkpoints/2/params/ocdbt.process_0/": Failed writing: '
    '"/run/checkpoints/2/params/ocdbt.process_0/d/84cf914040dbc02b": Failed to write 155007 '
    "bytes to file 11: No space left on device [os_error_code='28']"
)


def test_the_os_error_is_found_behind_what_wrapped_it():
    full = OSError(errno.ENOSPC, NO_SPACE, "/run/metrics.jsonl")
    for wrap in ("cause", "context"):
        try:
            try:
                raise full
            except OSError as e:
                if wrap == "cause":
                    raise RuntimeError("the save failed") from e
                raise RuntimeError("the save failed")  # implicit chaining: __context__
        except RuntimeError as wrapped:
            assert disk_errors.os_error_in(wrapped) is full
    described = disk_errors.os_error_in(RuntimeError("wrapped", ValueError(TENSORSTORE_FULL)))
    assert described is None  # an argument is not a cause
    described = disk_errors.os_error_in(ValueError(TENSORSTORE_FULL))
    assert (described.errno, described.strerror) == (errno.ENOSPC, NO_SPACE)
    assert described.filename == "/run/checkpoints/2/params/ocdbt.process_0/d/84cf914040dbc02b"
    # A bug, and the project's own messages (no errno), are not disk errors.
    assert disk_errors.os_error_in(ValueError("shapes differ")) is None
    assert disk_errors.os_error_in(FileNotFoundError("no complete checkpoint in /run")) is None


def test_one_line_for_a_disk_error_and_a_traceback_for_a_bug(tmp_path):
    opened = train.OpenedCheckpoints()
    assert train.one_line_error(TypeError("a bug"), opened) is None  # run() raises it again
    assert train.one_line_error(ckpt_lib.CheckpointError("bad target"), opened) == "bad target"
    error = RuntimeError("wrapped")
    error.__cause__ = OSError(errno.EROFS, os.strerror(errno.EROFS), "/run/eval")
    assert train.one_line_error(error, opened) == "/run/eval: Read-only file system"
    with ckpt_lib.Checkpointer(tmp_path / "checkpoints", save_every=1) as checkpointer:
        opened.checkpointer = checkpointer
        assert train.one_line_error(ValueError(TENSORSTORE_FULL), opened) == (
            f"/run/checkpoints/2/params/ocdbt.process_0/d/84cf914040dbc02b: {NO_SPACE}. No "
            f"complete checkpoint in {tmp_path / 'checkpoints'} yet; free space and run the "
            f"same command to start again"
        )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_log_write_on_a_full_disk_names_the_file(tmp_path):
    """metrics.jsonl on /dev/full (every write: ENOSPC, naming no file): the error names it."""
    (tmp_path / METRICS_FILE).symlink_to("/dev/full")
    logger = MetricsLogger(str(tmp_path), total_steps=2, log_every=1, progress_bar=False)
    with pytest.raises(OSError) as caught:
        logger.log_scalars(0, {"eval/accuracy": 0.5})
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.filename == str(tmp_path / METRICS_FILE)


def _wait_until_still(directory, quiet=0.5, most=20.0):
    """Until no file under `directory` has appeared, gone or changed size for `quiet` s."""

    def listing():
        # The writers being waited for may remove a file (a tensorstore lock) or a folder
        # between the walk that finds it and its stat: gone is a change like any other, not an
        # error (os.walk skips a folder it can no longer list).
        files = []
        for folder, _, names in os.walk(directory):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    files.append((path, os.stat(path).st_size))
                except FileNotFoundError:
                    files.append((path, -1))
        return sorted(files)

    deadline, last = time.monotonic() + most, listing()
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = listing()
        if now == last:
            return
        last = now


@pytest.mark.parametrize("surfaces_at", ["save", "wait_until_finished", "close"])
def test_a_save_on_a_full_disk_is_named_and_the_last_complete_step_restores(
    tmp_path, monkeypatch, surfaces_at
):
    """Step 2's save fails in orbax's background thread; the main thread meets it at the next
    save, a wait or the close, as a CheckpointWriteError naming the step; step 1 restores."""
    directory = tmp_path / "checkpoints"
    monkeypatch.setenv("OPSD_FULL_DISK_STEP", "2")
    monkeypatch.setattr(
        type(epath.Path("/")), "write_text", train_with_full_disk._write_text_on_a_full_disk
    )
    # One step kept: orbax would prune step 1 once step 2 is committed, never before.
    checkpointer = ckpt_lib.Checkpointer(directory, save_every=1, max_to_keep=1)
    checkpointer.save(1, builders.small_train_state(1), data_state=None, config={"s": 1})
    checkpointer.wait_until_finished()
    assert checkpointer.save(
        2, builders.small_train_state(2), data_state=None, config={"s": 2}
    )  # in flight
    with pytest.raises(ckpt_lib.CheckpointWriteError) as caught:
        if surfaces_at == "save":
            checkpointer.save(3, builders.small_train_state(3), data_state=None, config={"s": 3})
        elif surfaces_at == "wait_until_finished":
            checkpointer.wait_until_finished()
        else:
            checkpointer.close()
    error = caught.value
    assert (error.step, error.errno, error.strerror) == (2, errno.ENOSPC, NO_SPACE)
    assert error.filename == str(directory / "2")  # the write named no file: the step's directory
    checkpointer.close()  # raised once: closing after it is quiet
    monkeypatch.undo()
    # The next start is a new process: the failed save's writers are gone. Here they share the
    # process, and on a loaded CPU a tensorstore write of step 2 can land after the close, while
    # the restart's clean-up removes that folder ("Directory not empty"); wait for them.
    _wait_until_still(directory)
    with ckpt_lib.Checkpointer(directory, save_every=1) as restarted:  # the next start
        assert restarted.all_steps() == [1]
        state, _, config = restarted.restore(ckpt_lib.abstract_like(builders.small_train_state(0)))
    assert int(state.step) == 1 and config == {"s": 1}


def test_a_full_disk_during_a_save_is_one_line_and_the_relaunch_resumes(tmp_path):
    """train.py end to end: step 2's save fills the disk; the run ends with one line (exit 1,
    no traceback) naming the step, the reason and step 1, the last complete checkpoint. The
    same command then resumes from step 1, and its closing summary is the whole run's: from
    the step-0 evaluation of the first launch to its own at step 4."""
    args = [
        f"--config.results_dir={tmp_path}",
        "--config.total_steps=4",
        "--config.save_every=1",
        "--config.eval_every=4",  # step 0 (first launch) and step 4 (the relaunch)
        # The schedule and evaluation of test_train_cli.py's reference run, so the programs
        # are the ones it compiled (its compilation cache): a constant learning rate puts no
        # total_steps in the step, 2 samples a data set give the same evaluation batch.
        "--config.lr_scheduler=constant",
        "--config.warmup_steps=0",
        "--config.eval_samples_per_dataset=2",
    ]
    full = subprocess.run(
        [sys.executable, "tests/train_with_full_disk.py", *train_command(*args)[2:]],
        cwd=ROOT,
        env=dict(subprocess_env(1), OPSD_FULL_DISK_STEP="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    checkpoints = tmp_path / "checkpoints"
    assert full.returncode == 1, full.stdout[-3000:] + full.stderr[-3000:]
    assert "[full disk]" in full.stdout  # the fault was injected
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    lines = [line for line in full.stderr.splitlines() if line.strip()]
    print(lines[-1])  # the line, for the record (pytest -s)
    assert lines[-1] == (
        f"train.py: error: {checkpoints / '2'}: {NO_SPACE}, saving checkpoint step 2 (left "
        f"incomplete: never restored). Last complete checkpoint: step 1, {checkpoints / '1'}; "
        f"free space and run the same command to resume from it"
    ), full.stderr[-3000:]
    assert sum(NO_SPACE in line for line in lines) == 1  # orbax's own reports of it: quiet

    resumed = run_train(*args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {checkpoints} at step 1" in resumed.stdout
    assert "never restored and removed now: ['2']" in resumed.stderr
    table = resumed.stdout[resumed.stdout.index("held-out accuracy (4 samples, greedy") :]
    assert re.search(r"\n\s+0 \|\s+\d+\.\d%\n\s+4 \|\s+\d+\.\d%\n", table), table[:800]
    assert re.search(r"no VT: \d+\.\d% at step 0 -> \d+\.\d% at step 4 ", table), table[:800]
