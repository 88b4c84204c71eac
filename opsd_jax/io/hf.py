"""BAGEL / ThinkMorph HF checkpoint directories <-> our params, driven by one key-mapping table.

A directory holds `llm_config.json`, `vit_config.json`, the weights (`ema.safetensors` for
BAGEL, `model.safetensors` for ThinkMorph, either possibly sharded with an index json) and the
Qwen2 tokenizer files (bagel_spec.md §8).

`MAPPING` is the conversion as data. Each row names an HF key template (`{layer}` marks a
per-layer key), the parameter path in our model, and the transform between the two layouts:

* `LINEAR`: a torch Linear weight [out, in] <-> our kernel [in..., out...] (transpose, then
  split the output features into (heads, head_dim) where our kernel has them);
* `LINEAR_FROM_HEADS`: the same for o_proj / out_proj, whose *input* features are (heads,
  head_dim);
* `FLAT`: a bias [heads*head_dim] <-> [heads, head_dim]; `IDENTITY` for everything else.

Per-layer keys fill one row of our stacked [layers, ...] parameters. Generation-only keys
(`latent_pos_embed`, `vae2llm`, `llm2vae`, `time_embedder`) have no module here; they are
recognised, never loaded, and copied unchanged on export. The gen expert (`*_moe_gen`) is
loaded only into a model built with `build_gen_expert=True`, and copied unchanged otherwise.

`load_hf` builds the model abstractly (shapes and target shardings, no memory), checks the
whole checkpoint against it first (one error lists every missing, unexpected, mis-shaped or
non-float key), then creates each parameter straight in its sharding. Each device's shard is
cut from zero-copy memmap views of the files (`jax.make_array_from_callback`), so the host never
holds an unsharded copy of the model; transient host memory is about one device shard of the
parameter being placed.

`save_hf` goes back: same key names, shapes, dtypes and file layout as the source directory;
every tensor we do not hold is copied byte for byte; the rest of the directory (configs,
tokenizer, `ae.safetensors`, ...) is copied too. It writes into a temporary directory and
renames it when complete, so a failure leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.bagel import Bagel, sincos_2d_table
from models.configs import BagelConfig
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.io.safetensors_io import (
    DTYPES,
    FLOAT_DTYPES,
    WEIGHT_STEMS,
    SafetensorsError,
    WeightDirectory,
    index_name,
    present_stems,
    write_file,
)
from opsd_jax.io.tokenizer import BagelTokenizer, load_tokenizer

LLM_CONFIG = "llm_config.json"
VIT_CONFIG = "vit_config.json"
# FLUX VAE latent channels (bagel_spec.md §1.4) and the time embedder's sinusoid width (§9):
# they fix the shapes of the generation-only keys, which no config field carries.
LATENT_CHANNELS = 16
TIMESTEP_FEATURES = 256
# A vocabulary grown for added special tokens is rounded up to this many rows, so the vocab
# axis still divides a tensor-parallel mesh axis (Qwen2.5's 152064 = 1188 * 128).
VOCAB_MULTIPLE = 128


class HFCheckpointError(ValueError):
    """A checkpoint directory that does not match the model its configs describe."""


# --------------------------------------------------------------------------- transforms


@dataclasses.dataclass(frozen=True)
class Linear:
    """torch Linear weight [prod(out), prod(in)] <-> our kernel [*in, *out].

    `in_axes` is how many leading axes of our kernel are input features: 1 for q/k/v/MLP
    kernels [D, (H, Dh) or F], 2 for o_proj's [H, Dh, D].
    """

    in_axes: int = 1

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(ours[self.in_axes :]), math.prod(ours[: self.in_axes]))

    def to_ours(self, hf: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        return hf.T.reshape(ours)  # a view for every layout in the table (no copy)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.hf_shape(x.shape)[::-1]).T


@dataclasses.dataclass(frozen=True)
class Reshape:
    """Same values, HF stores them flat (`flat=True`: a bias [H*Dh] <-> [H, Dh]) or as ours."""

    flat: bool = False

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(ours),) if self.flat else tuple(ours)

    def to_ours(self, hf: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        return hf.reshape(ours)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.hf_shape(x.shape))


LINEAR = Linear(in_axes=1)
LINEAR_FROM_HEADS = Linear(in_axes=2)
FLAT = Reshape(flat=True)
IDENTITY = Reshape(flat=False)


# --------------------------------------------------------------------------- the table

# Groups decide what a model built from a given config loads.
LANGUAGE, VISION, GEN_EXPERT, GENERATION = "language", "vision", "gen_expert", "generation"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF key (or one per layer) <-> one of our parameters."""

    hf_key: str  # template; "{layer}" = one key per layer, stacked on our leading axis
    target: str | None  # our parameter path; None = no module here (generation-only)
    transform: Linear | Reshape | None
    group: str
    required: bool = True  # False: load when present, else keep the model's computed value
    vocab_axis: int | None = None  # our axis that indexes the vocabulary (may be grown)
    hf_shape_of: Callable[[BagelConfig], tuple[int, ...]] | None = None  # target-less keys

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf_key

    @functools.cached_property
    def pattern(self) -> re.Pattern:
        # Layer numbers without leading zeros, so every key has exactly one spelling.
        regex = re.escape(self.hf_key).replace(r"\{layer\}", r"(?P<layer>0|[1-9][0-9]*)")
        return re.compile(regex)

    def key(self, layer: int | None = None) -> str:
        return self.hf_key.format(layer=layer) if self.per_layer else self.hf_key


