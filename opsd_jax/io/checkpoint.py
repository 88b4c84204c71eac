"""Training checkpoints with orbax: the TrainState, the data-iterator state and the config,
saved and restored as whole steps by the run (`Checkpointer`). One item read or written outside
a run (params for evaluation, HF export and resume_model_only; the config and meta items) is
saved_items.py.

What is on disk, and why, is checkpoint_format.py's docstring: one orbax CheckpointManager over
`<directory>/<step>/` with the items params, ema_params, opt_state, meta, data and config, each
step complete only once orbax's commit-file protocol has committed it. A save the disk refuses
(full, read-only) raises `CheckpointWriteError` naming the file, the reason and the step, from
`save` (of the save before it, still being written), `wait_until_finished` or `close`: that
step is incomplete, never restored, and the steps saved before it are untouched (orbax prunes
old steps only once a new one is committed).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Self

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry

from opsd_jax.io import disk_errors
from opsd_jax.io.checkpoint_format import (
    ATOMICITY,
    COMMIT_MARKER,
    CONFIG,
    DATA,
    EMA_PARAMS,
    FORMAT_VERSION,
    META,
    OPT_STATE,
    PARAMS,
    READ_ONLY,
    TMP_MARKER,
    CheckpointError,
    abstract_like,
    check_saved,
    complete_steps,
    default_sharding,
    epath_of,
    flat_arrays,
    gather_json,
    jsonable,
    locate,
    nest,
    place_like,
    rebuild,
    restore_targets,
    step_dirs,
)
from opsd_jax.parallel.distributed import to_host

# The state saved and restored: opsd_jax/training/train_step.TrainState (a flax struct with
# step, params, opt_state, teacher_params, rng, bad_steps). Not imported: io sits below training
# in the package's layers (pyproject.toml [tool.importlinter]); restore builds the result with
# the target's own `replace`, so any struct with those fields works.
TrainState = Any

log = logging.getLogger(__name__)

# What callers use from the format along with the checkpointer.
__all__ = [
    "COMMIT_MARKER",
    "EMA_PARAMS",
    "PARAMS",
    "TMP_MARKER",
    "CheckpointError",
    "CheckpointWriteError",
    "Checkpointer",
    "abstract_like",
]

# orbax's replica-parallel save, only for arrays worth splitting. By default orbax writes each
# array held by R replicas as R slices, one per replica, whatever its size; every slice is a
# jitted program of its own (a shape and a device), compiled at the first save. On an 8-device
# CPU mesh (2 replicas x 4 shards) the smoke run's first save compiled 86 of the run's 98
# programs this way, all for arrays of a few KB whose write time no split can shorten. Arrays
# whose slice per replica is under this size are written whole by one replica; a 7B
# run's sharded weights (MBs per replica) still split.
MIN_REPLICA_SLICE_BYTES = 1 << 20
type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
    jax.Array,
    ocp.type_handlers.ArrayHandler(
        # The metadata store orbax's default handler has (orbax exports no name for it).
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
    ),
    override=True,
    # Replacing the default is the point: orbax would log a warning on every start (on
    # stderr, where a config error must be train.py's one line).
    ignore_warnings=True,
)

# --------------------------------------------------------------------------- the checkpointer


class CheckpointWriteError(OSError):
    """A checkpoint save the disk refused (full, read-only, gone): `step` was not saved (its
    directory is incomplete: never restored, removed at the next start); the OS error's errno
    and message, and the file it was writing (else the step's directory)."""

    def __init__(self, step: int | None, error: OSError, directory: epath.Path):
        where = error.filename or os.fspath(directory if step is None else directory / str(step))
        super().__init__(error.errno, error.strerror, where)
        self.step = step


def _step_of(path: str | None, root: epath.Path) -> int | None:
    """The step whose directory under `root` holds `path` (None if it is not in one)."""
    if not path:
        return None
    relative = os.path.relpath(os.path.abspath(path), os.fspath(root))
    first = relative.split(os.sep)[0]
    return int(first) if first.isdigit() else None


class Checkpointer:
    """Periodic, asynchronous, pruned checkpoints of a TrainState under `directory`.

    Every process calls `save` at the same steps (orbax and the data-state gather are
    collective). `save` returns once the arrays are copied off the devices, so the caller may
    donate the state to the next step right away; the files are written in the background.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int,
        max_to_keep: int = 3,
        async_save: bool = True,
    ):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = epath_of(directory)
        self.save_every = int(save_every)
        _, incomplete = step_dirs(self.directory)
        if incomplete:
            log.warning(
                "%s: incomplete checkpoints (an interrupted save), never restored and "
                "removed now: %s",
                self.directory,
                incomplete,
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            atomicity_options=ATOMICITY,
            # Half-written steps of a crashed run would otherwise linger forever.
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        # orbax removes those steps on a thread of its own and waits for it only in its first
        # save: a run that ends before that (a bad model file) could exit while it runs, and the
        # interpreter's shutdown then stops it with a traceback. A directory scan: wait here.
        self._manager._maybe_await_cleanup_tmp_directory()
        self._unconfirmed = None  # the step saved last, until a wait confirms it is written
        self._refused = None  # the CheckpointWriteError of a save the disk refused, once raised

    def should_save(self, step: int) -> bool:
        """Whether `step` is a periodic save step (save_every <= 0: never)."""
        return self.save_every > 0 and step % self.save_every == 0

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        data_state: dict | None,
        config: Mapping | Any,
        force: bool = False,
        lora_base: Mapping | None = None,
        teachers: Sequence[Mapping] = (),
        teacher_mode: str | None = None,
    ) -> bool:
        """Save at a periodic step, or any step with `force`; False if not saved (not a save
        step, or this step is already saved or being saved, e.g. a final save just after a
        periodic one). A LoRA state's frozen `base` is not saved: `lora_base` names the weights
        it is (weights_digest.identity), kept in the meta item for a resume to compare; so are
        the checkpoint teachers' (`teachers`: their `teacher_weights` are not saved either).
        `teacher_mode`: what the state keeps for its teacher (TrainedSplit.teacher; the
        config's teacher_mode when not given)."""
        step = int(step)
        if self._refused is not None:  # orbax saves no more after a failed save
            raise self._refused
        if not (force or self.should_save(step)):
            return False
        if step in self._manager.all_steps():
            return False
        config_json = jsonable(config, "config", strict=False)
        if teacher_mode is None and isinstance(config_json, dict):
            teacher_mode = config_json.get("teacher_mode")
        rng = None
        if state.rng is not None:
            rng = {
                "impl": str(jax.random.key_impl(state.rng)),
                "key_data": to_host(jax.random.key_data(state.rng)).tolist(),
            }
        items = {
            PARAMS: ocp.args.StandardSave(nest(flat_arrays(state.params))),
            OPT_STATE: ocp.args.StandardSave(nest(flat_arrays(state.opt_state))),
        }
        if state.teacher_params is not None:
            items[EMA_PARAMS] = ocp.args.StandardSave(nest(flat_arrays(state.teacher_params)))
        meta = {
            "format_version": FORMAT_VERSION,
            "step": int(to_host(state.step)),
            # The non-finite steps in a row so far: a resumed run stops where this one would.
            "bad_steps": 0 if state.bad_steps is None else int(to_host(state.bad_steps)),
            "rng": rng,
            "teacher_mode": teacher_mode,
            "lora_base": None if lora_base is None else dict(lora_base),
            "teacher_checkpoints": [dict(t) for t in teachers],
            "items": sorted(items) + [META, CONFIG] + ([DATA] if data_state is not None else []),
        }
        items[META] = ocp.args.JsonSave(meta)
        items[CONFIG] = ocp.args.JsonSave(config_json)
        if data_state is not None:
            states = gather_json(jsonable(data_state, "data_state", strict=True))
            items[DATA] = ocp.args.JsonSave({"process_count": len(states), "states": states})
        # force=True: the save decision is ours (should_save), not orbax's interval policy.
        # orbax first waits for the save before this one: its failure is raised here.
        saved = False
        with self._refusals_named(self._unconfirmed or step):
            saved = bool(self._manager.save(step, args=ocp.args.Composite(**items), force=True))
        if saved:
            self._unconfirmed = step
        return saved

    def latest_step(self) -> int | None:
        """The newest complete step on disk (in-flight and half-written saves do not count)."""
        complete = self.all_steps()
        return complete[-1] if complete else None

    def all_steps(self) -> list[int]:
        """Complete steps on disk, ascending. Read from the disk: the manager's own list also
        holds the step it is saving right now."""
        return complete_steps(self.directory)

    def restore(
        self,
        abstract_state: TrainState,
        step: int | None = None,
        directory: str | os.PathLike | None = None,
    ) -> tuple[TrainState, dict | None, dict]:
        """(state, data_state or None, config) of `step` (default: the latest complete one).

        `abstract_state` is a TrainState of ShapeDtypeStructs (or arrays) whose shardings say
        where every restored array goes; its tree structure is the one returned. `directory`
        (a checkpoints root or one step directory of it) reads another run's checkpoints.
        """
        self.wait_until_finished()
        root, step = locate(self.directory if directory is None else directory, step)
        step_dir = root / str(step)
        default = default_sharding(abstract_state)
        trees = {PARAMS: abstract_state.params, OPT_STATE: abstract_state.opt_state}
        if abstract_state.teacher_params is not None:
            if not (step_dir / EMA_PARAMS).is_dir():
                raise CheckpointError(
                    f"{step_dir} has no {EMA_PARAMS!r} item (saved without a teacher copy), "
                    f"but the restore target has teacher params; resume with the model only "
                    f"or the 'self' teacher"
                )
            trees[EMA_PARAMS] = abstract_state.teacher_params
        targets = {name: restore_targets(tree, name, default) for name, tree in trees.items()}
        for name, flat in targets.items():
            check_saved(step_dir / name, flat, name)
        items = {name: ocp.args.StandardRestore(nest(flat)) for name, flat in targets.items()}
        items[META] = ocp.args.JsonRestore()
        items[CONFIG] = ocp.args.JsonRestore()
        has_data = (step_dir / DATA).is_dir()
        if has_data:
            items[DATA] = ocp.args.JsonRestore()

        if root == self.directory:
            self._manager.reload()  # steps written by another process since we started
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        else:
            with ocp.CheckpointManager(root, options=READ_ONLY) as manager:
                restored = manager.restore(step, args=ocp.args.Composite(**items))

        meta = restored[META]
        rng = None
        if abstract_state.rng is not None:
            if meta.get("rng") is None:
                raise CheckpointError(f"{step_dir}: saved without an rng key")
            data = np.asarray(meta["rng"]["key_data"], np.uint32)
            key = jax.random.wrap_key_data(data, impl=meta["rng"]["impl"])
            if key.dtype != abstract_state.rng.dtype or key.shape != abstract_state.rng.shape:
                raise CheckpointError(
                    f"{step_dir}: saved rng key is {key.dtype}{list(key.shape)}, the target "
                    f"wants {abstract_state.rng.dtype}{list(abstract_state.rng.shape)}"
                )
            # The raw key data is placed (replicated like the target), then wrapped on device.
            rng = jax.random.wrap_key_data(
                place_like(data, abstract_state.rng), impl=meta["rng"]["impl"]
            )
        state = abstract_state.replace(
            step=place_like(
                np.asarray(meta["step"], abstract_state.step.dtype), abstract_state.step
            ),
            params=rebuild(abstract_state.params, restored[PARAMS]),
            opt_state=rebuild(abstract_state.opt_state, restored[OPT_STATE]),
            teacher_params=(
                None
                if abstract_state.teacher_params is None
                else rebuild(abstract_state.teacher_params, restored[EMA_PARAMS])
            ),
            rng=rng,
            # Absent from checkpoints written before 2026-12-07: counted afresh from 0.
            bad_steps=place_like(
                np.asarray(meta.get("bad_steps", 0), np.int32), abstract_state.bad_steps
            ),
        )
        data_state = _own_data_state(restored[DATA], step_dir) if has_data else None
        return state, data_state, restored[CONFIG]

    def wait_until_finished(self) -> None:
        """Block until the in-flight async save (if any) is fully written and committed."""
        with self._refusals_named(self._unconfirmed):
            self._manager.wait_until_finished()
        self._unconfirmed = None

    def close(self) -> None:
        try:
            self.wait_until_finished()
        finally:
            with self._refusals_named(self._unconfirmed):
                self._manager.close()

    @contextlib.contextmanager
    def _refusals_named(self, step: int | None) -> Iterator[None]:
        """A disk error of orbax's (a tensorstore or OSError, perhaps wrapped) raised from the
        block as a CheckpointWriteError of the step it was writing: the step of the failed
        file's directory, else `step`. orbax holds a report of the failure from each of its
        threads that met it and raises one per call: once one is raised, the others are
        dropped. Any other error is raised as it is."""
        try:
            yield
        except Exception as e:
            error = disk_errors.os_error_in(e)
            if error is None:
                raise
            if self._refused is not None:
                return  # another report of the failed save, raised already
            self._unconfirmed = None
            # orbax abandoned the failed save's write coroutines: collected now they close
            # quietly; left to the interpreter's exit, each prints a traceback.
            gc.collect()
            failed = _step_of(error.filename, self.directory)
            self._refused = CheckpointWriteError(
                step if failed is None else failed, error, self.directory
            )
            raise self._refused from e

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _own_data_state(saved: Mapping, step_dir: epath.Path) -> dict | None:
    """This process's iterator state; None (data restarts) if the process count changed."""
    states = saved["states"]
    if len(states) != jax.process_count():
        log.warning(
            "%s: data state saved by %d processes, now %d; the data iterator starts afresh",
            step_dir,
            len(states),
            jax.process_count(),
        )
        return None
    return states[jax.process_index()]
