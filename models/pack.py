"""The Pack: the model's input contract, one representation from the packer to the kernel.

A Pack is a batch of R fixed-length rows; each row holds one or more samples (segments). The
packer (opsd_jax/data/packing.py) builds it as numpy arrays on the host; the same dataclass holds the
sharded jax.Arrays on device (it is a pytree). Training packs have shapes fixed by the config
(opsd_jax/data/pack_shapes.py), so the train step compiles once, before training; sampler prompts
are rounded up to a few length buckets.

| field          | shape          | meaning |
|----------------|----------------|---------|
| tokens         | [R, T] int32   | text ids and image-marker ids; 0 at patch slots and padding |
| positions      | [R, T] int32   | RoPE ids: an image block shares one id; restart per segment |
| segment_ids    | [R, T] int32   | 1.. per sample, 0 = padding |
| k_start, k_end | [R, T] int32   | query t attends keys in [k_start, k_end): its segment's start; t+1 for text, the end of its block for image tokens |
| vit_patches    | [R, P, 588]    | patchified pixels in (py, px, c) order, in [-1, 1] |
| vit_pos_ids    | [R, P] int32   | r*G + c position ids of the patches (G: the ViT grid, 70 at 7B) |
| vit_slots      | [R, P] int32   | the row position each patch embedding goes to (-1 = padding patch) |
| vit_image_ids  | [R, P] int32   | which image a patch belongs to, 1.. per row (0 = padding patch) |
| gen_mask       | [R, T] bool    | MoT routing: True for gen-expert tokens; None = none (understanding packs) |
| loss_rows      | [R, C] int32   | row positions whose output predicts a completion token |
| loss_targets   | [R, C] int32   | the predicted ids |
| loss_mask      | [R, C] bool    | valid entries |
| loss_sample    | [R, C] int32   | which sample each entry belongs to (per-sample reduction) |

A row's images are laid out contiguously in the patch arrays (image 1's patches, then image
2's, ...), which the ViT relies on to attend within each image. Packs without images leave the
vit_* fields as None; packs without a loss (sampler prompts) leave the loss_* fields as None.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import numpy as np

Array = Any  # numpy on the host, jax.Array on device


@flax.struct.dataclass
class Pack:
    tokens: Array
    positions: Array
    segment_ids: Array
    k_start: Array
    k_end: Array
    gen_mask: Array | None = None
    vit_patches: Array | None = None
    vit_pos_ids: Array | None = None
    vit_slots: Array | None = None
    vit_image_ids: Array | None = None
    loss_rows: Array | None = None
    loss_targets: Array | None = None
    loss_mask: Array | None = None
    loss_sample: Array | None = None

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def row_length(self) -> int:
        return self.tokens.shape[1]

    @property
    def has_images(self) -> bool:
        return self.vit_patches is not None

    def validate(self) -> None:
        """Check shapes and dtypes agree (host-side; call before sending to the device)."""
        rows, length = self.tokens.shape
        for name in ("positions", "segment_ids", "k_start", "k_end", "gen_mask"):
            value = getattr(self, name)
            if value is not None and value.shape != (rows, length):
                raise ValueError(f"Pack.{name} has shape {value.shape}, expected {(rows, length)}")
        vit = [self.vit_patches, self.vit_pos_ids, self.vit_slots, self.vit_image_ids]
        if any(v is not None for v in vit):
            if any(v is None for v in vit):
                raise ValueError(
                    "Pack: vit_patches, vit_pos_ids, vit_slots, vit_image_ids must be "
                    "given together"
                )
            num_patches = self.vit_patches.shape[1]
            for name in ("vit_pos_ids", "vit_slots", "vit_image_ids"):
                value = getattr(self, name)
                if value.shape != (rows, num_patches):
                    raise ValueError(
                        f"Pack.{name} has shape {value.shape}, expected {(rows, num_patches)}"
                    )
            slots = np.asarray(self.vit_slots)
            if slots.max(initial=-1) >= length:
                raise ValueError(f"Pack.vit_slots points past the row length {length}")
        loss = [self.loss_rows, self.loss_targets, self.loss_mask, self.loss_sample]
        if any(v is not None for v in loss):
            if any(v is None for v in loss):
                raise ValueError(
                    "Pack: loss_rows, loss_targets, loss_mask, loss_sample must be given together"
                )
            shape = self.loss_rows.shape
            for name in ("loss_targets", "loss_mask", "loss_sample"):
                if getattr(self, name).shape != shape:
                    raise ValueError(
                        f"Pack.{name} has shape {getattr(self, name).shape}, expected {shape}"
                    )


# Pack fields by the axis that varies with the batch content; padding value per field.
_TOKEN_AXIS = ("tokens", "positions", "segment_ids", "k_start", "k_end", "gen_mask")
_PATCH_AXIS = ("vit_patches", "vit_pos_ids", "vit_slots", "vit_image_ids")
_LOSS_AXIS = ("loss_rows", "loss_targets", "loss_mask", "loss_sample")
_PAD_VALUE = {"vit_slots": -1}  # every other field pads with 0 / False


def pack_sizes(pack: Pack) -> tuple[int, int, int]:
    """(row length, patches per row, loss entries per row) of a Pack."""
    patches = pack.vit_patches.shape[1] if pack.vit_patches is not None else 0
    loss = pack.loss_rows.shape[1] if pack.loss_rows is not None else 0
    return pack.row_length, patches, loss


def pad_pack(pack: Pack, row_length: int, num_patches: int, num_loss: int) -> Pack:
    """The same Pack with its per-row axes padded (with inert padding) to the given sizes."""
    sizes = dict(zip(("token", "patch", "loss"), (row_length, num_patches, num_loss)))
    have = dict(zip(("token", "patch", "loss"), pack_sizes(pack)))
    changes = {}
    for axis, names in (("token", _TOKEN_AXIS), ("patch", _PATCH_AXIS), ("loss", _LOSS_AXIS)):
        if sizes[axis] < have[axis]:
            raise ValueError(f"pad_pack: {axis} axis is {have[axis]}, cannot pad to {sizes[axis]}")
        for name in names:
            value = getattr(pack, name)
            if value is None:
                if axis == "patch" and num_patches and pack.vit_patches is None:
                    value = _empty_patch_field(name, pack.num_rows, pack.tokens)
                else:
                    continue
            if value.shape[1] == sizes[axis] and getattr(pack, name) is not None:
                continue  # already that size: np.pad would copy it (ViT patches: ~200 MB a pack)
            widths = [(0, 0)] * value.ndim
            widths[1] = (0, sizes[axis] - value.shape[1])
            changes[name] = np.pad(value, widths, constant_values=_PAD_VALUE.get(name, 0))
    return pack.replace(**changes)


def _empty_patch_field(name: str, rows: int, like: np.ndarray) -> np.ndarray:
    # A pack without images, padded to a shape with patches (a fixed shape, or another
    # process's pack with images).
    if name == "vit_patches":
        return np.zeros((rows, 0, 588), np.float32)
    return np.zeros((rows, 0), like.dtype)
