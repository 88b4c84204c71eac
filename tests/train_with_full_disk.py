"""train.py on a disk that fills while a checkpoint step is saved (a test helper, not a test
module).

    OPSD_FULL_DISK_STEP=2 python tests/train_with_full_disk.py --config ...

Runs train.py's own `run` unchanged; only the files orbax writes through etils (the JSON items,
the step's metadata) into the directory of step OPSD_FULL_DISK_STEP fail as a full disk fails
them: part of the text is written, then the write raises OSError(ENOSPC) naming no file (only
open() names its file). orbax writes them in its background save thread, so train.py meets the
error where it meets a real one: at the next save, wait_until_finished or close. Every other
write, of that step's arrays (tensorstore) and of every other step, goes to the disk. Kept out
of the product: train.py has no fault-injection hook.
"""

import errno
import os

from absl import app
from etils import epath

import train
from opsd_jax import run_config

_local_path = type(epath.Path("/"))  # etils' class of local paths, whose write_text orbax calls
_real_write_text = _local_path.write_text


def _write_text_on_a_full_disk(self, data, *args, **kwargs):
    step = os.environ["OPSD_FULL_DISK_STEP"]
    if f"{os.sep}checkpoints{os.sep}{step}{os.sep}" not in os.fspath(self):
        return _real_write_text(self, data, *args, **kwargs)
    _real_write_text(self, data[: len(data) // 2], *args, **kwargs)
    print(f"[full disk] {self}", flush=True)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


if __name__ == "__main__":
    if not os.environ.get("OPSD_FULL_DISK_STEP"):  # else plain train.py: a test would prove nothing
        raise SystemExit("OPSD_FULL_DISK_STEP is empty: give the step whose save fills the disk")
    _local_path.write_text = _write_text_on_a_full_disk
    app.run(train.run, flags_parser=run_config.parse_flags)
