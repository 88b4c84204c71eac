"""Model configuration: the language model, the vision encoder, and the BAGEL composition.

Three frozen dataclasses, one per network, with named presets:

* `BagelConfig.tiny()` — a few layers and small widths; runs in seconds on a CPU (tests, the
    default training config).
* `BagelConfig.bagel_7b()` — BAGEL-7B-MoT / ThinkMorph-7B (docs/bagel_layout.md §1).
* `BagelConfig.from_hf_json(llm_config.json, vit_config.json)` — read a checkpoint directory's
    configs and apply the overrides every upstream loader applies in code (docs/bagel_layout.md §1): QK-norm
    on, untied lm_head, the MoT layer, one ViT layer fewer than the json says, no ViT rope.

Runtime choices that are not part of the checkpoint (compute dtype, attention backend, remat)
live in the same dataclasses so one object describes how a model is built and run; they are
never read from or written to the HF json files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from models import attention, layers

MOT_LAYER = "Qwen2MoTDecoderLayer"
PLAIN_LAYER = "Qwen2DecoderLayer"
_LAYER_MODULES = (MOT_LAYER, PLAIN_LAYER)
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# The per-layer remat switch: "none" or a jax.checkpoint policy name from models/layers.py.
REMAT_CHOICES = ("none",) + tuple(layers.REMAT_POLICIES)
# Qwen2Config's runtime switches: how the model computes, never what (not in the checkpoint).
# A run config has keys of the same names (opsd_jax/run_config/builds.py model_runtime).
RUNTIME_FIELDS = (
    "compute_dtype",
    "attention_backend",
    "remat",
    "vit_remat",
    "vit_attention_backend",
    "unroll_layers",
    "unroll_decode_layers",
    "attention_block",
)
# Runtime switches the run config derives rather than takes as keys of their own
# (opsd_jax/run_config/builds.py model_runtime): the most patches one image has.
DERIVED_RUNTIME_FIELDS = ("vit_image_patches",)


def _check_choice(owner: str, name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(
            f"{owner}.{name}={value!r}; allowed values: {', '.join(map(repr, allowed))}"
        )


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """BAGEL's language model: Qwen2 with per-head QK-norm and (optionally) MoT gen experts."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    layer_module: str = MOT_LAYER
    # Build the `*_moe_gen` weights of the MoT layer. Understanding-only work (OPSD) never routes
    # a token to them, and at 7B they are ~6.5B parameters, so they are off unless asked for.
    build_gen_expert: bool = False
    # Per-row slots the gen expert runs on when a Pack has gen tokens (Pack.gen_mask); a row
    # with more fails loudly. 0 = the whole row: always fits, and the gen expert then costs as
    # much as the und one. Image generation sets it to its latent tokens per row.
    gen_token_capacity: int = 0
    # --- runtime (not in the checkpoint) ---
    compute_dtype: str = "bfloat16"
    attention_backend: str = "auto"
    remat: str = "full"
    # The ViT's own remat policy ('same': the LLM's). Its layers are a fraction of a step's
    # activations and a larger part of its recompute than their FLOPs suggest (16 heads of 72
    # over whole images), so a lighter policy can pay there when the LLM's must stay 'full'.
    vit_remat: str = "same"
    # The ViT's own attention backend ('auto': the LLM's). Its 16 heads of 72 over whole images
    # bidirectionally are another problem than the LLM's causal 128-dim heads: the Pallas range
    # kernel pads 72 to 128, and 'cudnn' takes 72 as it is, each image in a row of its own
    # with its length where the images fit `vit_image_patches` (models/attention_cudnn.py).
    vit_attention_backend: str = "auto"
    # The most patches one image has (the data's image transform; 0: unknown, so only rows of
    # one image go to cuDNN without a mask). Set by the run config, not a key of its own.
    vit_image_patches: int = 0
    # Unroll the layer loop (models/layers.scan_layers): faster on a CPU, slower to compile for
    # deep models anywhere.
    unroll_layers: bool = False
    # Unroll the decode step's layer loop (Qwen2MoT.decode_step). On a GPU the unrolled step has
    # no inner loop, so XLA puts the whole token loop, stop test included, in one CUDA graph: no
    # launch and no host sync per token, and no per-layer copies of the small stacked weights
    # (bench/scale.py, tests/test_gpu_compile.py). Costs compile time, once per cache size.
    unroll_decode_layers: bool = True
    # Query / key tile of the chunked attention backend. 512 suits a GPU; on a CPU, where the
    # padded part of a tile is paid in full, 128 is faster (bench/vs_pytorch.py, docs/performance.md).
    attention_block: int = 512

    def __post_init__(self):
        owner = "Qwen2Config"
        _check_positive(
            owner,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
        )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{owner}.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{owner}.num_attention_heads={self.num_attention_heads} is not divisible "
                f"by num_key_value_heads={self.num_key_value_heads} (GQA)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"{owner}: head_dim={self.head_dim} must be even for rotary embeddings"
            )
        _check_choice(owner, "layer_module", self.layer_module, _LAYER_MODULES)
        if not isinstance(self.gen_token_capacity, int) or self.gen_token_capacity < 0:
            raise ValueError(
                f"{owner}.gen_token_capacity must be an integer >= 0, "
                f"got {self.gen_token_capacity!r}"
            )
        _check_choice(owner, "compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        _check_choice(owner, "attention_backend", self.attention_backend, attention.BACKENDS)
        if not isinstance(self.attention_block, int) or self.attention_block < 8:
            raise ValueError(
                f"{owner}.attention_block must be an integer >= 8, got {self.attention_block!r}"
            )
        _check_choice(owner, "remat", self.remat, REMAT_CHOICES)
        _check_choice(owner, "vit_remat", self.vit_remat, ("same",) + REMAT_CHOICES)
        _check_choice(
            owner, "vit_attention_backend", self.vit_attention_backend, attention.BACKENDS
        )
        if not isinstance(self.vit_image_patches, int) or self.vit_image_patches < 0:
            raise ValueError(
                f"{owner}.vit_image_patches must be an integer >= 0, got {self.vit_image_patches!r}"
            )
        if self.tie_word_embeddings:
            raise ValueError(
                f"{owner}.tie_word_embeddings=True is not supported: BAGEL's lm_head is "
                "untied (every upstream loader forces False)"
            )
        if self.build_gen_expert and self.layer_module != MOT_LAYER:
            raise ValueError(
                f"{owner}.build_gen_expert=True needs layer_module={MOT_LAYER!r}, "
                f"got {self.layer_module!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """SigLIP NaViT vision encoder. `num_hidden_layers` is the number of layers actually built."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    patch_size: int = 14
    image_size: int = 980
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    rope: bool = False

    def __post_init__(self):
        owner = "SiglipConfig"
        _check_positive(
            owner,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_hidden_layers=self.num_hidden_layers,
            patch_size=self.patch_size,
            image_size=self.image_size,
            num_channels=self.num_channels,
        )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{owner}.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        _check_choice(owner, "hidden_act", self.hidden_act, ("gelu_pytorch_tanh",))
        if self.rope:
            raise ValueError(
                f"{owner}.rope=True is not supported: BAGEL checkpoints use the learned "
                "position table (every upstream loader forces rope=False)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Features of one flattened patch, (py, px, c) order: 14*14*3 = 588."""
        return self.patch_size * self.patch_size * self.num_channels

    @property
    def num_patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclasses.dataclass(frozen=True)
class BagelConfig:
    """The whole model: LM + ViT + connector, and the BAGEL-level switches (docs/bagel_layout.md §1.3)."""

    llm: Qwen2Config
    vit: SiglipConfig
    visual_und: bool = True
    visual_gen: bool = False
    connector_act: str = "gelu_pytorch_tanh"
    # Only BAGEL's released setting, "extrapolate" ViT position ids (docs/bagel_layout.md §4.3),
    # is ported: the image transform builds those ids whatever this says, so True is refused.
    interpolate_pos: bool = False
    latent_patch_size: int = 2
    max_latent_size: int = 64
    timestep_shift: float = 1.0

    def __post_init__(self):
        _check_choice("BagelConfig", "connector_act", self.connector_act, ("gelu_pytorch_tanh",))
        _check_choice("BagelConfig", "interpolate_pos", self.interpolate_pos, (False,))

    @property
    def vit_max_num_patch_per_side(self) -> int:
        """The ViT position grid G: ids r*G + c index both position tables (SigLIP's learned one
        and `vit_pos_embed`), so it is the checkpoint's image_size // patch_size. BAGEL's
        loaders set it in code (70 = 980 // 14 for SigLIP-so400m-14-980); a different value
        would index SigLIP's (image_size // patch_size)^2-row table out of its layout."""
        return self.vit.num_patches_per_side

    def replace(self, **changes) -> "BagelConfig":
        """A copy with top-level fields changed; `llm=dict(...)`/`vit=dict(...)` change sub-fields."""
        for sub in ("llm", "vit"):
            if isinstance(changes.get(sub), dict):
                changes[sub] = dataclasses.replace(getattr(self, sub), **changes[sub])
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **changes) -> "BagelConfig":
        """A few layers, small widths, GQA; every sharded width divisible by 8 (8-device tests)."""
        config = cls(
            llm=Qwen2Config(
                vocab_size=1024,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_theta=10_000.0,
                max_position_embeddings=4096,
            ),
            vit=SiglipConfig(
                hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2
            ),
        )
        return config.replace(**changes)

    @classmethod
    def small_64m(cls, **changes) -> "BagelConfig":
        """The benches' mid-size model (bench/sampler.py 'm64', grad_step.py, vs_pytorch.py):
        ~39M LM parameters (64M with the embeddings), hidden 512, 8 layers, 8 / 2 heads."""
        config = cls.tiny(
            llm=dict(
                vocab_size=16384,
                hidden_size=512,
                intermediate_size=1408,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=2,
            ),
            vit=dict(hidden_size=128, intermediate_size=256, num_attention_heads=2),
        )
        return config.replace(**changes)

    @classmethod
    def bagel_7b(cls, **changes) -> "BagelConfig":
        """BAGEL-7B-MoT / ThinkMorph-7B, understanding-only by default (no gen expert built)."""
        config = cls(
            llm=Qwen2Config(
                vocab_size=152064,
                hidden_size=3584,
                intermediate_size=18944,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                rms_norm_eps=1e-6,
                rope_theta=1_000_000.0,
                max_position_embeddings=32768,
            ),
            vit=SiglipConfig(
                hidden_size=1152,
                intermediate_size=4304,
                num_attention_heads=16,
                num_hidden_layers=26,
                patch_size=14,
                image_size=980,
            ),
        )
        return config.replace(**changes)

    @classmethod
    def from_hf_json(
        cls, llm_json_path: str | os.PathLike, vit_json_path: str | os.PathLike, **changes
    ) -> "BagelConfig":
        """Read a BAGEL/ThinkMorph checkpoint's configs, applying the upstream loader overrides."""
        llm_json = _read_json(llm_json_path)
        vit_json = _read_json(vit_json_path)

        def need(source: dict, path, key):
            if key not in source:
                raise KeyError(f"{os.fspath(path)}: missing required key {key!r}")
            return source[key]

        if llm_json.get("rope_scaling"):
            raise ValueError(
                f"{os.fspath(llm_json_path)}: rope_scaling={llm_json['rope_scaling']!r} is "
                "not supported (BAGEL uses plain RoPE)"
            )
        if llm_json.get("use_sliding_window"):
            raise ValueError(
                f"{os.fspath(llm_json_path)}: use_sliding_window=true is not supported"
            )
        llm = Qwen2Config(
            vocab_size=need(llm_json, llm_json_path, "vocab_size"),
            hidden_size=need(llm_json, llm_json_path, "hidden_size"),
            intermediate_size=need(llm_json, llm_json_path, "intermediate_size"),
            num_hidden_layers=need(llm_json, llm_json_path, "num_hidden_layers"),
            num_attention_heads=need(llm_json, llm_json_path, "num_attention_heads"),
            # No fallbacks where the defaults of BAGEL's own config classes differ from the
            # release's values (BAGEL: 32 KV heads, theta 1e4; the 7B: 4, 1e6): a key missing
            # from the file is an error, not a silent guess.
            num_key_value_heads=need(llm_json, llm_json_path, "num_key_value_heads"),
            rms_norm_eps=llm_json.get("rms_norm_eps", 1e-6),
            rope_theta=float(need(llm_json, llm_json_path, "rope_theta")),
            max_position_embeddings=llm_json.get("max_position_embeddings", 32768),
            # Loader overrides (docs/bagel_layout.md §1.1): set in code whatever the json says.
            qk_norm=True,
            tie_word_embeddings=False,
            layer_module=MOT_LAYER,
        )
        json_vit_layers = need(vit_json, vit_json_path, "num_hidden_layers")
        vit = SiglipConfig(
            hidden_size=need(vit_json, vit_json_path, "hidden_size"),
            intermediate_size=need(vit_json, vit_json_path, "intermediate_size"),
            num_attention_heads=need(vit_json, vit_json_path, "num_attention_heads"),
            # The loaders drop the last layer (equivalent to training's vit_select_layer=-2).
            num_hidden_layers=json_vit_layers - 1,
            patch_size=need(vit_json, vit_json_path, "patch_size"),  # (BAGEL's default: 16)
            image_size=need(vit_json, vit_json_path, "image_size"),  # (BAGEL's default: 224)
            num_channels=vit_json.get("num_channels", 3),
            hidden_act=vit_json.get("hidden_act", "gelu_pytorch_tanh"),
            layer_norm_eps=vit_json.get("layer_norm_eps", 1e-6),
            rope=False,
        )
        return cls(llm=llm, vit=vit).replace(**changes)


def _read_json(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"model config not found: {os.fspath(path)}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)} is not valid JSON: {e}") from None
