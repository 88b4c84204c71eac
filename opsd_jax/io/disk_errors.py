"""The disk's refusals (a full disk, a quota, a read-only or vanished mount) behind whatever
wrapped them, so a run can end on one with one line naming the file and the reason.

Where they come from: Python's own writes raise OSError, a failed write() or flush() without the
file's name (only open() sets it: `naming` adds it); orbax writes arrays through tensorstore,
whose failure is a ValueError with the OS error in its text (`Failed to write 155007 bytes to
file 11: No space left on device [os_error_code='28']`), raised in a background thread and
raised again in the main thread by the next save, wait_until_finished or close, perhaps as the
__cause__ or __context__ of another exception. `os_error_in` finds it in any of these forms.

While orbax abandons a failed save, its threads log the failure with a traceback from each of
them, and tensorstore's late callbacks into the save's closed event loop print more (a hundred
lines for one full disk); `quiet_abandoned_saves` drops those reports, which only repeat the
error the main thread raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator

# tensorstore's report of an OS error: its errno in the text, the files it wrote in quotes
# (absolute paths or URLs; the keys it wrote are quoted too, and may hold a '/').
_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='?(\d+)'?\]")
_QUOTED_PATH = re.compile(r'"((?:/|[a-z][a-z0-9+.-]*://)[^"]*)"')


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError the operating system reported behind `error`: `error` itself, or the nearest
    in its chain of causes and contexts (or an exception group's members); tensorstore's report
    of one as the OSError it describes (errno, message, the file). None if there is none, or
    only OSErrors that no OS call raised (errno None: a message of the project's own)."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop(0)  # breadth first: the outermost, most specific report wins
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        described = _tensorstore_os_error(current)
        if described is not None:
            return described
        pending += [current.__cause__, current.__context__]
        if isinstance(current, BaseExceptionGroup):
            pending += list(current.exceptions)
    return None


def _tensorstore_os_error(error: BaseException) -> OSError | None:
    text = str(error)
    code = _TENSORSTORE_OS_ERROR.search(text)
    if code is None:
        return None
    paths = _QUOTED_PATH.findall(text)
    number = int(code.group(1))
    # The last path quoted is the file whose write failed (the first, the database it is in).
    return OSError(number, os.strerror(number), paths[-1] if paths else None)


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Run the block; an OSError from it that names no file (a failed write() or flush()) is
    raised again naming `path`, the file (or directory) the block writes."""
    try:
        yield
    except OSError as e:
        if e.errno is None or e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, os.fspath(path)) from e


class _DropAbandonedSaveLogs(logging.Filter):
    """orbax's and asyncio's log records of a disk error (the exception they carry is one):
    each of orbax's threads logs the failed save, and asyncio the write futures it dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        from_orbax = f"{os.sep}orbax{os.sep}" in (record.pathname or "")
        if not (from_orbax or record.name == "asyncio") or not record.exc_info:
            return True
        return os_error_in(record.exc_info[1]) is None


def _closed_loop_callback(unraisable) -> bool:
    """tensorstore finishing a write of an abandoned save calls into orbax's event loop for
    that save, closed by then: asyncio's 'Event loop is closed', with no object to name."""
    return (
        unraisable.object is None
        and isinstance(unraisable.exc_value, RuntimeError)
        and str(unraisable.exc_value) == "Event loop is closed"
    )


_quieted = False


def quiet_abandoned_saves() -> None:
    """Drop the background reports of a save that failed on the disk (module docstring): the
    logs of it that orbax's threads and asyncio write, and tensorstore's calls into the closed
    event loop of the abandoned save. The main thread still raises the error itself. Once per
    process; the filters touch nothing else."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    for name in ("absl", "asyncio"):  # orbax logs through absl's logger
        logging.getLogger(name).addFilter(_DropAbandonedSaveLogs())
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not _closed_loop_callback(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