_LM_LAYER = "language_model.model.layers.{layer}."
_VIT = "vit_model.vision_model."
_VIT_LAYER = _VIT + "encoder.layers.{layer}."

# One MoT decoder layer: (und key, gen-expert key, our leaf under layers.und / layers.gen).
_DECODER_LAYER = (
    ("input_layernorm.weight", "input_layernorm_moe_gen.weight", "input_layernorm.scale", IDENTITY),
    ("self_attn.q_proj.weight", "self_attn.q_proj_moe_gen.weight", "q_proj.kernel", LINEAR),
    ("self_attn.q_proj.bias", "self_attn.q_proj_moe_gen.bias", "q_proj.bias", FLAT),
    ("self_attn.k_proj.weight", "self_attn.k_proj_moe_gen.weight", "k_proj.kernel", LINEAR),
    ("self_attn.k_proj.bias", "self_attn.k_proj_moe_gen.bias", "k_proj.bias", FLAT),
    ("self_attn.v_proj.weight", "self_attn.v_proj_moe_gen.weight", "v_proj.kernel", LINEAR),
    ("self_attn.v_proj.bias", "self_attn.v_proj_moe_gen.bias", "v_proj.bias", FLAT),
    ("self_attn.o_proj.weight", "self_attn.o_proj_moe_gen.weight", "o_proj.kernel",
     LINEAR_FROM_HEADS),
    ("self_attn.q_norm.weight", "self_attn.q_norm_moe_gen.weight", "q_norm.scale", IDENTITY),
    ("self_attn.k_norm.weight", "self_attn.k_norm_moe_gen.weight", "k_norm.scale", IDENTITY),
    ("post_attention_layernorm.weight", "post_attention_layernorm_moe_gen.weight",
     "post_attention_layernorm.scale", IDENTITY),
    ("mlp.gate_proj.weight", "mlp_moe_gen.gate_proj.weight", "gate_proj.kernel", LINEAR),
    ("mlp.up_proj.weight", "mlp_moe_gen.up_proj.weight", "up_proj.kernel", LINEAR),
    ("mlp.down_proj.weight", "mlp_moe_gen.down_proj.weight", "down_proj.kernel", LINEAR),
)  # fmt: skip

# One SigLIP encoder layer: (HF key suffix, our leaf under vit_model.layers).
_ENCODER_LAYER = (
    ("layer_norm1.weight", "layer_norm1.scale", IDENTITY),
    ("layer_norm1.bias", "layer_norm1.bias", IDENTITY),
    ("self_attn.q_proj.weight", "q_proj.kernel", LINEAR),
    ("self_attn.q_proj.bias", "q_proj.bias", FLAT),
    ("self_attn.k_proj.weight", "k_proj.kernel", LINEAR),
    ("self_attn.k_proj.bias", "k_proj.bias", FLAT),
    ("self_attn.v_proj.weight", "v_proj.kernel", LINEAR),
    ("self_attn.v_proj.bias", "v_proj.bias", FLAT),
    ("self_attn.out_proj.weight", "out_proj.kernel", LINEAR_FROM_HEADS),
    ("self_attn.out_proj.bias", "out_proj.bias", IDENTITY),
    ("layer_norm2.weight", "layer_norm2.scale", IDENTITY),
    ("layer_norm2.bias", "layer_norm2.bias", IDENTITY),
    ("mlp.fc1.weight", "fc1.kernel", LINEAR),
    ("mlp.fc1.bias", "fc1.bias", IDENTITY),
    ("mlp.fc2.weight", "fc2.kernel", LINEAR),
    ("mlp.fc2.bias", "fc2.bias", IDENTITY),
)


