"""BAGEL's image preprocessing for the SigLIP-NaViT encoder (docs/bagel_layout.md §4.1-4.3, §10 items 8-9).

What: PIL image -> RGB on white -> resized to a stride-aligned size (the exact BAGEL resize rule)
-> float32 [H, W, 3] in [-1, 1] -> NaViT patches [N, 588] in (py, px, channel) order, plus the
flattened position ids that index the G x G learned / sin-cos tables (G = the checkpoint's
image_size // patch_size: 70 at 7B).

Why a separate, numpy-only module: the token count of every image (and hence the packed sequence
layout) is decided here, on the host, before anything reaches JAX. Getting any detail wrong
(round-half-even snapping, the over-shrinking area rule, the interleave path's VAE pre-resize,
the patch feature order, r*G+c ids) silently changes the tokens the checkpoint sees, so each
rule is implemented literally from the spec and is unit-testable without a model.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from PIL import Image

DEFAULT_MAX_PIXELS = 1_806_336
# BAGEL-7B / ThinkMorph-7B's ViT (SigLIP-so400m-14-980): 14 px patches, a 980 / 14 = 70 per side
# position grid. Another checkpoint's come from its vit_config.json (DataConfig.for_model).
PATCH_SIZE = 14
MAX_PATCHES_PER_SIDE = 70


def _check_image(image: object) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL.Image.Image, got {type(image).__name__}")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"image has zero size: {width}x{height}")
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """Return an RGB copy of `image` by BAGEL's rule (`pil_img2rgb`, docs/bagel_layout.md §4.1):
    an RGBA image, or any image with a `transparency` entry (palette or L/RGB with a tRNS
    colour), is composited onto white; every other mode is converted as it is, so the alpha of
    an LA or PA image is dropped, as BAGEL drops it (the transparent pixels keep their colour).
    """
    image = _check_image(image)
    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        # convert("RGBA") turns palette/tRNS transparency into plain RGBA.
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def _snap(side: float, stride: int) -> int:
    # Python's round() is round-half-to-even, which is what the spec (and upstream) uses; a
    # half-up rounding would give different sizes for sides that are an odd multiple of stride/2.
    return max(stride, round(side / stride) * stride)


def _scaled(width: float, height: float, scale: float, stride: int) -> tuple[int, int]:
    # §4.1 step 2: scale, round each side (half-to-even), then snap to the stride.
    return _snap(round(width * scale), stride), _snap(round(height * scale), stride)


def resized_size(
    width: int,
    height: int,
    max_size: int,
    min_size: int,
    stride: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    img_num: int = 1,
) -> tuple[int, int]:
    """The §4.1 resize rule (steps 1-4): target (new_width, new_height) for a width x height image.

    1. s = max(min(max_size / max(W, H), 1), min_size / min(W, H))   (min_size wins a conflict)
    2. each side: round(side * s), then side <- max(stride, round(side / stride) * stride)
    3. if W'H' > max_pixels / img_num: redo 2 from (W', H') with s2 = (max_pixels / img_num) / (W'H')
       — an AREA ratio applied per side, so it over-shrinks (kept on purpose: it is what upstream does)
    4. if max(W', H') > max_size: redo 2 from (W', H') with s3 = max_size / max(W', H')
    Each of steps 3 and 4 is applied once (not iterated), so when max_size is not a multiple of
    stride the result can still exceed max_size; every preset in use has max_size % stride == 0.
    """
    for name, value in (
        ("width", width),
        ("height", height),
        ("max_size", max_size),
        ("min_size", min_size),
        ("stride", stride),
        ("max_pixels", max_pixels),
        ("img_num", img_num),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")

    scale = min(max_size / max(width, height), 1.0)
    scale = max(scale, min_size / min(width, height))
    new_w, new_h = _scaled(width, height, scale, stride)

    pixel_budget = max_pixels / img_num
    if new_w * new_h > pixel_budget:
        new_w, new_h = _scaled(new_w, new_h, pixel_budget / (new_w * new_h), stride)

    if max(new_w, new_h) > max_size:
        new_w, new_h = _scaled(new_w, new_h, max_size / max(new_w, new_h), stride)
    return new_w, new_h


@dataclasses.dataclass(frozen=True)
class ImageTransform:
    """BAGEL's `ImageTransform(max_size, min_size, stride, max_pixels)`: resize + normalize.

    Calling it returns float32 [H, W, 3] (HWC, unlike torchvision's CHW, because patchify and JAX
    want channels last) with H, W multiples of `stride`, normalized with mean = std = 0.5.
    """

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"ImageTransform.{field.name} must be a positive int, got {value!r}"
                )

    # Presets: the "Settings in use" of docs/bagel_layout.md §4.1.
    @classmethod
    def vit_chat(cls) -> ImageTransform:
        """BAGEL VLM eval (`model.chat`) and VLM SFT training (with img_num = images per sample)."""
        return cls(980, 378, 14, 2_007_040)

    @classmethod
    def vit_interleave(cls) -> ImageTransform:
        """BAGEL app / notebook / InterleaveInferencer and ThinkMorph inference (after vae_resize)."""
        return cls(980, 224, 14)

    @classmethod
    def vit_thinkmorph_train(cls) -> ImageTransform:
        """`unified_edit` / ThinkMorph interleaved training."""
        return cls(518, 224, 14)

    @classmethod
    def vae_resize(cls) -> ImageTransform:
        """The VAE transform; its resize step is the interleave path's pre-resize."""
        return cls(1024, 512, 16)

    def target_size(self, width: int, height: int, img_num: int = 1) -> tuple[int, int]:
        """(new_width, new_height) this transform resizes a width x height image to."""
        return resized_size(
            width, height, self.max_size, self.min_size, self.stride, self.max_pixels, img_num
        )

    def resize(self, image: Image.Image, img_num: int = 1) -> Image.Image:
        """RGB-on-white, then the resize step only (no normalization); returns a PIL RGB image."""
        image = to_rgb(image)
        size = self.target_size(*image.size, img_num=img_num)
        # PIL's BICUBIC resize is antialiased (its filter support widens when downscaling); it is
        # exactly the call torchvision's Resize(antialias=True) makes on a PIL image.
        return image.resize(size, Image.BICUBIC)

    def __call__(self, image: Image.Image, img_num: int = 1) -> np.ndarray:
        return normalize(self.resize(image, img_num))


