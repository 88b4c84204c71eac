"""Training checkpoints: the TrainState, the data-iterator state and the config, with orbax.

Layout (DESIGN.md, Checkpoints): one orbax `CheckpointManager` over `<directory>/<step>/`, each
step holding these items:

* `params`     — the student parameters, as a nested dict of arrays (the layout
                 `nnx.to_pure_dict` gives, so `restore_model_params` / `convert_hf.py` read it too);
* `ema_params` — the teacher parameters when the TrainState has them ('ema' or 'fixed'; the item
                 keeps this name whatever the mode, and `meta` records the mode);
* `opt_state`  — the optax state, as a nested dict of its arrays (masked / empty parts of
                 `multi_transform` + `set_to_zero` hold no arrays and are rebuilt from the target);
* `meta`       — JSON: the step, the rng key as raw key data plus its PRNG implementation (a typed
                 key array does not serialise; its key data round-trips bit for bit), the
                 teacher mode and which items were written;
* `data`       — JSON: the data-iterator state of every process (absent when there is none);
* `config`     — JSON: the training config.

Why nested dicts instead of the nnx / optax objects themselves: the on-disk format then depends
only on parameter paths, and restore rebuilds exactly the tree structure of the caller's target
(nnx.State with Params, optax namedtuples, MaskedNode / EmptyState), so a checkpoint never
carries Python class details.

Completeness is orbax's: the managers here run its commit-file protocol
(`AtomicityMode.COMMIT_FILE`), so orbax writes a step in place and puts `commit_success.txt` in it
last, and orbax's finalization check under that protocol decides which step directories count, on
a local disk and an object store alike. Neither a half-written save nor a partially copied step
directory is ever restored, and a restarted run's manager removes the half-written ones.

Restore places every array straight into the sharding its target (a TrainState of
`jax.ShapeDtypeStruct`s carrying concrete `NamedSharding`s) names, so a run may resume on a
different mesh shape than the one that saved it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from opsd_jax.parallel.distributed import to_host
from opsd_jax.training.train_step import TrainState

log = logging.getLogger(__name__)

PARAMS = "params"
EMA_PARAMS = "ema_params"
OPT_STATE = "opt_state"
META = "meta"
DATA = "data"
CONFIG = "config"
# orbax 0.12.8's marker of a finished step (orbax/checkpoint/_src/path/atomicity_types.py).
COMMIT_MARKER = "commit_success.txt"  # for messages; orbax itself decides completeness
TMP_MARKER = ".orbax-checkpoint-tmp"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that does not fit the state it is restored into."""


# --------------------------------------------------------------------------- directory layout


def _path(directory: str | os.PathLike) -> epath.Path:
    text = os.fspath(directory)
    # Local paths are made absolute (orbax wants that); gs:// and similar stay as given.
    return epath.Path(text if "://" in text else os.path.abspath(text))


# orbax's commit-file protocol for every manager here, reading or writing (module docstring).
ATOMICITY = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
# For listing and reading another run's steps (save_interval_steps=0: a read-only manager
# saves nothing, and orbax warns when it has to say so itself).
_READ_ONLY = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                          atomicity_options=ATOMICITY)  # fmt: skip


def _complete_steps(root: epath.Path) -> list[int]:
    """The complete steps under `root`, ascending: the step directories orbax's commit-file
    protocol calls finalized (none if there is no directory)."""
    if not root.is_dir():
        return []
    return sorted(int(entry.name) for entry in root.iterdir() if entry.name.isdigit()
                  and ocp.path.step.is_path_finalized(entry, atomicity_options=ATOMICITY))


def _incomplete_names(root: epath.Path, complete: list[int]) -> list[str]:
    """Step-like directories orbax does not list as complete (for messages only)."""
    if not root.is_dir():
        return []
    return sorted(entry.name for entry in root.iterdir() if entry.is_dir() and (
        (entry.name.isdigit() and int(entry.name) not in complete) or TMP_MARKER in entry.name))


def _step_dirs(root: epath.Path) -> tuple[list[int], list[str]]:
    """(complete steps ascending, names of incomplete step directories) under `root`."""
    complete = _complete_steps(root)
    return complete, _incomplete_names(root, complete)


