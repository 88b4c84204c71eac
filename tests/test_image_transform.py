"""Tests for opsd_jax.data.image_transform (docs/bagel_layout.md §4.1-4.3).

Every expected size / id below was worked out by hand from the spec's rules (the working is in the
comments), not by running the code, so a deviation from the spec fails a test.
"""

import numpy as np
import pytest
from PIL import Image

from opsd_jax.data.image_transform import (
    ImageTransform,
    interleave_transform,
    patchify,
    prepare_vit_image,
    resized_size,
    to_rgb,
    unpatchify,
    vit_position_ids,
)

VIT = (980, 224, 14)  # interleave / inference ViT transform
VAE = (1024, 512, 16)
CHAT = (980, 378, 14, 2_007_040)


def _gray(width, height, value=128):
    return Image.new("RGB", (width, height), (value, value, value))


# ---------------------------------------------------------------- resize rule (§4.1 steps 1-4)


def test_spec_example_direct_vit():
    # s = max(min(980/640, 1), 224/480) = 1; 640/14 = 45.71 -> 46 -> 644; 480/14 = 34.29 -> 34 -> 476.
    assert resized_size(640, 480, *VIT) == (644, 476)


def test_spec_example_interleave_path_sizes():
    # VAE: s = max(min(1024/640, 1), 512/480) = 1.0667; 640*s = 682.67 -> 683, 683/16 = 42.69 -> 43
    # -> 688; 480*s = 512 -> 512. Then ViT on 688x512: s = 1; 688/14 = 49.14 -> 49 -> 686;
    # 512/14 = 36.57 -> 37 -> 518.
    assert resized_size(640, 480, *VAE) == (688, 512)
    assert resized_size(688, 512, *VIT) == (686, 518)
    assert ImageTransform.vae_resize().resize(_gray(640, 480)).size == (688, 512)
    assert interleave_transform(_gray(640, 480)).shape == (518, 686, 3)


def test_chat_preset_640x480():
    # (980, 378, 14, 2_007_040): s = max(min(980/640, 1), 378/480 = 0.7875) = 1 -> 640x480;
    # snap as in the direct ViT case -> 644x476; area 306,544 < 2,007,040; max side 644 <= 980.
    assert resized_size(640, 480, *CHAT) == (644, 476)
    assert ImageTransform.vit_chat().target_size(640, 480) == (644, 476)


def test_max_pixels_area_rule_overshrinks():
    # Chat preset, 980x980, img_num=3: s = 1, 980 = 70*14 stays. Budget 2,007,040/3 = 669,013.33
    # < 960,400, so s2 = 669,013.33/960,400 = 0.6966 (an AREA ratio) and each side becomes
    # round(980*s2) = round(682.67) = 683 -> 683/14 = 48.79 -> 49 -> 686. (A sqrt rule would give
    # ~818.) With img_num=1 the budget is not hit.
    assert resized_size(980, 980, *CHAT, img_num=3) == (686, 686)
    assert resized_size(980, 980, *CHAT, img_num=1) == (980, 980)
    assert ImageTransform.vit_chat()(_gray(980, 980), img_num=3).shape == (686, 686, 3)


def test_area_rule_starts_from_snapped_size_with_half_even_tie():
    # Chat preset, 1960x1470, img_num=3: s = max(min(980/1960, 1), 378/1470) = 0.5 -> 980x735.
    # Snap: 980 stays; 735/14 = 52.5 -> round-half-even 52 -> 728 (half-up would be 742).
    # Area 980*728 = 713,440 > 669,013.33 -> s2 = 0.93773, applied to the SNAPPED (980, 728):
    # W: 669,013.33/728 = 918.97 -> 919 -> 919/14 = 65.64 -> 66 -> 924;
    # H: 669,013.33/980 = 682.67 -> 683 -> 686.
    assert resized_size(1960, 1470, *CHAT, img_num=3) == (924, 686)