def _latent_width(c: BagelConfig) -> int:
    return LATENT_CHANNELS * c.latent_patch_size**2  # a 2x2 patch of 16 channels = 64


def _generation_rule(key: str, shape_of: Callable[[BagelConfig], tuple[int, ...]]) -> Rule:
    return Rule(key, None, None, GENERATION, required=False, hf_shape_of=shape_of)


def _d(c: BagelConfig) -> int:
    return c.llm.hidden_size


MAPPING: tuple[Rule, ...] = (
    # Language model: both MoT experts of every decoder layer, then the globals.
    *(Rule(_LM_LAYER + und, f"language_model.layers.und.{ours}", transform, LANGUAGE)
      for und, _, ours, transform in _DECODER_LAYER),
    *(Rule(_LM_LAYER + gen, f"language_model.layers.gen.{ours}", transform, GEN_EXPERT)
      for _, gen, ours, transform in _DECODER_LAYER),
    Rule("language_model.model.embed_tokens.weight", "language_model.embed_tokens", IDENTITY,
         LANGUAGE, vocab_axis=0),
    Rule("language_model.model.norm.weight", "language_model.norm.scale", IDENTITY, LANGUAGE),
    Rule("language_model.model.norm_moe_gen.weight", "language_model.norm_moe_gen.scale",
         IDENTITY, GEN_EXPERT),
    Rule("language_model.lm_head.weight", "language_model.lm_head", LINEAR, LANGUAGE,
         vocab_axis=1),
    # Vision encoder, connector, and the fixed sin-cos table added after the connector.
    *(Rule(_VIT_LAYER + hf, f"vit_model.layers.{ours}", transform, VISION)
      for hf, ours, transform in _ENCODER_LAYER),
    Rule(_VIT + "embeddings.patch_embedding.weight", "vit_model.patch_embedding.kernel", LINEAR,
         VISION),  # stored as a Linear [Dv, 588] over (py, px, c) features
    Rule(_VIT + "embeddings.patch_embedding.bias", "vit_model.patch_embedding.bias", IDENTITY,
         VISION),
    Rule(_VIT + "embeddings.position_embedding.weight", "vit_model.position_embedding", IDENTITY,
         VISION),
    Rule(_VIT + "post_layernorm.weight", "vit_model.post_layernorm.scale", IDENTITY, VISION),
    Rule(_VIT + "post_layernorm.bias", "vit_model.post_layernorm.bias", IDENTITY, VISION),
    Rule("connector.fc1.weight", "connector.fc1.kernel", LINEAR, VISION),
    Rule("connector.fc1.bias", "connector.fc1.bias", IDENTITY, VISION),
    Rule("connector.fc2.weight", "connector.fc2.kernel", LINEAR, VISION),
    Rule("connector.fc2.bias", "connector.fc2.bias", IDENTITY, VISION),
    # Upstream's training loader drops and recomputes this table, so it may be absent.
    Rule("vit_pos_embed.pos_embed", "vit_pos_embed", IDENTITY, VISION, required=False),
    # Generation only (VAE latents in and out, timestep embedding): no module here.
    _generation_rule("latent_pos_embed.pos_embed", lambda c: (c.max_latent_size**2, _d(c))),
    _generation_rule("vae2llm.weight", lambda c: (_d(c), _latent_width(c))),
    _generation_rule("vae2llm.bias", lambda c: (_d(c),)),
    _generation_rule("llm2vae.weight", lambda c: (_latent_width(c), _d(c))),
    _generation_rule("llm2vae.bias", lambda c: (_latent_width(c),)),
    _generation_rule("time_embedder.mlp.0.weight", lambda c: (_d(c), TIMESTEP_FEATURES)),
    _generation_rule("time_embedder.mlp.0.bias", lambda c: (_d(c),)),
    _generation_rule("time_embedder.mlp.2.weight", lambda c: (_d(c), _d(c))),
    _generation_rule("time_embedder.mlp.2.bias", lambda c: (_d(c),)),
)  # fmt: skip