def _no_checkpoint_error(root: epath.Path) -> FileNotFoundError:
    _, incomplete = _step_dirs(root)
    extra = f" (incomplete, ignored: {incomplete})" if incomplete else ""
    if not root.exists():
        return FileNotFoundError(f"checkpoint directory {root} does not exist")
    return FileNotFoundError(f"no complete checkpoint in {root}{extra}")


def _check_step(root: epath.Path, step: int) -> None:
    complete, incomplete = _step_dirs(root)
    if step in complete:
        return
    if str(step) in incomplete:
        raise FileNotFoundError(
            f"{root / str(step)} is an incomplete checkpoint (no {COMMIT_MARKER}); "
            f"complete steps: {complete}"
        )
    raise FileNotFoundError(f"{root}: no checkpoint for step {step}; available steps: {complete}")


def _looks_like_step(path: epath.Path) -> bool:
    """A `<root>/<step>` directory (complete or not) rather than a checkpoints root."""
    return path.name.isdigit() and any(
        (path / name).exists() for name in (COMMIT_MARKER, "_CHECKPOINT_METADATA", PARAMS, META)
    )


def _locate(directory: str | os.PathLike, step: int | None) -> tuple[epath.Path, int]:
    """(checkpoints root, complete step) for a root or a step directory, and an optional step."""
    path = _path(directory)
    if _looks_like_step(path):
        if step is not None and step != int(path.name):
            raise ValueError(f"step={step} contradicts the step directory {path}")
        root, step = path.parent, int(path.name)
    else:
        root = path
        if step is None:
            complete, _ = _step_dirs(root)
            if not complete:
                raise _no_checkpoint_error(root)
            step = complete[-1]
    _check_step(root, step)
    return root, step


# --------------------------------------------------------------------------- pytrees <-> dicts


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _is_array_like(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flat_arrays(tree) -> dict[tuple[str, ...], Any]:
    """{path names: array} of every array in `tree`; an nnx Variable counts as its value.

    Leaves that hold no array (optax's MaskedNode inside a Param, EmptyState, None) are left out:
    they carry nothing to save and the restore target supplies them again.
    """
    flat: dict[tuple[str, ...], Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]:
        value = leaf.get_value() if _is_variable(leaf) else leaf
        if _is_array_like(value):
            names = tuple(_key_name(k) for k in path)
            if names in flat:
                raise CheckpointError(f"two leaves map to the same name {'/'.join(names)}")
            flat[names] = value
    return flat


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict:
    nested: dict = {}
    for names, value in flat.items():
        node = nested
        for part in names[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"{'/'.join(names)}: a leaf is also a subtree")
        node[names[-1]] = value
    return nested


def _get(tree, names: tuple[str, ...]):
    for part in names:
        tree = tree[part]
    return tree


def _rebuild(target, restored: Mapping) -> Any:
    """`target`'s tree (same classes, Variables, empty states) with arrays from `restored`."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_variable)
    out = []
    for path, leaf in leaves:
        value = leaf.get_value() if _is_variable(leaf) else leaf
        if not _is_array_like(value):
            out.append(leaf)
            continue
        new = _get(restored, tuple(_key_name(k) for k in path))
        if _is_variable(leaf):  # same Variable class and metadata, new value
            new = jax.tree_util.tree_unflatten(jax.tree.structure(leaf), [new])
        out.append(new)
    return jax.tree_util.tree_unflatten(treedef, out)


def abstract_like(tree):
    """`tree` as ShapeDtypeStructs carrying each array's sharding: a restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


def _default_sharding(*trees) -> NamedSharding | None:
    """Replicated on the mesh of the first NamedSharding found in `trees` (for lone scalars)."""
    for tree in trees:
        for leaf in jax.tree.leaves(tree):
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding):
                return NamedSharding(sharding.mesh, PartitionSpec())
    return None