def test_round_half_even_in_stride_snap():
    # ViT preset, s = 1 for all (max side < 980, min side 500 > 224). Height 500/14 = 35.71 -> 504.
    # 735/14 = 52.5 -> 52 (even, rounds down) -> 728; half-up would give 742.
    # 749/14 = 53.5 -> 54 (even, rounds up) -> 756; 763/14 = 54.5 -> 54 (rounds down) -> 756.
    assert resized_size(735, 500, *VIT) == (728, 504)
    assert resized_size(749, 500, *VIT) == (756, 504)
    assert resized_size(763, 500, *VIT) == (756, 504)


def test_round_half_even_in_scaled_side():
    # ViT preset, 1960x993: s = max(min(980/1960, 1), 224/993) = 0.5. 993*0.5 = 496.5 -> 496 (even);
    # 496/14 = 35.43 -> 35 -> 490. Half-up would give 497 -> 35.5 -> 36 -> 504. Width 980.
    assert resized_size(1960, 993, *VIT) == (980, 490)
    assert resized_size(993, 1960, *VIT) == (490, 980)  # same tie on the width


def test_max_size_rule_after_min_size_upscale_tall():
    # ViT preset, 100x1000: s = max(min(0.98, 1), 224/100) = 2.24 -> 224x2240 (both multiples of 14).
    # Area 501,760 fine; max side 2240 > 980 -> s3 = 980/2240 = 0.4375 -> 98x980 (7x70 patches).
    assert resized_size(100, 1000, *VIT) == (98, 980)
    out = prepare_vit_image(_gray(100, 1000), ImageTransform.vit_interleave())
    assert (out.grid_h, out.grid_w) == (70, 7)


def test_all_three_rules_wide():
    # ViT preset, 2000x50: s = max(0.49, 224/50 = 4.48) = 4.48 -> 8960x224 (640*14, 16*14).
    # Area 8960*224 = 2,007,040 > 1,806,336 -> s2 = 0.9: W 8064 -> 8064 (576*14);
    # H 201.6 -> 202 -> 202/14 = 14.43 -> 14 -> 196. Max side 8064 > 980 -> s3 = 980/8064:
    # W 980; H 196*980/8064 = 23.82 -> 24 -> 24/14 = 1.71 -> 2 -> 28.
    assert resized_size(2000, 50, *VIT) == (980, 28)


def test_max_size_rule_is_single_pass():
    # max_size not a multiple of stride: (90, 20, 16) on 90x45. s = 1; 90/16 = 5.625 -> 6 -> 96;
    # 45/16 = 2.81 -> 3 -> 48. 96 > 90 -> s3 = 0.9375: 96*s3 = 90 -> 96 again; 48*s3 = 45 -> 48.
    # The spec applies step 4 once, so the result (96x48) still exceeds max_size.
    assert resized_size(90, 45, 90, 20, 16) == (96, 48)


def test_tiny_image_is_scaled_up():
    # ViT preset, 10x20: s = max(1, 224/10) = 22.4 -> 224x448 (16 and 32 patches of 14).
    assert resized_size(10, 20, *VIT) == (224, 448)
    # 1x1: s = 224 -> 224x224.
    assert resized_size(1, 1, *VIT) == (224, 224)
    out = ImageTransform.vit_interleave()(_gray(10, 20))
    assert out.shape == (448, 224, 3)


def test_snap_never_below_stride():
    # (980, 1, 14) on 3x3: s = 1; round(3/14) = 0 -> max(14, 0) = 14.
    assert resized_size(3, 3, 980, 1, 14) == (14, 14)


def test_thinkmorph_train_preset():
    # (518, 224, 14) on 1036x700: s = max(min(518/1036, 1), 224/700) = 0.5 -> 518x350.
    # 518 = 37*14; 350/14 = 25 -> 350.
    assert ImageTransform.vit_thinkmorph_train().target_size(1036, 700) == (518, 350)