_RULE_BY_TARGET = {rule.target: rule for rule in MAPPING if rule.target is not None}


def match_key(key: str) -> tuple[Rule, int | None] | None:
    """The rule an HF key falls under and its layer index (None for a global key)."""
    for rule in MAPPING:
        found = rule.pattern.fullmatch(key)
        if found:
            return rule, (int(found["layer"]) if rule.per_layer else None)
    return None


def _num_layers(rule: Rule, config: BagelConfig) -> int:
    if rule.hf_key.startswith("vit_model."):
        return config.vit.num_hidden_layers
    return config.llm.num_hidden_layers


def _hf_shape(rule: Rule, target_shape: tuple[int, ...], source_vocab: int | None = None):
    """The HF shape of one key of `rule` for our parameter shape (per-layer: one layer's)."""
    shape = list(target_shape[1:] if rule.per_layer else target_shape)
    if rule.vocab_axis is not None and source_vocab is not None:
        shape[rule.vocab_axis] = source_vocab
    return tuple(rule.transform.hf_shape(tuple(shape)))


# --------------------------------------------------------------------------- abstract model


def _with_gen_expert(config: BagelConfig, build_gen_expert: bool) -> BagelConfig:
    return config.replace(llm=dict(build_gen_expert=build_gen_expert))