def _restore_targets(
    tree, item: str, default: NamedSharding | None
) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """{names: ShapeDtypeStruct with the sharding to restore into} for one item's target."""
    targets, unplaced = {}, []
    for names, leaf in _flat_arrays(tree).items():
        sharding = getattr(leaf, "sharding", None)
        if sharding is None and len(leaf.shape) == 0 and default is not None:
            sharding = default  # a scalar (e.g. an optimizer count): replicate it
        if sharding is None:
            unplaced.append("/".join(names))
        targets[names] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    if unplaced:
        raise CheckpointError(
            f"restore target {item!r}: these leaves carry no sharding, so their placement is "
            f"unknown (build the target with concrete NamedShardings, e.g. abstract_like(state) "
            f"or mesh.abstract_model): {unplaced[:10]}{' ...' if len(unplaced) > 10 else ''}"
        )
    return targets


def _check_saved(item_dir: epath.Path, targets: Mapping[tuple[str, ...], Any], item: str) -> None:
    """One error naming every missing, unexpected and mis-shaped array of an item."""
    # The item's handler directly: the item directory has no checkpoint-level metadata file
    # for a StandardCheckpointer to read (it would log a warning for each call).
    handler = ocp.StandardCheckpointHandler()
    try:
        tree = handler.metadata(item_dir).tree
    finally:
        handler.close()
    saved = {
        tuple(_key_name(k) for k in path): meta
        for path, meta in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    missing = [n for n in targets if n not in saved]
    unexpected = [n for n in saved if n not in targets]
    shapes = [
        f"{'/'.join(n)}: saved {tuple(saved[n].shape)}, target {tuple(targets[n].shape)}"
        for n in targets
        if n in saved and tuple(saved[n].shape) != tuple(targets[n].shape)
    ]
    if not (missing or unexpected or shapes):
        return
    lines = [f"checkpoint item {item_dir} does not fit the {item!r} restore target:"]
    for label, entries in (
        ("missing in the checkpoint", ["/".join(n) for n in missing]),
        ("in the checkpoint, not in the target", ["/".join(n) for n in unexpected]),
        ("shape mismatch", shapes),
    ):
        if entries:
            more = f" ... ({len(entries)} in all)" if len(entries) > 10 else ""
            lines.append(f"  {label}: {entries[:10]}{more}")
    raise CheckpointError("\n".join(lines))


# --------------------------------------------------------------------------- JSON values


def _jsonable(value, where: str, strict: bool):
    """Plain JSON types; `strict=False` stores anything else as its str (configs only)."""
    if hasattr(value, "to_dict") and callable(value.to_dict):  # ml_collections.ConfigDict
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, f"{where}.{k}", strict) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]", strict) for i, v in enumerate(value)]
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if strict:
        raise TypeError(f"{where}: {type(value).__name__} is not JSON-serialisable")
    return str(value)