def test_resize_argument_errors():
    with pytest.raises(ValueError, match="width"):
        resized_size(0, 10, *VIT)
    with pytest.raises(ValueError, match="img_num"):
        resized_size(10, 10, *VIT, img_num=0)
    with pytest.raises(ValueError, match="stride"):
        ImageTransform(980, 224, 0)


# ---------------------------------------------------------------- RGB conversion, normalization


def test_rgba_transparent_pixel_becomes_white():
    rgba = Image.new("RGBA", (2, 1))
    rgba.putpixel((0, 0), (10, 20, 30, 0))  # fully transparent -> white
    rgba.putpixel((1, 0), (10, 20, 30, 255))  # opaque -> unchanged
    rgb = to_rgb(rgba)
    assert rgb.mode == "RGB"
    assert rgb.getpixel((0, 0)) == (255, 255, 255)
    assert rgb.getpixel((1, 0)) == (10, 20, 30)


def test_la_image_keeps_its_colours_as_bagel_converts_it():
    """BAGEL composites only RGBA and images with a transparency entry; an LA image goes
    through a plain convert("RGB"), its alpha dropped (a transparent black pixel stays black)."""
    la = Image.new("LA", (2, 1))
    la.putpixel((0, 0), (0, 0))
    la.putpixel((1, 0), (50, 255))
    rgb = to_rgb(la)
    assert rgb.getpixel((0, 0)) == (0, 0, 0)
    assert rgb.getpixel((1, 0)) == (50, 50, 50)


def test_palette_with_transparency_becomes_white():
    pal = Image.new("P", (2, 1))
    pal.putpalette([255, 0, 0, 0, 0, 255] + [0] * (256 * 3 - 6))  # 0 = red, 1 = blue
    pal.putpixel((0, 0), 0)
    pal.putpixel((1, 0), 1)
    pal.info["transparency"] = 1  # index 1 (blue) is transparent
    rgb = to_rgb(pal)
    assert rgb.getpixel((0, 0)) == (255, 0, 0)
    assert rgb.getpixel((1, 0)) == (255, 255, 255)


def test_grayscale_converted_to_rgb():
    assert to_rgb(Image.new("L", (1, 1), 7)).getpixel((0, 0)) == (7, 7, 7)


def test_normalization_exact_values_and_range():
    img = Image.new("RGB", (14, 14), (0, 0, 0))
    img.putpixel((0, 0), (255, 255, 255))
    # 14x14 with s = 224/14 = 16 -> 224x224, so use the (14, 14, 14) transform to keep pixels exact
    # (same size -> PIL's resize copies).
    out = ImageTransform(14, 14, 14)(img)
    assert out.dtype == np.float32 and out.shape == (14, 14, 3)
    assert np.all(out[0, 0] == 1.0)  # white -> (1 - 0.5) / 0.5 = 1 exactly
    assert np.all(out[1, 1] == -1.0)  # black -> -1 exactly
    mid = ImageTransform(14, 14, 14)(_gray(14, 14, 51))
    np.testing.assert_allclose(mid, (51 / 255 - 0.5) / 0.5, rtol=0, atol=1e-7)  # -0.6
    big = interleave_transform(Image.effect_noise((300, 200), 80))
    assert big.min() >= -1.0 and big.max() <= 1.0


def test_resampling_is_antialiased_bicubic():
    # 28x28, left half 64, right half 192, halved by (14, 14, 14) (s = 0.5 -> 14x14). Rows are
    # uniform, so only the horizontal filter matters. PIL bicubic (a = -0.5) widened by the scale 2:
    # output x samples source x' at distances d = (x' + 0.5 - (2x + 1)) / 2, weights k(d) / 2 with
    # k(.25) = .8671875, k(.75) = .2265625, k(1.25) = -.0703125, k(1.75) = -.0234375 (sum 2).
    # x=5 (centre 11): only x'=14 (d = 1.75) is bright -> 64 + 128 * (-.0234375 / 2) = 62.5 (a
    #   negative lobe: undershoot; bilinear/nearest give 64).
    # x=6 (centre 13): x'=14,15,16 bright -> 64 + 128 * (.2265625 - .0703125 - .0234375) / 2 = 72.5
    #   (bilinear gives 80). x=8 mirrors x=5: 193.5.
    src = np.full((28, 28, 3), 64, np.uint8)
    src[:, 14:] = 192
    row = np.asarray(ImageTransform(14, 14, 14).resize(Image.fromarray(src)))[7, :, 0].astype(int)
    assert row[5] in (62, 63) and row[6] in (72, 73) and row[8] in (193, 194)
    assert row[0] == 64 and row[13] == 192


