"""One run per directory: a lock file naming its holder, taken before any compute.

Why: two runs on one `results_dir` would both resume from its checkpoints and write the same
step numbers, metrics and TensorBoard events, each silently overwriting the other. A run
therefore holds its directories (results_dir, and checkpoint_dir too: each by its own lock, so
a run whose checkpoint_dir is another run's `<results_dir>/checkpoints` meets that run there)
for its lifetime: `acquire` writes `<dir>/run.lock` with O_EXCL (host, process id, the
process's start, the time and the command), and a second run refuses with one line naming the
holder.

The lock is released when the run ends (normally, on an error, on Ctrl-C: `release`, also at
interpreter exit), and a directory the lock made goes again if the run left it empty. A run
killed with SIGKILL leaves its lock behind; the next run on the same host sees that the process
is gone (its id is not running, or runs a process started after the lock was written: a reused
id) and takes the lock over, saying so; of several runs taking over the same dead holder's lock
at once exactly one wins (`_take_over`). A lock written on another host cannot be checked from
here: the message says which host and process to check, and that deleting the file releases it.
With several processes (hosts) only the main one takes the lock of the shared directory, and
all of them stop if it is refused (`acquire_for_run`).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import socket
import sys
import time

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
        # The directories `acquire` made: removed again if the run left them empty, so a run
        # refused after its lock (a bad data file) leaves no empty checkpoints/ behind.
        self.created: list[str] = []
        atexit.register(self.release)

    def release(self) -> None:
        for path in reversed(self.paths):
            if _read(path) == self.holder:  # never remove a lock another run took over
                _remove_if_present(path)
        for directory in reversed(self.created):  # checkpoints/ before the results_dir holding it
            try:
                os.rmdir(directory)  # only an empty one
            except OSError:
                pass
        self.paths, self.created = [], []


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
            if not os.path.isdir(directory):
                lock.created.append(directory)
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
    for _ in range(3):  # a lost race with other runs taking the same lock
        try:
            if _take(path, holder):
                return path
        except FileNotFoundError:  # a run that ended removed the directory it had made, just now
            os.makedirs(directory, exist_ok=True)
            continue
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
        # The holder is gone (killed before it could release): take its lock over, unless
        # another run was first (then the next round sees that run's lock and refuses).
        if _take_over(path, other, holder):
            say(f"taking over the lock of {directory}: {other.describe()} is no longer running")
            return path
    raise RunLockError(f"could not lock {directory}: other runs keep taking {path}")


def _take_over(path: str, dead: Holder, holder: Holder) -> bool:
    """Replace the lock file of `dead` (checked not running) by this run's; False when another
    run was first (it took the lock over, or created it once free): the caller looks again.

    Why a claim: removing the file and creating ours are two steps, and a second run that read
    the same dead holder a moment earlier would otherwise remove (or move aside) the lock the
    first one had just written, and both would hold the directory. So a run first claims the
    takeover of this one dead holder by creating `<lock>.takeover-<pid>-<start>` (named after
    `dead`) with O_EXCL, the lock's own primitive: at most one run holds the claim at a time,
    and under it the lock file is read again and removed only if it still names `dead`. Nothing
    else can change that file in between: only a claimant of `dead` removes `dead`'s lock,
    `dead` itself never runs again, and a new lock is only ever created where none exists. A
    run that claims later finds the winner's lock there and is refused like any second run.
    """
    claim = f"{path}.takeover-{dead.pid}-{dead.process_start}"
    if not _take(claim, holder):
        claimant = _read(claim)
        if claimant is not None and not _running(claimant.pid, claimant.process_start):
            if _read(path) == dead:  # the claimant was killed between its claim and the removal
                raise RunLockError(
                    f"{path} names {dead.describe()}, which is no longer running, and a "
                    f"takeover of it by {claimant.describe()} was interrupted: if no run uses "
                    f"{os.path.dirname(path)}, delete {path} and {claim}"
                )
        time.sleep(0.1)  # another run takes it over right now (a few file operations): look again
        return False
    try:
        if _read(path) != dead:
            return False
        os.remove(path)
        return _take(path, holder)  # False: a new run took the free name first
    finally:
        _remove_if_present(claim)


def _remove_if_present(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


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