def _gather_json(value) -> list:
    """Every process's JSON value, in process order (each host iterates its own data slice)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([raw.size], np.int64)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(rows, sizes.reshape(-1))]


def _place(value: np.ndarray, like) -> jax.Array:
    """A host value (the same on every process) as an array sharded like `like`."""
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jnp.asarray(value)
    # make_array_from_callback, not device_put: with several processes the sharding spans
    # devices this process cannot address.
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


# --------------------------------------------------------------------------- the checkpointer


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
        self.directory = _path(directory)
        self.save_every = int(save_every)
        _, incomplete = _step_dirs(self.directory)
        if incomplete:
            log.warning("%s: incomplete checkpoints (an interrupted save), never restored and "
                        "removed now: %s", self.directory, incomplete)  # fmt: skip
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            atomicity_options=ATOMICITY,
            # Half-written steps of a crashed run would otherwise linger forever.
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

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
    ) -> bool:
        """Save at a periodic step, or any step with `force`; False if not saved (not a save
        step, or this step is already saved or being saved, e.g. a final save just after a
        periodic one)."""
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        if step in self._manager.all_steps():
            return False
        config_json = _jsonable(config, "config", strict=False)
        teacher_mode = config_json.get("teacher_mode") if isinstance(config_json, dict) else None
        rng = None
        if state.rng is not None:
            rng = {
                "impl": str(jax.random.key_impl(state.rng)),
                "key_data": to_host(jax.random.key_data(state.rng)).tolist(),
            }
        items = {
            PARAMS: ocp.args.StandardSave(_nest(_flat_arrays(state.params))),
            OPT_STATE: ocp.args.StandardSave(_nest(_flat_arrays(state.opt_state))),
        }
        if state.teacher_params is not None:
            items[EMA_PARAMS] = ocp.args.StandardSave(_nest(_flat_arrays(state.teacher_params)))
        meta = {
            "format_version": FORMAT_VERSION,
            "step": int(to_host(state.step)),
            "rng": rng,
            "teacher_mode": teacher_mode,
            "items": sorted(items) + [META, CONFIG] + ([DATA] if data_state is not None else []),
        }
        items[META] = ocp.args.JsonSave(meta)
        items[CONFIG] = ocp.args.JsonSave(config_json)
        if data_state is not None:
            states = _gather_json(_jsonable(data_state, "data_state", strict=True))
            items[DATA] = ocp.args.JsonSave({"process_count": len(states), "states": states})
        # force=True: the save decision is ours (should_save), not orbax's interval policy.
        return bool(self._manager.save(step, args=ocp.args.Composite(**items), force=True))

    def latest_step(self) -> int | None:
        """The newest complete step on disk (in-flight and half-written saves do not count)."""
        complete = self.all_steps()
        return complete[-1] if complete else None

    def all_steps(self) -> list[int]:
        """Complete steps on disk, ascending. Read from the disk: the manager's own list also
        holds the step it is saving right now."""
        return _complete_steps(self.directory)

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
        root, step = _locate(self.directory if directory is None else directory, step)
        step_dir = root / str(step)
        default = _default_sharding(abstract_state)
        trees = {PARAMS: abstract_state.params, OPT_STATE: abstract_state.opt_state}
        if abstract_state.teacher_params is not None:
            if not (step_dir / EMA_PARAMS).is_dir():
                raise CheckpointError(
                    f"{step_dir} has no {EMA_PARAMS!r} item (saved without a teacher copy), "
                    f"but the restore target has teacher params; resume with the model only "
                    f"or the 'self' teacher"
                )
            trees[EMA_PARAMS] = abstract_state.teacher_params
        targets = {name: _restore_targets(tree, name, default) for name, tree in trees.items()}
        for name, flat in targets.items():
            _check_saved(step_dir / name, flat, name)
        items = {name: ocp.args.StandardRestore(_nest(flat)) for name, flat in targets.items()}
        items[META] = ocp.args.JsonRestore()
        items[CONFIG] = ocp.args.JsonRestore()
        has_data = (step_dir / DATA).is_dir()
        if has_data:
            items[DATA] = ocp.args.JsonRestore()

        if root == self.directory:
            self._manager.reload()  # steps written by another process since we started
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        else:
            with ocp.CheckpointManager(root, options=_READ_ONLY) as manager:
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
                _place(data, abstract_state.rng), impl=meta["rng"]["impl"]
            )
        state = TrainState(
            step=_place(np.asarray(meta["step"], abstract_state.step.dtype), abstract_state.step),
            params=_rebuild(abstract_state.params, restored[PARAMS]),
            opt_state=_rebuild(abstract_state.opt_state, restored[OPT_STATE]),
            teacher_params=(
                None
                if abstract_state.teacher_params is None
                else _rebuild(abstract_state.teacher_params, restored[EMA_PARAMS])
            ),
            rng=rng,
            # Not saved: a restarted run counts consecutive non-finite steps afresh.
            bad_steps=_place(np.zeros((), np.int32), abstract_state.bad_steps),
        )
        data_state = _own_data_state(restored[DATA], step_dir) if has_data else None
        return state, data_state, restored[CONFIG]

    def wait_until_finished(self) -> None:
        """Block until the in-flight async save (if any) is fully written and committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

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
            step_dir, len(states), jax.process_count(),
        )  # fmt: skip
        return None
    return states[jax.process_index()]


# --------------------------------------------------------------------------- params only


