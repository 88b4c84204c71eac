"""Writing our params back as a BAGEL / ThinkMorph HF directory, through the hf_layout table.

`save_hf` keeps the source directory's key names, shapes, dtypes and file layout; every tensor
we do not hold is copied byte for byte; the rest of the directory (configs, tokenizer,
`ae.safetensors`, ...) is copied too. It writes into a temporary directory and renames it when
complete, so a failure leaves nothing behind. `restore_for_export` reads the params of a
training checkpoint (or of a params-only export) in the shape the export needs.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.bagel import Bagel
from opsd_jax.io import checkpoint, saved_items
from opsd_jax.io.hf_layout import LLM_CONFIG, HFCheckpointError, Rule, dotted, hf_shape, match_key
from opsd_jax.io.hf_load import open_weights, read_config
from opsd_jax.io.safetensors_io import DTYPES, WEIGHT_STEMS, index_name, write_file
from opsd_jax.parallel import mesh as mesh_lib

# --------------------------------------------------------------------------- saving


def flat_params(params) -> dict[str, Any]:
    """{dotted path: array} from a model, an nnx.State, or a nested dict (e.g. restored)."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params)
    if isinstance(params, nnx.State):
        return {dotted(p): v.get_value() for p, v in nnx.to_flat_state(params)}
    flat = {}

    def visit(prefix, node):
        if isinstance(node, Mapping):
            for name, child in node.items():
                visit(prefix + (str(name),), child)
        elif isinstance(node, nnx.Variable):
            flat[dotted(prefix)] = node.get_value()
        else:
            flat[dotted(prefix)] = node

    visit((), params)
    return flat


@jax.jit
def _take_layer(x: jax.Array, layer: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, layer, axis=0, keepdims=False)


def _host(x, layer: int | None) -> np.ndarray:
    """One layer (or all) of a parameter as a host array, one layer at a time on the host."""
    if isinstance(x, jax.Array):
        if layer is not None:
            x = _take_layer(x, jnp.int32(layer))
        if not x.is_fully_addressable:  # multi-host: gather the pieces other hosts hold
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    x = np.asarray(x)
    return x if layer is None else x[layer]


def _is_weight_file(name: str) -> bool:
    """Files of any BAGEL weight checkpoint (ema / model, single or sharded, and indexes)."""
    return any(
        name == f"{stem}.safetensors"
        or name == index_name(stem)
        or re.fullmatch(rf"{stem}-\d+-of-\d+\.safetensors", name)
        for stem in WEIGHT_STEMS
    )