def test_bad_image_inputs():
    with pytest.raises(TypeError):
        ImageTransform.vit_chat()(np.zeros((14, 14, 3), np.uint8))
    with pytest.raises(ValueError, match="zero size"):
        to_rgb(Image.new("RGB", (0, 5)))


# ---------------------------------------------------------------- patchify (§4.2)


def test_patchify_layout():
    # 28x42 image (2x3 grid of 14x14 patches); pixel (y, x, ch) holds y*10000 + x*10 + ch.
    y, x, ch = np.meshgrid(np.arange(28), np.arange(42), np.arange(3), indexing="ij")
    img = (y * 10000 + x * 10 + ch).astype(np.int64)
    patches = patchify(img)
    assert patches.shape == (6, 588)
    # Token t = pr*3 + pc, feature f = (py*14 + px)*3 + ch; value = (pr*14+py)*10000+(pc*14+px)*10+ch.
    assert patches[0, 0] == 0
    assert patches[0, 1] == 1  # channel fastest: f=1 -> ch=1 of pixel (0, 0)
    assert patches[0, 3] == 10  # f=3 -> px=1 -> x=1
    assert patches[0, 42] == 10000  # f=42 -> py=1, px=0 -> y=1
    assert patches[4, 0] == 140140  # token 4 = (pr 1, pc 1) -> y=14, x=14
    assert patches[5, 100] == 160331  # token 5 = (1, 2); f=100 -> py=2, px=5, ch=1 -> y=16, x=33
    assert patches[2, 587] == 130412  # token 2 = (0, 2); f=587 -> py=13, px=13, ch=2 -> y=13, x=41
    np.testing.assert_array_equal(unpatchify(patches, 2, 3), img)


def test_patchify_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple"):
        patchify(np.zeros((28, 30, 3)))
    with pytest.raises(ValueError, match=r"\[H, W, C\]"):
        patchify(np.zeros((28, 28)))


# ---------------------------------------------------------------- position ids (§4.3)


def test_extrapolate_position_ids():
    ids = vit_position_ids(3, 4)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [0, 1, 2, 3, 70, 71, 72, 73, 140, 141, 142, 143])
    with pytest.raises(ValueError, match="exceeds"):
        vit_position_ids(71, 1)


# ---------------------------------------------------------------- full image -> packer inputs


def test_prepare_vit_image_spec_token_counts():
    img = _gray(640, 480)
    vit = ImageTransform.vit_interleave()
    inter = prepare_vit_image(img, vit, pre_resize=ImageTransform.vae_resize())
    assert (inter.grid_h, inter.grid_w) == (37, 49) and inter.num_tokens == 1813
    assert inter.patches.shape == (1813, 588) and inter.patches.dtype == np.float32
    assert inter.position_ids.shape == (1813,)
    assert inter.position_ids[48] == 48 and inter.position_ids[49] == 70  # row 1 starts at 70
    assert inter.position_ids[-1] == 36 * 70 + 48
    direct = prepare_vit_image(img, vit)
    assert (direct.grid_h, direct.grid_w) == (34, 46) and direct.num_tokens == 1564
    # A uniform gray image stays uniform through bicubic resampling: every feature is (128/255-.5)/.5.
    np.testing.assert_allclose(direct.patches, (128 / 255 - 0.5) / 0.5, rtol=0, atol=1e-6)