@functools.lru_cache(maxsize=8)
def abstract_params(config: BagelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Our parameter paths -> shapes for `config`, without allocating anything (cached)."""
    state = nnx.state(nnx.eval_shape(lambda: Bagel(config, rngs=nnx.Rngs(0))))
    return {_dotted(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def hf_key_shapes(
    config: BagelConfig, *, gen_expert: bool = True, generation: bool = True
) -> dict[str, tuple[int, ...]]:
    """Every HF key of a checkpoint for `config` and its shape, from the table (no memory).

    With both flags (the default) this is the full BAGEL-MoT key list (1223 keys at 7B).
    """
    targets = abstract_params(_with_gen_expert(config, gen_expert))
    shapes = {}
    for rule in MAPPING:
        if rule.target is None:
            if generation:
                shapes[rule.key()] = tuple(rule.hf_shape_of(config))
        elif rule.target in targets:
            target_shape = targets[rule.target].shape
            layers = range(target_shape[0]) if rule.per_layer else [None]
            for layer in layers:
                shapes[rule.key(layer)] = _hf_shape(rule, target_shape)
    return shapes


def _dotted(path: Iterable) -> str:
    return ".".join(str(part) for part in path)


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
        if layer is not None and layer >= _num_layers(rule, config):
            unexpected.append(
                f"{key} (layer {layer}; the config has {_num_layers(rule, config)} layers)"
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
        expected = _hf_shape(rule, tuple(targets[rule.target]), source_vocab)
        if tuple(shape) != expected:
            wrong_shape.append(f"{key} is {list(shape)}, expected {list(expected)}")
        elif dtype not in FLOAT_DTYPES:
            wrong_dtype.append(f"{key} is {dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
        sources.setdefault(rule.target, {})[layer] = key

    missing, defaulted, unmapped = [], [], []
    for target, target_shape in targets.items():
        rule = _RULE_BY_TARGET.get(target)
        if rule is None:
            unmapped.append(target)
            continue
        layers = range(target_shape[0]) if rule.per_layer else [None]
        absent = [layer for layer in layers if layer not in sources.get(target, {})]
        if absent and not rule.required and len(absent) == len(layers):
            defaulted.append(target)
            continue
        for layer in absent:
            expected = _hf_shape(rule, tuple(target_shape), source_vocab)
            missing.append(f"{rule.key(layer)} expected {list(expected)}")

    problems = [
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("wrong shapes", wrong_shape),
        ("wrong dtypes", wrong_dtype),
        ("model parameters without a mapping rule (a bug in opsd_jax/io/hf.py)", unmapped),
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


def _weights(hf_dir: Path, weights: str | None) -> WeightDirectory:
    try:
        return WeightDirectory(hf_dir, weights)
    except SafetensorsError as e:
        raise HFCheckpointError(str(e)) from None


WEIGHT_CHOICES = ("auto",) + WEIGHT_STEMS


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
            raise HFCheckpointError(f"finetune_from_ema=True starts the student from the EMA "
                                    f"weights, but weights={weights!r}; use 'auto' or 'ema'")  # fmt: skip
        _weights(Path(hf_dir), weights)  # it must exist
        return InitialWeights(weights, weights, weights)
    present = present_stems(hf_dir)
    if not present:
        _weights(Path(hf_dir), None)  # raises: no weights found
    if finetune_from_ema and "ema" not in present:
        raise HFCheckpointError(f"{hf_dir}: finetune_from_ema=True starts the student from "
                                f"ema.safetensors, which is not there (found: {present})")  # fmt: skip
    model_file = "model" if "model" in present else present[0]
    return InitialWeights(
        student="ema" if finetune_from_ema else model_file,
        ema_teacher="ema" if "ema" in present else model_file,
        fixed_teacher=model_file,
    )


def _header(files: WeightDirectory) -> dict[str, tuple[tuple[int, ...], str]]:
    return {key: (info.shape, info.dtype) for key, info in files.header().items()}


def _grown_vocab(config: BagelConfig, tokenizer: BagelTokenizer | None) -> int:
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
    _weights(hf_dir, weights)  # a missing weights file is named before the tokenizer loads
    bagel_tokenizer = load_tokenizer(hf_dir) if tokenizer else None
    grown = _grown_vocab(config, bagel_tokenizer)
    if grown != config.llm.vocab_size:
        config = config.replace(llm=dict(vocab_size=grown))
    graphdef, state = load_weights(hf_dir, config, weights=weights, mesh=mesh, dtype=dtype,
                                   rules=rules, progress=progress, read_params=read_params)  # fmt: skip
    return nnx.merge(graphdef, state), config, bagel_tokenizer


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
    files = _weights(hf_dir, weights)
    source_vocab = read_config(hf_dir).llm.vocab_size
    grown = config.llm.vocab_size
    if grown < source_vocab:
        raise HFCheckpointError(f"{hf_dir}: the model's vocabulary ({grown}) is smaller than the "
                                f"checkpoint's ({source_vocab}); a table is never shrunk")  # fmt: skip

    make_model = lambda: Bagel(config, rngs=nnx.Rngs(0))
    if mesh is None:
        graphdef, abstract_state = nnx.split(nnx.eval_shape(make_model))
        default_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        graphdef, abstract_state = mesh_lib.abstract_model(make_model, mesh, rules)
        default_sharding = None
    flat_state = nnx.to_flat_state(abstract_state)
    abstract = {_dotted(p): v.get_value() for p, v in flat_state}
    skipped = set() if read_params else {_dotted(p) for p, v in flat_state
                                         if isinstance(v, nnx.Param)}  # fmt: skip
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
        rule = _RULE_BY_TARGET[path]
        if path in plan.defaulted:
            host = _default_value(path, config)
            values[path] = _place(spec.shape, sharding, dtype, lambda layer, host=host: host, False)
            continue
        keys = plan.sources[path]
        layer_shape = tuple(spec.shape[1:] if rule.per_layer else spec.shape)
        if rule.vocab_axis is not None and grown != source_vocab:
            host = _grow_vocab(rule, files.array(keys[None]), layer_shape, source_vocab)
            read = lambda layer, host=host: host
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


# --------------------------------------------------------------------------- saving


def flat_params(params) -> dict[str, Any]:
    """{dotted path: array} from a model, an nnx.State, or a nested dict (e.g. restored)."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params)
    if isinstance(params, nnx.State):
        return {_dotted(p): v.get_value() for p, v in nnx.to_flat_state(params)}
    flat = {}

    def visit(prefix, node):
        if isinstance(node, Mapping):
            for name, child in node.items():
                visit(prefix + (str(name),), child)
        elif isinstance(node, nnx.Variable):
            flat[_dotted(prefix)] = node.get_value()
        else:
            flat[_dotted(prefix)] = node

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
    `restore_params`). Every key of the source weights is written under the same name, shape,
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
    files = _weights(source_dir, weights)

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
    for key in files.keys():
        info = files.info(key)
        matched = match_key(key)
        rule, layer = matched if matched else (None, None)
        out_shape = info.shape
        if rule is not None and rule.target in params:
            value = params[rule.target]
            out_shape = _hf_shape(rule, tuple(value.shape))
            # The source's shape: ours, except along a vocabulary that was grown at load time.
            grown = rule.vocab_axis is not None and our_vocab != source_vocab
            source_shape = _hf_shape(rule, tuple(value.shape), source_vocab if grown else None)
            if layer is not None and layer >= value.shape[0]:
                wrong.append(f"{key}: we hold {value.shape[0]} layers of {rule.target}")
            elif source_shape != info.shape:
                wrong.append(f"{key}: ours gives {list(out_shape)}, source is {list(info.shape)}")
            used.add(rule.target)
            produce = _ours_producer(value, rule, layer, DTYPES[info.dtype])
        else:
            produce = lambda key=key: files.raw(key)
        entries[files.file_of[key].path.name].append((key, info.dtype, out_shape, produce))
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
        for entry in sorted(source_dir.iterdir()):
            if entry.name.startswith(".") or _is_weight_file(entry.name):
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