def _weight_file_names(directory: Path) -> set[str]:
    """The weight files of `directory`: the usual names, and every shard that an index lists.

    An index may name its shards anything (`model_part1.safetensors`); such a shard must not be
    copied as "another file of the directory", or it would land on the shard just exported."""
    names = {entry.name for entry in directory.iterdir() if _is_weight_file(entry.name)}
    for stem in WEIGHT_STEMS:
        try:
            weight_map = json.loads((directory / index_name(stem)).read_text())["weight_map"]
            names |= {str(name) for name in weight_map.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no index of that stem, or not one we could export from: nothing it names
    return names


def save_hf(
    model,
    out_dir: str | os.PathLike,
    source_hf_dir: str | os.PathLike,
    *,
    weights: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Write our params as an HF directory BAGEL's PyTorch loader accepts; returns its path.

    `model` is a Bagel, its nnx.State, or a nested dict of arrays (e.g. restored by
    `restore_for_export`). Every key of the source weights is written under the same name, shape,
    dtype and file: ours (cast to the source dtype) where we hold the parameter, the source's
    bytes otherwise (gen expert of an und-only model, generation-only keys). The other files of
    the source directory are copied, except weight files other than the exported one (stale
    siblings such as a trainer's `model.safetensors` next to `ema.safetensors`). A vocabulary
    grown at load time is written grown, with `vocab_size` updated in llm_config.json.
    """
    source_dir, out_dir = Path(source_hf_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists (pass overwrite=True to replace it)")
    if out_dir.resolve() == source_dir.resolve():
        raise ValueError(f"save_hf: the output {out_dir} is the source directory")
    params = flat_params(model)
    config = read_config(source_dir)
    files = open_weights(source_dir, weights)

    # Plan every key first, so a mismatch raises before anything is written.
    source_vocab = config.llm.vocab_size
    our_vocab = source_vocab
    if "language_model.embed_tokens" in params:
        our_vocab = int(params["language_model.embed_tokens"].shape[0])
    if our_vocab < source_vocab:
        raise HFCheckpointError(
            f"our vocabulary ({our_vocab}) is smaller than the source's "
            f"({source_vocab}); a table is never shrunk"
        )
    entries: dict[str, list] = {file.path.name: [] for file in files.files}
    used, wrong = set(), []
    layers_written: dict[str, set[int]] = {}  # per stacked parameter, the layers a key takes
    for key in files.keys():
        info = files.info(key)
        matched = match_key(key)
        rule, layer = matched if matched else (None, None)
        out_shape = info.shape
        if rule is not None and rule.target in params:
            value = params[rule.target]
            out_shape = hf_shape(rule, tuple(value.shape))
            # The source's shape: ours, except along a vocabulary that was grown at load time.
            grown = rule.vocab_axis is not None and our_vocab != source_vocab
            source_shape = hf_shape(rule, tuple(value.shape), source_vocab if grown else None)
            if layer is not None and layer >= value.shape[0]:
                wrong.append(f"{key}: we hold {value.shape[0]} layers of {rule.target}")
            elif source_shape != info.shape:
                wrong.append(f"{key}: ours gives {list(out_shape)}, source is {list(info.shape)}")
            used.add(rule.target)
            if layer is not None:
                layers_written.setdefault(rule.target, set()).add(layer)
            produce = _ours_producer(value, rule, layer, DTYPES[info.dtype])
        else:
            produce = lambda key=key: files.raw(key)  # noqa: E731
        entries[files.file_of[key].path.name].append((key, info.dtype, out_shape, produce))
    # A source with fewer layers than ours would drop the rest of our layers: one line per
    # (ours, the source's) layer count, naming the first parameter of each.
    short: dict[tuple[int, int], list[str]] = {}
    for target, layers in sorted(layers_written.items()):
        if len(layers) < params[target].shape[0]:
            short.setdefault((int(params[target].shape[0]), len(layers)), []).append(target)
    for (ours, theirs), targets in short.items():
        wrong.append(
            f"{targets[0]} and {len(targets) - 1} more stacked parameters: we hold {ours} "
            f"layers, the source has keys for {theirs}"
        )
    # Any parameter we hold must land somewhere; only the recomputable table may be absent.
    unwritten = [path for path in params if path not in used and path != "vit_pos_embed"]
    if wrong or unwritten:
        lines = [f"save_hf: our params do not fit {source_dir}:"]
        lines += [f"  {item}" for item in wrong]
        lines += [f"  {path}: no key for it in the source checkpoint" for path in unwritten]
        raise HFCheckpointError("\n".join(lines))

    writer = jax.process_index() == 0
    if writer:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    total = sum(files.info(k).nbytes for k in files.keys())
    bar = None
    if progress and writer:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="jax -> hf", unit="B", unit_scale=True)
    tmp = (
        Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        if writer
        else None
    )
    if tmp is not None:
        # mkdtemp makes it private (0700); it becomes the user's export directory, so give it
        # the mode a plain mkdir would (the umask's).
        tmp.chmod(0o777 & ~_umask())
    try:
        for file in files.files:
            items = [
                (key, dtype, shape, _counted(produce, bar))
                for key, dtype, shape, produce in entries[file.path.name]
            ]
            if writer:
                write_file(tmp / file.path.name, items, file.metadata)
            else:  # other hosts only take part in the gathers
                for *_, produce in items:
                    produce()
        if not writer:
            return out_dir
        if files.index is not None:
            index = dict(files.index)
            total_size = sum(
                math.prod(shape) * DTYPES[dtype].itemsize
                for items in entries.values()
                for _, dtype, shape, _ in items
            )
            index["metadata"] = {**dict(index.get("metadata") or {}), "total_size": total_size}
            _write_json(tmp / index_name(files.stem), index)
        # The rest of the source directory, never over a file this export has written.
        skipped = _weight_file_names(source_dir) | {entry.name for entry in tmp.iterdir()}
        for entry in sorted(source_dir.iterdir()):
            if entry.name.startswith(".") or entry.name in skipped:
                continue
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
            else:
                shutil.copy2(entry, tmp / entry.name)
        if our_vocab != source_vocab:
            llm_json = json.loads((source_dir / LLM_CONFIG).read_text())
            llm_json["vocab_size"] = our_vocab
            _write_json(tmp / LLM_CONFIG, llm_json)
        if out_dir.exists():  # overwrite: swap in the new directory, then drop the old one
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return out_dir


def _umask() -> int:
    mask = os.umask(0o022)  # the umask can only be read by setting it: set it straight back
    os.umask(mask)
    return mask


def _ours_producer(value, rule: Rule, layer: int | None, dtype: np.dtype):
    def produce():
        return np.asarray(rule.transform.to_hf(_host(value, layer)), dtype=dtype)

    return produce


def _counted(produce, bar):
    if bar is None:
        return produce

    def wrapped():
        data = produce()
        bar.update(data.nbytes)
        return data

    return wrapped


def _write_json(path: Path, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------- trained params


def restore_for_export(
    ckpt: str | os.PathLike,
    source_hf_dir: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    *,
    which: str = checkpoint.PARAMS,
    rules=mesh_lib.LOGICAL_RULES,
) -> dict[str, jax.Array]:
    """{dotted path: array} of a checkpoint's `which` params ('params' / 'ema_params'), sharded
    like the model on `mesh` (one device when None), ready for `save_hf`.

    `ckpt` is a training step, a checkpoints root (its latest complete step) or a params-only
    export (`saved_items.save_model_params`). Whether the gen expert was trained and a vocabulary
    grown at load time are read from the saved shapes; the restore itself is the checkpoint
    module's.
    """
    shapes = saved_items.saved_param_shapes(ckpt, which=which)
    changes: dict[str, Any] = {
        "build_gen_expert": any(p.startswith("language_model.layers.gen.") for p in shapes)
    }
    if "language_model.embed_tokens" in shapes:
        changes["vocab_size"] = int(shapes["language_model.embed_tokens"][0])
    config = read_config(source_hf_dir, llm=changes)
    if mesh is None:
        mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    make_model = lambda: Bagel(config, rngs=nnx.Rngs(0))  # noqa: E731
    _, abstract_state = mesh_lib.abstract_model(make_model, mesh, rules)
    params = saved_items.restore_model_params(
        ckpt, nnx.filter_state(abstract_state, nnx.Param), which=which
    )
    return flat_params(params)