def normalize(image: Image.Image) -> np.ndarray:
    """uint8 RGB PIL image -> float32 [H, W, 3] in [-1, 1].

    Done in float32 in the same order as ToTensor (x / 255) then Normalize ((x - 0.5) / 0.5), so
    the values match torchvision bit for bit; black maps to exactly -1 and white to exactly 1.
    """
    array = np.asarray(_check_image(image).convert("RGB"), dtype=np.float32)
    array = array / np.float32(255.0)
    return (array - np.float32(0.5)) / np.float32(0.5)


def interleave_transform(
    image: Image.Image,
    vit: ImageTransform | None = None,
    vae: ImageTransform | None = None,
) -> np.ndarray:
    """The `interleave_inference` path: VAE resize step (1024/512/16) first, then the ViT transform.

    The double resize changes the token count versus resizing directly (640x480 -> 688x512 ->
    686x518 = 1813 patches, instead of 644x476 = 1564), so use this only where upstream does.
    """
    vit = ImageTransform.vit_interleave() if vit is None else vit
    vae = ImageTransform.vae_resize() if vae is None else vae
    return vit(vae.resize(image))


def patchify(image_hwc: np.ndarray, patch_size: int = PATCH_SIZE) -> np.ndarray:
    """[H, W, C] -> [(H/p)(W/p), p*p*C]: tokens row-major over the patch grid, features (py, px, c).

    Channel is fastest inside a token because the checkpoint's patch embedding is a Linear
    [1152, 588] in that order (docs/bagel_layout.md §4.2, §10 item 8); a CHW-style flatten would be wrong.
    """
    image_hwc = np.asarray(image_hwc)
    if image_hwc.ndim != 3:
        raise ValueError(f"patchify expects [H, W, C], got shape {image_hwc.shape}")
    height, width, channels = image_hwc.shape
    if height == 0 or width == 0 or height % patch_size or width % patch_size:
        raise ValueError(
            f"image size {height}x{width} (HxW) must be a positive multiple of patch_size "
            f"{patch_size}"
        )
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = image_hwc.reshape(grid_h, patch_size, grid_w, patch_size, channels)
    patches = patches.transpose(0, 2, 1, 3, 4)  # [gh, gw, py, px, c]
    return patches.reshape(grid_h * grid_w, patch_size * patch_size * channels)