# --------------------------------------------------------------------------- orbax params


PARAMS_ITEM = "params"


def save_params(model: Bagel, out_dir: str | os.PathLike, config: BagelConfig) -> Path:
    """Our params as an orbax checkpoint `<out_dir>/params` plus the config as JSON."""
    import orbax.checkpoint as ocp

    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out_dir / PARAMS_ITEM, nnx.to_pure_dict(nnx.state(model)))
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        _write_json(out_dir / "bagel_config.json", dataclasses.asdict(config))
    return out_dir


def find_params_item(ckpt: str | os.PathLike, item: str = PARAMS_ITEM) -> Path:
    """The orbax item directory: `<ckpt>/<item>`, or in the latest `<ckpt>/<step>/`."""
    ckpt = Path(ckpt).absolute()
    if (ckpt / item).is_dir():
        return ckpt / item
    steps = sorted((int(p.name), p) for p in ckpt.glob("*") if p.name.isdigit() and p.is_dir())
    if steps and (steps[-1][1] / item).is_dir():
        return steps[-1][1] / item
    raise FileNotFoundError(f"{ckpt}: no orbax item {item!r} (looked in it and its latest step)")


def restore_params(
    ckpt: str | os.PathLike,
    source_hf_dir: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    *,
    item: str = PARAMS_ITEM,
    rules=mesh_lib.LOGICAL_RULES,
) -> dict[str, jax.Array]:
    """Restore an orbax params item as {dotted path: array}, sharded like the model on `mesh`.

    Works for `save_params` output and for states saved as nnx.State (trailing `.value`). The
    gen expert and a grown vocabulary are recognised from the saved shapes.
    """
    import orbax.checkpoint as ocp

    path = find_params_item(ckpt, item)
    # The item's handler, not a Checkpointer: a training step keeps its checkpoint-level
    # metadata one folder up, and a Checkpointer warns on every item it reads without one.
    handler = ocp.StandardCheckpointHandler()
    tree = handler.metadata(path).tree
    saved = {}
    for key_path, meta in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)
        saved[names] = meta
    ours = {_dotted(n[:-1] if n[-1] == "value" else n): n for n in saved}
    has_gen = any(name.startswith("language_model.layers.gen.") for name in ours)
    changes: dict[str, Any] = {"build_gen_expert": has_gen}
    if "language_model.embed_tokens" in ours:
        changes["vocab_size"] = int(saved[ours["language_model.embed_tokens"]].shape[0])
    config = read_config(source_hf_dir, llm=changes)
    make_model = lambda: Bagel(config, rngs=nnx.Rngs(0))
    if mesh is None:
        mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    _, abstract_state = mesh_lib.abstract_model(make_model, mesh, rules)
    shardings = {_dotted(p): v.get_value().sharding for p, v in nnx.to_flat_state(abstract_state)}
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target_flat = {
        names: jax.ShapeDtypeStruct(
            meta.shape, meta.dtype, sharding=shardings.get(dotted, replicated)
        )
        for dotted, names in ours.items()
        for meta in [saved[names]]
    }
    target: dict = {}
    for names, spec in target_flat.items():
        node = target
        for part in names[:-1]:
            node = node.setdefault(part, {})
        node[names[-1]] = spec
    try:
        restored = handler.restore(path, args=ocp.args.StandardRestore(target))
    finally:
        handler.close()
    return {dotted: _get(restored, names) for dotted, names in ours.items()}


def _get(tree, names):
    for part in names:
        tree = tree[part]
    return tree