def _params_item_dir(path: str | os.PathLike, which: str) -> epath.Path:
    """The `which` item directory of a step, of a root's latest complete step, or of a
    params-only export (`save_model_params`)."""
    if which not in (PARAMS, EMA_PARAMS):
        raise ValueError(f"which={which!r}; allowed: {(PARAMS, EMA_PARAMS)}")
    source = _path(path)
    if (source / which).is_dir() and not _looks_like_step(source):
        return source / which  # not a training step (e.g. a params-only export)
    root, step = _locate(source, None)
    step_dir = root / str(step)
    if not (step_dir / which).is_dir():
        present = sorted(p.name for p in step_dir.iterdir() if p.is_dir())
        raise FileNotFoundError(f"{step_dir} has no {which!r} item; it holds {present}")
    return step_dir / which


def saved_param_shapes(path: str | os.PathLike, *, which: str = PARAMS) -> dict[str, tuple]:
    """{dotted parameter path: shape} of a params item, read from its metadata (no arrays), so
    a caller can build the model that fits it (gen expert or not, a grown vocabulary)."""
    handler = ocp.StandardCheckpointHandler()
    try:
        tree = handler.metadata(_params_item_dir(path, which)).tree
    finally:
        handler.close()
    return {
        ".".join(_key_name(k) for k in names): tuple(meta.shape)
        for names, meta in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def restore_model_params(path: str | os.PathLike, abstract_params, *, which: str = PARAMS):
    """Just the `which` item ('params' or 'ema_params') of a checkpoint, onto the shardings of
    `abstract_params` and in its tree structure (e.g. an nnx.State of Params).

    `path` is a step directory, a checkpoints root (its latest complete step is used), or a
    params-only export. For resume_model_only / finetune_from_ema, where the optimizer and data
    state start afresh, and for exporting trained params to HF.
    """
    item_dir = _params_item_dir(path, which)
    flat = _restore_targets(abstract_params, which, _default_sharding(abstract_params))
    _check_saved(item_dir, flat, which)
    handler = ocp.StandardCheckpointHandler()
    try:
        restored = handler.restore(item_dir, args=ocp.args.StandardRestore(_nest(flat)))
    finally:
        handler.close()
    return _rebuild(abstract_params, restored)


def save_model_params(params, directory: str | os.PathLike, *, which: str = PARAMS) -> epath.Path:
    """`params` (an nnx.State of Params, or a nested dict of arrays) as a params-only export
    `<directory>/<which>`, in the layout of a training step's item: `restore_model_params` and
    `saved_param_shapes` read both alike."""
    item_dir = _path(directory) / which
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(item_dir, _nest(_flat_arrays(params)))
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()
    return item_dir


def step_dir_of(path: str | os.PathLike) -> str:
    """The complete step directory a user means by `path`: a step directory itself, else the
    latest complete step of `path` or of its `checkpoints/` folder (a run directory)."""
    source = _path(path)
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint {source}: no such directory")
    run_checkpoints = source / "checkpoints"
    if not _looks_like_step(source) and not _step_dirs(source)[0] and run_checkpoints.is_dir():
        source = run_checkpoints
    root, step = _locate(source, None)
    return os.fspath(root / str(step))


def saved_config(path: str | os.PathLike) -> dict | None:
    """The training config saved with a checkpoint step (or a root's latest complete step)."""
    root, step = _locate(path, None)
    if not (root / str(step) / CONFIG).is_dir():
        return None
    handler = ocp.JsonCheckpointHandler()
    try:
        return handler.restore(root / str(step) / CONFIG)
    finally:
        handler.close()


def saved_teacher_mode(path: str | os.PathLike) -> str | None:
    """The teacher_mode a checkpoint (a step directory or a checkpoints root: its latest complete
    step) was saved with, from its meta item; None when it is not known."""
    root, step = _locate(path, None)
    handler = ocp.JsonCheckpointHandler()
    try:
        meta = handler.restore(root / str(step) / META)
    finally:
        handler.close()
    return meta.get("teacher_mode") if isinstance(meta, dict) else None