def unpatchify(
    patches: np.ndarray, grid_h: int, grid_w: int, patch_size: int = PATCH_SIZE
) -> np.ndarray:
    """Inverse of `patchify`: [grid_h*grid_w, p*p*C] -> [grid_h*p, grid_w*p, C]."""
    patches = np.asarray(patches)
    if patches.ndim != 2 or patches.shape[0] != grid_h * grid_w:
        raise ValueError(f"expected [{grid_h * grid_w}, p*p*C] patches, got {patches.shape}")
    channels, rem = divmod(patches.shape[1], patch_size * patch_size)
    if rem or channels == 0:
        raise ValueError(f"feature size {patches.shape[1]} is not a multiple of {patch_size}^2")
    image = patches.reshape(grid_h, grid_w, patch_size, patch_size, channels)
    return image.transpose(0, 2, 1, 3, 4).reshape(
        grid_h * patch_size, grid_w * patch_size, channels
    )


def vit_position_ids(
    grid_h: int,
    grid_w: int,
    max_patches_per_side: int = MAX_PATCHES_PER_SIDE,
) -> np.ndarray:
    """Flattened (row-major) ids into the G x G position tables (G = `max_patches_per_side`, 70
    for BAGEL-7B) for a grid_h x grid_w patch grid.

    Extrapolate, the release's setting and the only one ported: id(r, c) = r*G + c, the top-left
    sub-block of the table, never r*grid_w + c (docs/bagel_layout.md §10 item 4).
    """
    if grid_h <= 0 or grid_w <= 0:
        raise ValueError(f"grid must be non-empty, got {grid_h}x{grid_w}")
    if grid_h > max_patches_per_side or grid_w > max_patches_per_side:
        # Beyond 70 per side the ids would alias other rows / overrun the table.
        raise ValueError(
            f"grid {grid_h}x{grid_w} (rows x columns) exceeds the ViT position grid of "
            f"{max_patches_per_side} patches per side"
        )
    rows = np.arange(grid_h, dtype=np.int64)
    cols = np.arange(grid_w, dtype=np.int64)
    ids = rows[:, None] * max_patches_per_side + cols[None, :]
    return ids.reshape(-1).astype(np.int32)


class VitImageInputs(NamedTuple):
    """Everything a sequence packer needs for one image."""

    patches: np.ndarray  # float32 [N, patch*patch*3], N = grid_h * grid_w
    position_ids: np.ndarray  # int32 [N]
    grid_h: int
    grid_w: int

    @property
    def num_tokens(self) -> int:
        return self.grid_h * self.grid_w


def prepare_vit_image(
    image: Image.Image,
    transform: ImageTransform,
    *,
    img_num: int = 1,
    pre_resize: ImageTransform | None = None,
    patch_size: int = PATCH_SIZE,
    max_patches_per_side: int = MAX_PATCHES_PER_SIDE,
) -> VitImageInputs:
    """PIL image -> patches, position ids and grid for the ViT.

    `pre_resize` applies another transform's resize step first: pass `ImageTransform.vae_resize()`
    to reproduce the interleave-inference path (§4.1); leave None for chat/eval and training.
    """
    original = _check_image(image).size
    if pre_resize is not None:
        image = pre_resize.resize(image)
    pixels = transform(image, img_num=img_num)
    height, width, _ = pixels.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    if max(grid_h, grid_w) > max_patches_per_side:
        # Ids past the grid would index other rows of the position tables, or past them.
        raise ValueError(
            f"a {original[0]}x{original[1]} image resized to {width}x{height} px is "
            f"{grid_w}x{grid_h} patches of {patch_size} px, more than the ViT position grid of "
            f"{max_patches_per_side} per side (the checkpoint's image_size // patch_size); keep "
            f"the transform's max_size <= {max_patches_per_side * patch_size}"
        )
    patches = patchify(pixels, patch_size)
    ids = vit_position_ids(grid_h, grid_w, max_patches_per_side)
    return VitImageInputs(patches, ids, grid_h, grid_w)
