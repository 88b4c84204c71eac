"""One run per directory: a lock file naming its holder, taken before any compute.

Why: two runs on one `results_dir` would both resume from its checkpoints and write the same
step numbers, metrics and TensorBoard events, each silently overwriting the other. A run
therefore holds its directories (results_dir, and checkpoint_dir when it lies elsewhere) for
its lifetime: `acquire` writes `<dir>/run.lock` with O_EXCL (host, process id, the process's
start, the time and the command), and a second run refuses with one line naming the holder.

The lock is released when the run ends (normally, on an error, on Ctrl-C: `release`, also at
interpreter exit). A run killed with SIGKILL leaves its lock behind; the next run on the same
host sees that the process is gone (its id is not running, or runs a process started after
the lock was written: a reused id) and takes the lock over, saying so. A lock written on
another host cannot be checked from here: the message says which host and process to check,
and that deleting the file releases it. With several processes (hosts) only the main one takes
the lock of the shared directory, and all of them stop if it is refused (`acquire_for_run`).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import socket
import sys

LOCK_NAME = "run.lock"


class RunLockError(RuntimeError):
    """The directory is held by another run (or cannot be locked at all)."""


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> str | None:
    """The process's start time since boot (clock ticks, stat field 22), or None where /proc
    does not say: with the pid it names one process, even after the id is reused."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _running(pid: int, start: str | None) -> bool:
    """Whether process `pid` (started at `start`, when known) still runs on this host; a
    zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    fields = _proc_stat(pid)
    if fields is None:
        return True
    return fields[0] not in ("Z", "X") and (start is None or fields[19] == start)


@dataclasses.dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    process_start: str | None
    started: str  # local time, ISO 8601
    command: str

    @classmethod
    def this_process(cls) -> Holder:
        return cls(
            socket.gethostname(),
            os.getpid(),
            _process_start(os.getpid()),
            datetime.datetime.now().isoformat(timespec="seconds"),
            " ".join(sys.argv),
        )

    def describe(self) -> str:
        return f"process {self.pid} on host {self.host}, started {self.started} ({self.command})"


class RunLock:
    """The locks of one run; `release()` frees those it still holds."""

    def __init__(self, paths: list[str], holder: Holder):
        self.paths, self.holder = paths, holder
        atexit.register(self.release)

    def release(self) -> None:
        for path in self.paths:
            if _read(path) == self.holder:  # never remove a lock another run took over
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
        self.paths = []


def _read(path: str) -> Holder | None:
    try:
        with open(path) as f:
            return Holder(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def _take(path: str, holder: Holder) -> bool:
    """Create the lock file atomically; False if it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(holder), f)
    return True


def acquire(directories: list[str], say=print) -> RunLock:
    """Lock every directory (created if missing) for this process, or raise RunLockError."""
    holder = Holder.this_process()
    taken: list[str] = []
    lock = RunLock(taken, holder)
    try:
        for directory in dict.fromkeys(os.path.abspath(d) for d in directories):
            taken.append(_acquire_one(directory, holder, say))
    except BaseException:
        lock.release()
        raise
    return lock


def _acquire_one(directory: str, holder: Holder, say) -> str:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise RunLockError(f"cannot create the run directory {directory}: {e.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise RunLockError(f"the run directory {directory} is not writable")
    path = os.path.join(directory, LOCK_NAME)
    for _ in range(3):  # a lost race with another run taking over the same stale lock
        if _take(path, holder):
            if os.path.exists(f"{path}.stale"):
                os.remove(f"{path}.stale")
            return path
        other = _read(path)
        if other is None:
            raise RunLockError(
                f"{path} exists but does not name a run (half-written or not ours): if no "
                f"run uses {directory}, delete the file"
            )
        if other.host != holder.host:
            raise RunLockError(
                f"{directory} is in use by another run: {other.describe()}. Wait for it to "
                f"end, or give this run another results_dir; if that process is gone (it "
                f"cannot be checked from host {holder.host}), delete {path}"
            )
        if _running(other.pid, other.process_start):
            raise RunLockError(
                f"{directory} is in use by another run: {other.describe()}. Wait for it to "
                f"end, stop it, or give this run another results_dir"
            )
        # The holder is gone (killed before it could release): move its lock aside atomically,
        # so of two runs taking over at once only one succeeds, then take it.
        try:
            os.replace(path, f"{path}.stale")
        except FileNotFoundError:
            continue
        say(f"taking over the lock of {directory}: {other.describe()} is no longer running")
    raise RunLockError(f"could not lock {directory}: other runs keep taking {path}")


def acquire_for_run(directories: list[str], say=print) -> RunLock | None:
    """`acquire` on the main process, agreed by all: with several processes every one raises
    RunLockError if the main one could not lock (the others hold no lock: None)."""
    import jax
    import numpy as np

    from opsd_jax.parallel import distributed

    error, lock = None, None
    if distributed.is_main():
        try:
            lock = acquire(directories, say)
        except RunLockError as e:
            error = e
    if jax.process_count() > 1:
        refused = int(distributed.all_processes(np.int32(error is not None)).max())
        if refused and error is None:
            if lock is not None:
                lock.release()
            raise RunLockError(
                "the main process could not lock the run directory (its message is on its console)"
            )
    if error is not None:
        raise error
    return lock
