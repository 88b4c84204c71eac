"""Loading a BAGEL / ThinkMorph HF directory into a sharded Bagel, through the hf_layout table.

`load_hf` builds the model abstractly (shapes and target shardings, no memory), checks the
whole checkpoint against it first (one error lists every missing, unexpected, mis-shaped or
non-float key), then creates each parameter straight in its sharding. Each device's shard is
cut from zero-copy memmap views of the files (`jax.make_array_from_callback`), so the host never
holds an unsharded copy of the model; transient host memory is about one device shard of the
parameter being placed.

One module of a little over 400 lines: the check of a whole directory against the abstract model
and the sharded placement read the same table and the same file views, and are read together.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.bagel import Bagel, sincos_2d_table
from models.configs import BagelConfig
from opsd_jax.io.hf_layout import (
    GEN_EXPERT,
    GENERATION,
    LLM_CONFIG,
    RULE_BY_TARGET,
    VISION,
    VIT_CONFIG,
    VOCAB_MULTIPLE,
    HFCheckpointError,
    Rule,
    dotted,
    hf_shape,
    match_key,
    num_layers,
)
from opsd_jax.io.safetensors_io import (
    FLOAT_DTYPES,
    WEIGHT_STEMS,
    SafetensorsError,
    WeightDirectory,
    present_stems,
)
from opsd_jax.io.tokenizer import BagelTokenizer, load_tokenizer
from opsd_jax.parallel import mesh as mesh_lib

# --------------------------------------------------------------------------- checking


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """Which HF key fills which (layer of which) parameter; what is skipped or defaulted."""

    sources: dict[str, dict[int | None, str]]  # target path -> {layer or None: HF key}
    defaulted: tuple[str, ...]  # optional targets absent from the checkpoint
    skipped: tuple[str, ...]  # known HF keys this model does not load


def plan_load(
    header: Mapping[str, tuple[tuple[int, ...], str]],
    targets: Mapping[str, tuple[int, ...]],
    config: BagelConfig,
    *,
    source_vocab: int | None = None,
    where: str = "checkpoint",
) -> LoadPlan:
    """Match a checkpoint header {key: (shape, dtype)} to our parameter shapes {path: shape}.

    Raises one HFCheckpointError listing every missing, unexpected, mis-shaped and non-float
    key. `source_vocab` is the checkpoint's vocabulary when our table was grown beyond it.
    """
    sources: dict[str, dict[int | None, str]] = {}
    skipped, unexpected, wrong_shape, wrong_dtype = [], [], [], []
    for key, (shape, dtype) in header.items():
        matched = match_key(key)
        if matched is None:
            unexpected.append(f"{key} {list(shape)} (no mapping rule)")
            continue
        rule, layer = matched
        if layer is not None and layer >= num_layers(rule, config):
            unexpected.append(
                f"{key} (layer {layer}; the config has {num_layers(rule, config)} layers)"
            )
            continue
        if rule.target is None or rule.target not in targets:
            # Generation-only keys, the gen expert of an und-only model, or the vision tower
            # of a visual_und=False model: known, not loaded. Anything else is a table bug.
            if rule.group in (GENERATION, GEN_EXPERT) or (
                rule.group == VISION and not config.visual_und
            ):
                skipped.append(key)
            else:
                unexpected.append(f"{key} (maps to {rule.target}, which the model lacks)")
            continue
        expected = hf_shape(rule, tuple(targets[rule.target]), source_vocab)
        if tuple(shape) != expected:
            wrong_shape.append(f"{key} is {list(shape)}, expected {list(expected)}")
        elif dtype not in FLOAT_DTYPES:
            wrong_dtype.append(f"{key} is {dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
        sources.setdefault(rule.target, {})[layer] = key

    missing, defaulted, unmapped = [], [], []
    for target, target_shape in targets.items():
        rule = RULE_BY_TARGET.get(target)
        if rule is None:
            unmapped.append(target)
            continue
        layers = range(target_shape[0]) if rule.per_layer else [None]
        absent = [layer for layer in layers if layer not in sources.get(target, {})]
        if absent and not rule.required and len(absent) == len(layers):
            defaulted.append(target)
            continue
        for layer in absent:
            expected = hf_shape(rule, tuple(target_shape), source_vocab)
            missing.append(f"{rule.key(layer)} expected {list(expected)}")

    problems = [
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("wrong shapes", wrong_shape),
        ("wrong dtypes", wrong_dtype),
        ("model parameters without a mapping rule (a bug in opsd_jax/io/hf_layout.py)", unmapped),
    ]
    if any(items for _, items in problems):
        lines = [f"{where} does not match the model its configs describe:"]
        for title, items in problems:
            if items:
                lines.append(f"  {title} ({len(items)}):")
                lines.extend(f"    {item}" for item in items)
        raise HFCheckpointError("\n".join(lines))
    return LoadPlan(sources, tuple(defaulted), tuple(skipped))


# --------------------------------------------------------------------------- loading


def read_config(hf_dir: str | os.PathLike, **changes) -> BagelConfig:
    """The BagelConfig of a checkpoint directory (upstream loader overrides applied)."""
    hf_dir = Path(hf_dir)
    absent = [name for name in (LLM_CONFIG, VIT_CONFIG) if not (hf_dir / name).is_file()]
    if absent:
        raise HFCheckpointError(f"{hf_dir}: missing model config file(s): {', '.join(absent)}")
    return BagelConfig.from_hf_json(hf_dir / LLM_CONFIG, hf_dir / VIT_CONFIG, **changes)


def open_weights(hf_dir: Path, weights: str | None) -> WeightDirectory:
    try:
        return WeightDirectory(hf_dir, weights)
    except SafetensorsError as e:
        raise HFCheckpointError(str(e)) from None


# "random": no weights file is read; the model of the directory's configs, randomly initialised
# (`random_model`): a benchmark at real shapes without writing or reading gigabytes.
RANDOM_WEIGHTS = "random"
WEIGHT_CHOICES = ("auto",) + WEIGHT_STEMS + (RANDOM_WEIGHTS,)


@dataclasses.dataclass(frozen=True)
class InitialWeights:
    """Which weights file (stem: "ema" / "model") each copy of the model starts from."""

    student: str
    ema_teacher: str
    fixed_teacher: str


def initial_weights(
    hf_dir: str | os.PathLike, weights: str = "auto", *, finetune_from_ema: bool = False
) -> InitialWeights:
    """The files a training run starts its student, EMA teacher and fixed teacher from.

    `weights="auto"` does what the PyTorch Visual-OPSD launcher does with an HF directory
    (train_visual_opsd.py and FSDPCheckpoint.try_load_ckpt in train/fsdp_utils.py): the student
    from `model.safetensors` (`ema.safetensors` with `finetune_from_ema`), the EMA teacher from
    `ema.safetensors` (the student's file when there is none), the fixed teacher from
    `model.safetensors` (try_load_ckpt with resume_from_ema=False, whatever finetune_from_ema
    says). Where the launcher would fail on a missing `model.safetensors` (BAGEL's release ships
    only `ema.safetensors`), the one file present starts every copy. `weights="ema"` or
    `"model"` starts every copy from that file.
    """
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights={weights!r}; allowed: {', '.join(map(repr, WEIGHT_CHOICES))}")
    if weights != "auto":
        if finetune_from_ema and weights != "ema":
            raise HFCheckpointError(
                f"finetune_from_ema=True starts the student from the EMA "
                f"weights, but weights={weights!r}; use 'auto' or 'ema'"
            )
        open_weights(Path(hf_dir), weights)  # it must exist
        return InitialWeights(weights, weights, weights)
    present = present_stems(hf_dir)
    if not present:
        open_weights(Path(hf_dir), None)  # raises: no weights found
    if finetune_from_ema and "ema" not in present:
        raise HFCheckpointError(
            f"{hf_dir}: finetune_from_ema=True starts the student from "
            f"ema.safetensors, which is not there (found: {present})"
        )
    model_file = "model" if "model" in present else present[0]
    return InitialWeights(
        student="ema" if finetune_from_ema else model_file,
        ema_teacher="ema" if "ema" in present else model_file,
        fixed_teacher=model_file,
    )


def _header(files: WeightDirectory) -> dict[str, tuple[tuple[int, ...], str]]:
    return {key: (info.shape, info.dtype) for key, info in files.header().items()}


def grown_vocab(config: BagelConfig, tokenizer: BagelTokenizer | None) -> int:
    """The table size needed once the tokenizer's added tokens have rows (never shrinks)."""
    rows = config.llm.vocab_size
    if tokenizer is None or tokenizer.vocab_length <= rows:
        return rows
    return -(-tokenizer.vocab_length // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def load_hf(
    hf_dir: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    dtype: Any = jnp.float32,
    *,
    build_gen_expert: bool = False,
    config_changes: Mapping[str, Any] | None = None,
    weights: str | None = None,
    tokenizer: bool = True,
    rules=mesh_lib.LOGICAL_RULES,
    progress: bool = False,
    read_params: bool = True,
) -> tuple[Bagel, BagelConfig, BagelTokenizer | None]:
    """Build a Bagel from a BAGEL / ThinkMorph directory: (model, config, tokenizer).

    * `mesh`: parameters are created in their target shardings on it (logical `rules`);
      None puts them on the default device.
    * `dtype`: parameter dtype (fp32 master copies by default; bf16 sources convert exactly).
    * `build_gen_expert`: also load the `*_moe_gen` weights (skipped otherwise).
    * `config_changes`: BagelConfig.replace arguments for runtime fields, e.g.
      `{"llm": {"compute_dtype": "float32", "remat": "none"}}`.
    * `weights`: "ema" or "model" (default: `ema.safetensors` if present, else `model.*`).
    * `tokenizer`: load the tokenizer (BAGEL's special-token rule). When it had to add tokens
      beyond the embedding table, the table grows (rows = the mean of the existing rows).
    * `read_params=False`: the nnx.Params stay abstract (ShapeDtypeStructs with their target
      shardings, no memory: a checkpoint restore fills them); only the small non-trainable
      state (the ViT position table) is read. A resumed run never reads the weights twice.

    Nothing is placed on a device until the whole checkpoint has been checked.
    """
    hf_dir = Path(hf_dir)
    changes = dict(config_changes or {})
    changes["llm"] = {**dict(changes.get("llm", {})), "build_gen_expert": build_gen_expert}
    config = read_config(hf_dir, **changes)
    open_weights(hf_dir, weights)  # a missing weights file is named before the tokenizer loads
    bagel_tokenizer = load_tokenizer(hf_dir) if tokenizer else None
    grown = grown_vocab(config, bagel_tokenizer)
    if grown != config.llm.vocab_size:
        config = config.replace(llm=dict(vocab_size=grown))
    graphdef, state = load_weights(
        hf_dir,
        config,
        weights=weights,
        mesh=mesh,
        dtype=dtype,
        rules=rules,
        progress=progress,
        read_params=read_params,
    )
    return nnx.merge(graphdef, state), config, bagel_tokenizer


def random_model(
    hf_dir: str | os.PathLike,
    mesh: jax.sharding.Mesh,
    seed: int,
    *,
    config_changes: Mapping[str, Any] | None = None,
    rules=mesh_lib.LOGICAL_RULES,
) -> tuple[Bagel, BagelConfig, BagelTokenizer]:
    """(model, config, tokenizer) as `load_hf` gives them, the weights randomly initialised
    from `seed` in their shardings on `mesh` (no device holds the whole model), no weights file
    read: the directory needs its two config files and the tokenizer only."""
    hf_dir = Path(hf_dir)
    changes = dict(config_changes or {})
    changes["llm"] = {**dict(changes.get("llm", {})), "build_gen_expert": False}
    config = read_config(hf_dir, **changes)
    tokenizer = load_tokenizer(hf_dir)
    grown = grown_vocab(config, tokenizer)
    if grown != config.llm.vocab_size:
        config = config.replace(llm=dict(vocab_size=grown))
    model = mesh_lib.create_sharded_model(lambda: Bagel(config, rngs=nnx.Rngs(seed)), mesh, rules)
    return model, config, tokenizer


def load_weights(
    hf_dir: str | os.PathLike,
    config: BagelConfig,
    *,
    weights: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    dtype: Any = jnp.float32,
    rules=mesh_lib.LOGICAL_RULES,
    progress: bool = False,
    read_params: bool = True,
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of a Bagel built from `config`, filled from one weights file of `hf_dir`.

    `config` is the model to build, e.g. the one `load_hf` returned (its vocabulary may have been
    grown past the checkpoint's; the extra rows start at the mean row). This is how a second copy
    of the same model is read from another file of the directory (an EMA teacher from
    `ema.safetensors` next to the student's `model.safetensors`). `read_params` as in load_hf.
    """
    hf_dir = Path(hf_dir)
    files = open_weights(hf_dir, weights)
    source_vocab = read_config(hf_dir).llm.vocab_size
    grown = config.llm.vocab_size
    if grown < source_vocab:
        raise HFCheckpointError(
            f"{hf_dir}: the model's vocabulary ({grown}) is smaller than the "
            f"checkpoint's ({source_vocab}); a table is never shrunk"
        )

    make_model = lambda: Bagel(config, rngs=nnx.Rngs(0))  # noqa: E731
    if mesh is None:
        graphdef, abstract_state = nnx.split(nnx.eval_shape(make_model))
        default_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        graphdef, abstract_state = mesh_lib.abstract_model(make_model, mesh, rules)
        default_sharding = None
    flat_state = nnx.to_flat_state(abstract_state)
    abstract = {dotted(p): v.get_value() for p, v in flat_state}
    skipped = (
        set() if read_params else {dotted(p) for p, v in flat_state if isinstance(v, nnx.Param)}
    )
    plan = plan_load(
        _header(files),
        {path: spec.shape for path, spec in abstract.items()},
        config,
        source_vocab=source_vocab if grown != source_vocab else None,
        where=f"{hf_dir} ({files.stem} weights)",
    )

    values = {}
    targets = sorted(abstract)
    bar = _progress(targets, progress, "hf -> jax", "param")
    for path in bar:
        spec = abstract[path]
        sharding = default_sharding or spec.sharding
        if path in skipped:
            values[path] = jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sharding)
            continue
        rule = RULE_BY_TARGET[path]
        if path in plan.defaulted:
            host = _default_value(path, config)
            values[path] = _place(spec.shape, sharding, dtype, lambda layer, host=host: host, False)
            continue
        keys = plan.sources[path]
        layer_shape = tuple(spec.shape[1:] if rule.per_layer else spec.shape)
        if rule.vocab_axis is not None and grown != source_vocab:
            host = _grow_vocab(rule, files.array(keys[None]), layer_shape, source_vocab)
            read = lambda layer, host=host: host  # noqa: E731
        else:

            def read(layer, rule=rule, keys=keys, layer_shape=layer_shape):
                return rule.transform.to_ours(files.array(keys[layer]), layer_shape)

        values[path] = _place(spec.shape, sharding, dtype, read, rule.per_layer)
    nnx.replace_by_pure_dict(abstract_state, _nest(values))
    return graphdef, abstract_state


def _grow_vocab(rule: Rule, hf: np.ndarray, shape: tuple[int, ...], source_rows: int):
    """A vocabulary table in our layout with rows appended up to `shape` (one host copy)."""
    source_shape = list(shape)
    source_shape[rule.vocab_axis] = source_rows
    x = rule.transform.to_ours(hf, tuple(source_shape))
    # New tokens start at the mean embedding (transformers' resize default), so their logits
    # stay in the range of the trained ones.
    mean = x.astype(np.float64).mean(axis=rule.vocab_axis, keepdims=True).astype(np.float32)
    extra = np.repeat(mean, shape[rule.vocab_axis] - source_rows, axis=rule.vocab_axis)
    return np.concatenate([x.astype(np.float32), extra], axis=rule.vocab_axis)


def _default_value(path: str, config: BagelConfig) -> np.ndarray:
    if path == "vit_pos_embed":
        return sincos_2d_table(config.vit_max_num_patch_per_side, config.llm.hidden_size)
    raise AssertionError(f"no default value for optional parameter {path}")


def _place(shape, sharding, dtype, read: Callable[[int | None], np.ndarray], per_layer: bool):
    """A jax.Array in `sharding` whose shards are cut from `read(layer)` views, shard by shard."""
    np_dtype = np.dtype(jnp.dtype(dtype))

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if not per_layer:
            return np.array(read(None)[index], dtype=np_dtype)
        layers = range(shape[0])[index[0]]
        rest = index[1:]
        out = None
        for row, layer in enumerate(layers):
            piece = read(layer)[rest]
            if out is None:
                out = np.empty((len(layers),) + piece.shape, np_dtype)
            out[row] = piece
        return out

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def _nest(flat: Mapping[str, Any]) -> dict:
    nested: dict = {}
    for path, value in flat.items():
        node = nested
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _progress(items, enabled: bool, desc: str, unit: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit=unit)
