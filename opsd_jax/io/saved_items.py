"""One item of a saved step, read or written outside a training run: the params (or the EMA
params) for evaluation, HF export and `resume_model_only`, their shapes, a params-only export,
and the config and meta items a resume or an evaluation asks about.

The training run itself saves and restores whole steps through `checkpoint.Checkpointer`; what
is on disk is checkpoint_format.py's docstring. Every read here takes a step directory or a
checkpoints root (its latest complete step), so an incomplete step is never read.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from etils import epath

from opsd_jax.io.checkpoint_format import (
    CONFIG,
    EMA_PARAMS,
    META,
    PARAMS,
    check_saved,
    default_sharding,
    epath_of,
    flat_arrays,
    key_name,
    locate,
    looks_like_step,
    nest,
    rebuild,
    restore_targets,
    step_dirs,
)


def _params_item_dir(path: str | os.PathLike, which: str) -> epath.Path:
    """The `which` item directory of a step, of a root's latest complete step, or of a
    params-only export (`save_model_params`)."""
    if which not in (PARAMS, EMA_PARAMS):
        raise ValueError(f"which={which!r}; allowed: {(PARAMS, EMA_PARAMS)}")
    source = epath_of(path)
    if (source / which).is_dir() and not looks_like_step(source):
        return source / which  # not a training step (e.g. a params-only export)
    root, step = locate(source, None)
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
        ".".join(key_name(k) for k in names): tuple(meta.shape)
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
    flat = restore_targets(abstract_params, which, default_sharding(abstract_params))
    check_saved(item_dir, flat, which)
    handler = ocp.StandardCheckpointHandler()
    try:
        restored = handler.restore(item_dir, args=ocp.args.StandardRestore(nest(flat)))
    finally:
        handler.close()
    return rebuild(abstract_params, restored)


def save_model_params(params, directory: str | os.PathLike, *, which: str = PARAMS) -> epath.Path:
    """`params` (an nnx.State of Params, or a nested dict of arrays) as a params-only export
    `<directory>/<which>`, in the layout of a training step's item: `restore_model_params` and
    `saved_param_shapes` read both alike."""
    item_dir = epath_of(directory) / which
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(item_dir, nest(flat_arrays(params)))
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()
    return item_dir


def step_dir_of(path: str | os.PathLike) -> str:
    """The complete step directory a user means by `path`: a step directory itself, else the
    latest complete step of `path` or of its `checkpoints/` folder (a run directory)."""
    source = epath_of(path)
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint {source}: no such directory")
    run_checkpoints = source / "checkpoints"
    if not looks_like_step(source) and not step_dirs(source)[0] and run_checkpoints.is_dir():
        source = run_checkpoints
    root, step = locate(source, None)
    return os.fspath(root / str(step))


def _json_item(path: str | os.PathLike, item: str):
    """One JSON item of a step directory (or of a root's latest complete step); None if absent."""
    root, step = locate(path, None)
    item_dir = root / str(step) / item
    if not item_dir.is_dir():
        return None
    handler = ocp.JsonCheckpointHandler()
    try:
        return handler.restore(item_dir)
    finally:
        handler.close()


def saved_config(path: str | os.PathLike) -> dict | None:
    """The training config saved with a checkpoint step (or a root's latest complete step)."""
    return _json_item(path, CONFIG)


def saved_lora_base(path: str | os.PathLike) -> dict | None:
    """The base weights a LoRA checkpoint's adapters apply to (weights_digest.identity, from
    its meta item); None for a full fine-tuning checkpoint."""
    meta = _json_item(path, META)
    return meta.get("lora_base") if isinstance(meta, dict) else None


def saved_teacher_checkpoints(path: str | os.PathLike) -> list[dict]:
    """The identities (weights_digest.identity) of the teachers a checkpoint's run read from
    other checkpoints (teacher_mode='checkpoint', or teacher_by_source's paths); [] for none.
    A checkpoint of the one-teacher format has its `teacher_checkpoint`."""
    meta = _json_item(path, META)
    if not isinstance(meta, dict):
        return []
    if "teacher_checkpoints" in meta:
        return list(meta["teacher_checkpoints"])
    one = meta.get("teacher_checkpoint")
    return [one] if one else []


def saved_teacher_mode(path: str | os.PathLike) -> str | None:
    """The teacher_mode a checkpoint (a step directory or a checkpoints root: its latest complete
    step) was saved with, from its meta item; None when it is not known."""
    meta = _json_item(path, META)
    return meta.get("teacher_mode") if isinstance(meta, dict) else None
