"""The data config: which data sets (`DatasetSpec`), in which layout, with which image transform,
split and skip rules (`DataConfig`), validated when built from the training config's `data`
section. sources.py reads what it names; pipeline.py turns it into an iterator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from opsd_jax.data.image_transform import MAX_PATCHES_PER_SIDE, PATCH_SIZE, ImageTransform


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """One dataset of the mixture.

    `path`: a task directory (`<task>/data/*.parquet` or `*.jsonl`), a directory of files, or one
    file. `num_used_data`: cap on rows used from this dataset after the split (-1 = all; the first
    rows in file order, so the cap is deterministic). `weight`: relative mixture weight.
    """

    name: str
    path: str
    num_used_data: int = -1
    weight: float = 1.0
    format: str = "auto"  # auto | parquet | jsonl

    def __post_init__(self):
        if self.format not in ("auto", "parquet", "jsonl"):
            raise ValueError(
                f"data.datasets {self.name!r}: format must be auto|parquet|jsonl, got {self.format!r}"
            )
        if self.weight <= 0:
            raise ValueError(f"data.datasets {self.name!r}: weight must be > 0, got {self.weight}")
        if self.num_used_data < -1 or self.num_used_data == 0:
            raise ValueError(
                f"data.datasets {self.name!r}: num_used_data must be -1 or > 0, "
                f"got {self.num_used_data}"
            )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Everything the data pipeline needs; `from_dict` accepts a plain dict or a ConfigDict."""

    # What a run config sets (opsd_jax/run_config data_config; the defaults live there).
    datasets: tuple[DatasetSpec, ...]
    max_reference_rounds: int  # VT images read per sample (released data has 1)
    heldout_fraction: float  # share of train-file pids held out for evaluation
    seed: int
    image_transform: ImageTransform
    num_threads: int  # grain read threads (decode + image transform run there)
    # Fixed here.
    max_question_chars: int = 8192  # cheap length guard; longer questions are skipped
    require_vt: bool = True  # a row without VT image is skipped (the teacher needs one)
    # Decoded images are big (a 980 px image is ~11 MB of float32 patches), so prefetch little;
    # grain's default (500) would hold gigabytes.
    prefetch_buffer_size: int = 4
    row_group_cache: int = 4  # parquet row groups kept in memory per source
    # The model's ViT patch size and position grid (vit_config.json: patch_size, image_size //
    # patch_size); BAGEL-7B's by default. Set from the model with `for_model`.
    vit_patch_size: int = PATCH_SIZE
    vit_max_patches_per_side: int = MAX_PATCHES_PER_SIDE

    def __post_init__(self):
        if not self.datasets:
            raise ValueError("data.datasets is empty")
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"data.datasets: duplicate names: {names}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(
                f"data.heldout_fraction must be in [0, 1), got {self.heldout_fraction}"
            )
        if self.max_reference_rounds < 1:
            raise ValueError("max_reference_rounds must be >= 1")
        transform = self.image_transform
        patch, grid = self.vit_patch_size, self.vit_max_patches_per_side
        if transform.stride % patch:
            raise ValueError(
                f"data.image_transform.stride={transform.stride} is not a multiple "
                f"of the ViT's patch_size={patch}"
            )
        if transform.max_size > grid * patch:
            # Resized sides reach max_size: more patches than position ids (an error per image).
            raise ValueError(
                f"data.image_transform.max_size={transform.max_size} px allows "
                f"{transform.max_size // patch} patches of {patch} px per side, more than the "
                f"model's ViT position grid of {grid} (vit_config.json image_size // patch_size);"
                f" set data.image_transform.max_size <= {grid * patch}"
            )

    def for_model(self, model_config) -> DataConfig:
        """This config with the ViT patch size and position grid of `model_config`, a BagelConfig."""
        grid = model_config.vit_max_num_patch_per_side
        return dataclasses.replace(
            self, vit_patch_size=model_config.vit.patch_size, vit_max_patches_per_side=grid
        )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> DataConfig:
        """Build from a mapping (e.g. `config.data.to_dict()`).

        `datasets` is either a list of dicts with `name`, `path`, optional `num_used_data`,
        `weight`, `format`, or a mapping name -> {path, num_used_data, weight, format}.
        `image_transform` is a preset name ("vit_chat", "vit_interleave", "vit_thinkmorph_train")
        or a dict {max_size, min_size, stride, max_pixels}.
        """
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        config = dict(config)
        datasets = config.pop("datasets")
        if isinstance(datasets, Mapping):
            datasets = [dict(spec, name=name) for name, spec in datasets.items()]
        specs = tuple(d if isinstance(d, DatasetSpec) else DatasetSpec(**dict(d)) for d in datasets)
        if "image_transform" in config:
            config["image_transform"] = image_transform_from(config["image_transform"])
        return cls(datasets=specs, **config)


def image_transform_from(value: str | Mapping[str, int] | ImageTransform) -> ImageTransform:
    """A preset name, a dict of ImageTransform fields, or an ImageTransform."""
    if isinstance(value, ImageTransform):
        return value
    if isinstance(value, str):
        presets = ("vit_chat", "vit_interleave", "vit_thinkmorph_train", "vae_resize")
        if value not in presets:
            raise ValueError(f"unknown image transform preset {value!r}; one of {presets}")
        return getattr(ImageTransform, value)()
    return ImageTransform(**dict(value))
