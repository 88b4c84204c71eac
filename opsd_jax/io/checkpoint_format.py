"""The on-disk format of training checkpoints: items, step directories, arrays and JSON values.

The writing and reading is checkpoint.py's; this module says what is on disk and how it maps
to the caller's pytrees.

Layout: one orbax `CheckpointManager` over `<directory>/<step>/`, each
step holding these items:

* `params`     — the student parameters, as a nested dict of arrays (the layout
                 `nnx.to_pure_dict` gives, so `restore_model_params` / `convert_hf.py` read it too);
* `ema_params` — the teacher parameters when the TrainState has them ('ema' or 'fixed'; the item
                 keeps this name whatever the mode, and `meta` records the mode);
* `opt_state`  — the optax state, as a nested dict of its arrays (masked / empty parts of
                 `multi_transform` + `set_to_zero` hold no arrays and are rebuilt from the target);
* `meta`       — JSON: the step, the rng key as raw key data plus its PRNG implementation (a typed
                 key array does not serialise; its key data round-trips bit for bit), the
                 teacher mode, which items were written, and the identity of the weights a
                 run holds but does not save (a LoRA base, a checkpoint teacher);
* `data`       — JSON: the data-iterator state of every process (absent when there is none);
* `config`     — JSON: the training config.

Why the `data` item is one JSON of every process's state rather than grain's own orbax handler
(one file per process): the iterator state is grain's (`DatasetIterator.get_state`) plus our skip
counters and a pipeline fingerprint, and holding all processes' states in one item lets a resume
on another process count notice it and restart the data instead of failing on missing files.

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
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

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


def epath_of(directory: str | os.PathLike) -> epath.Path:
    text = os.fspath(directory)
    # Local paths are made absolute (orbax wants that); gs:// and similar stay as given.
    return epath.Path(text if "://" in text else os.path.abspath(text))


# orbax's commit-file protocol for every manager here, reading or writing (module docstring).
ATOMICITY = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
# For listing and reading another run's steps (save_interval_steps=0: a read-only manager
# saves nothing, and orbax warns when it has to say so itself).
READ_ONLY = ocp.CheckpointManagerOptions(
    read_only=True, create=False, save_interval_steps=0, atomicity_options=ATOMICITY
)


def complete_steps(root: epath.Path) -> list[int]:
    """The complete steps under `root`, ascending: the step directories orbax's commit-file
    protocol calls finalized (none if there is no directory)."""
    if not root.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in root.iterdir()
        if entry.name.isdigit()
        and ocp.path.step.is_path_finalized(entry, atomicity_options=ATOMICITY)
    )


def _incomplete_names(root: epath.Path, complete: list[int]) -> list[str]:
    """Step-like directories orbax does not list as complete (for messages only)."""
    if not root.is_dir():
        return []
    return sorted(
        entry.name
        for entry in root.iterdir()
        if entry.is_dir()
        and ((entry.name.isdigit() and int(entry.name) not in complete) or TMP_MARKER in entry.name)
    )


def step_dirs(root: epath.Path) -> tuple[list[int], list[str]]:
    """(complete steps ascending, names of incomplete step directories) under `root`."""
    complete = complete_steps(root)
    return complete, _incomplete_names(root, complete)


def _no_checkpoint_error(root: epath.Path) -> FileNotFoundError:
    _, incomplete = step_dirs(root)
    extra = f" (incomplete, ignored: {incomplete})" if incomplete else ""
    if not root.exists():
        return FileNotFoundError(f"checkpoint directory {root} does not exist")
    return FileNotFoundError(f"no complete checkpoint in {root}{extra}")


def _check_step(root: epath.Path, step: int) -> None:
    complete, incomplete = step_dirs(root)
    if step in complete:
        return
    if str(step) in incomplete:
        raise FileNotFoundError(
            f"{root / str(step)} is an incomplete checkpoint (no {COMMIT_MARKER}); "
            f"complete steps: {complete}"
        )
    raise FileNotFoundError(f"{root}: no checkpoint for step {step}; available steps: {complete}")


def looks_like_step(path: epath.Path) -> bool:
    """A `<root>/<step>` directory (complete or not) rather than a checkpoints root."""
    return path.name.isdigit() and any(
        (path / name).exists() for name in (COMMIT_MARKER, "_CHECKPOINT_METADATA", PARAMS, META)
    )


def locate(directory: str | os.PathLike, step: int | None) -> tuple[epath.Path, int]:
    """(checkpoints root, complete step) for a root or a step directory, and an optional step."""
    path = epath_of(directory)
    if looks_like_step(path):
        if step is not None and step != int(path.name):
            raise ValueError(f"step={step} contradicts the step directory {path}")
        root, step = path.parent, int(path.name)
    else:
        root = path
        if step is None:
            complete, _ = step_dirs(root)
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


def key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flat_arrays(tree) -> dict[tuple[str, ...], Any]:
    """{path names: array} of every array in `tree`; an nnx Variable counts as its value.

    Leaves that hold no array (optax's MaskedNode inside a Param, EmptyState, None) are left out:
    they carry nothing to save and the restore target supplies them again.
    """
    flat: dict[tuple[str, ...], Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]:
        value = leaf.get_value() if _is_variable(leaf) else leaf
        if _is_array_like(value):
            names = tuple(key_name(k) for k in path)
            if names in flat:
                raise CheckpointError(f"two leaves map to the same name {'/'.join(names)}")
            flat[names] = value
    return flat


def nest(flat: Mapping[tuple[str, ...], Any]) -> dict:
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


def rebuild(target, restored: Mapping) -> Any:
    """`target`'s tree (same classes, Variables, empty states) with arrays from `restored`."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_variable)
    out = []
    for path, leaf in leaves:
        value = leaf.get_value() if _is_variable(leaf) else leaf
        if not _is_array_like(value):
            out.append(leaf)
            continue
        new = _get(restored, tuple(key_name(k) for k in path))
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


def default_sharding(*trees) -> NamedSharding | None:
    """Replicated on the mesh of the first NamedSharding found in `trees` (for lone scalars)."""
    for tree in trees:
        for leaf in jax.tree.leaves(tree):
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding):
                return NamedSharding(sharding.mesh, PartitionSpec())
    return None


