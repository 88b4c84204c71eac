"""The BAGEL / ThinkMorph HF key layout <-> our parameter paths, as one table of data.

An HF directory holds `llm_config.json`, `vit_config.json`, the weights (`ema.safetensors` for
BAGEL, `model.safetensors` for ThinkMorph, either possibly sharded with an index json) and the
Qwen2 tokenizer files (docs/bagel_layout.md §8).

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

`hf_load.py` reads a directory through this table and `hf_export.py` writes one back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterable

import jax
import numpy as np
from flax import nnx

from models.bagel import Bagel
from models.configs import BagelConfig

LLM_CONFIG = "llm_config.json"
VIT_CONFIG = "vit_config.json"
# FLUX VAE latent channels (docs/bagel_layout.md §1.4) and the time embedder's sinusoid width (§9):
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
    (
        "self_attn.o_proj.weight",
        "self_attn.o_proj_moe_gen.weight",
        "o_proj.kernel",
        LINEAR_FROM_HEADS,
    ),
    ("self_attn.q_norm.weight", "self_attn.q_norm_moe_gen.weight", "q_norm.scale", IDENTITY),
    ("self_attn.k_norm.weight", "self_attn.k_norm_moe_gen.weight", "k_norm.scale", IDENTITY),
    (
        "post_attention_layernorm.weight",
        "post_attention_layernorm_moe_gen.weight",
        "post_attention_layernorm.scale",
        IDENTITY,
    ),
    ("mlp.gate_proj.weight", "mlp_moe_gen.gate_proj.weight", "gate_proj.kernel", LINEAR),
    ("mlp.up_proj.weight", "mlp_moe_gen.up_proj.weight", "up_proj.kernel", LINEAR),
    ("mlp.down_proj.weight", "mlp_moe_gen.down_proj.weight", "down_proj.kernel", LINEAR),
)

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
    *(
        Rule(_LM_LAYER + und, f"language_model.layers.und.{ours}", transform, LANGUAGE)
        for und, _, ours, transform in _DECODER_LAYER
    ),
    *(
        Rule(_LM_LAYER + gen, f"language_model.layers.gen.{ours}", transform, GEN_EXPERT)
        for _, gen, ours, transform in _DECODER_LAYER
    ),
    Rule(
        "language_model.model.embed_tokens.weight",
        "language_model.embed_tokens",
        IDENTITY,
        LANGUAGE,
        vocab_axis=0,
    ),
    Rule("language_model.model.norm.weight", "language_model.norm.scale", IDENTITY, LANGUAGE),
    Rule(
        "language_model.model.norm_moe_gen.weight",
        "language_model.norm_moe_gen.scale",
        IDENTITY,
        GEN_EXPERT,
    ),
    Rule("language_model.lm_head.weight", "language_model.lm_head", LINEAR, LANGUAGE, vocab_axis=1),
    # Vision encoder, connector, and the fixed sin-cos table added after the connector.
    *(
        Rule(_VIT_LAYER + hf, f"vit_model.layers.{ours}", transform, VISION)
        for hf, ours, transform in _ENCODER_LAYER
    ),
    Rule(
        _VIT + "embeddings.patch_embedding.weight",
        "vit_model.patch_embedding.kernel",
        LINEAR,
        VISION,
    ),  # stored as a Linear [Dv, 588] over (py, px, c) features
    Rule(
        _VIT + "embeddings.patch_embedding.bias", "vit_model.patch_embedding.bias", IDENTITY, VISION
    ),
    Rule(
        _VIT + "embeddings.position_embedding.weight",
        "vit_model.position_embedding",
        IDENTITY,
        VISION,
    ),
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
)

RULE_BY_TARGET = {rule.target: rule for rule in MAPPING if rule.target is not None}


def match_key(key: str) -> tuple[Rule, int | None] | None:
    """The rule an HF key falls under and its layer index (None for a global key)."""
    for rule in MAPPING:
        found = rule.pattern.fullmatch(key)
        if found:
            return rule, (int(found["layer"]) if rule.per_layer else None)
    return None


def num_layers(rule: Rule, config: BagelConfig) -> int:
    if rule.hf_key.startswith("vit_model."):
        return config.vit.num_hidden_layers
    return config.llm.num_hidden_layers


def hf_shape(rule: Rule, target_shape: tuple[int, ...], source_vocab: int | None = None):
    """The HF shape of one key of `rule` for our parameter shape (per-layer: one layer's)."""
    shape = list(target_shape[1:] if rule.per_layer else target_shape)
    if rule.vocab_axis is not None and source_vocab is not None:
        shape[rule.vocab_axis] = source_vocab
    return tuple(rule.transform.hf_shape(tuple(shape)))


# --------------------------------------------------------------------------- abstract model


def with_gen_expert(config: BagelConfig, build_gen_expert: bool) -> BagelConfig:
    return config.replace(llm=dict(build_gen_expert=build_gen_expert))


@functools.lru_cache(maxsize=8)
def abstract_params(config: BagelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Our parameter paths -> shapes for `config`, without allocating anything (cached)."""
    state = nnx.state(nnx.eval_shape(lambda: Bagel(config, rngs=nnx.Rngs(0))))
    return {dotted(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def hf_key_shapes(
    config: BagelConfig, *, gen_expert: bool = True, generation: bool = True
) -> dict[str, tuple[int, ...]]:
    """Every HF key of a checkpoint for `config` and its shape, from the table (no memory).

    With both flags (the default) this is the full BAGEL-MoT key list (1223 keys at 7B).
    """
    targets = abstract_params(with_gen_expert(config, gen_expert))
    shapes = {}
    for rule in MAPPING:
        if rule.target is None:
            if generation:
                shapes[rule.key()] = tuple(rule.hf_shape_of(config))
        elif rule.target in targets:
            target_shape = targets[rule.target].shape
            layers = range(target_shape[0]) if rule.per_layer else [None]
            for layer in layers:
                shapes[rule.key(layer)] = hf_shape(rule, target_shape)
    return shapes


def dotted(path: Iterable) -> str:
    """'a.b.c' for a parameter path."""
    return ".".join(str(part) for part in path)