def restore_targets(
    tree, item: str, default: NamedSharding | None
) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """{names: ShapeDtypeStruct with the sharding to restore into} for one item's target."""
    targets, unplaced = {}, []
    for names, leaf in flat_arrays(tree).items():
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


def check_saved(item_dir: epath.Path, targets: Mapping[tuple[str, ...], Any], item: str) -> None:
    """One error naming every missing, unexpected and mis-shaped array of an item."""
    # The item's handler directly: the item directory has no checkpoint-level metadata file
    # for a StandardCheckpointer to read (it would log a warning for each call).
    handler = ocp.StandardCheckpointHandler()
    try:
        tree = handler.metadata(item_dir).tree
    finally:
        handler.close()
    saved = {
        tuple(key_name(k) for k in path): meta
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


def jsonable(value, where: str, strict: bool):
    """Plain JSON types; `strict=False` stores anything else as its str (configs only)."""
    if hasattr(value, "to_dict") and callable(value.to_dict):  # ml_collections.ConfigDict
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, f"{where}.{k}", strict) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]", strict) for i, v in enumerate(value)]
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if strict:
        raise TypeError(f"{where}: {type(value).__name__} is not JSON-serialisable")
    return str(value)


def gather_json(value) -> list:
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


def place_like(value: np.ndarray, like) -> jax.Array:
    """A host value (the same on every process) as an array sharded like `like`."""
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jnp.asarray(value)
    # make_array_from_callback, not device_put: with several processes the sharding spans
    # devices this process cannot address.
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
