"""Fixed pack shapes: derived sizes, several samples per row, cuts / drops, length buckets."""

import numpy as np
import pytest
from test_opsd_packs import OPTIONS, SPECIAL, encode, sample

from configs import common, smoke, thinkmorph_7b
from opsd_jax.data.image_transform import PATCH_SIZE, ImageTransform
from opsd_jax.data.opsd_packs import build_training_packs
from opsd_jax.data.pack_shapes import (
    PackShape,
    choose_bucket,
    cut_report,
    fit_rows,
    image_patches,
    pack_shapes,
)
from opsd_jax.data.sft_packs import build_sft_packs


def test_derived_sizes_of_the_7b_recipe():
    """max_forward_tokens=10240 gives 10240-token teacher rows (not 16384); a full 1024-token
    completion's 1025 loss entries give 1152 entries per row (not 2048)."""
    shapes = pack_shapes(thinkmorph_7b.get_config())
    teacher, student = shapes["teacher"], shapes["student"]
    assert len(teacher) == len(student) == 1  # one compiled step by default
    # The largest image: 980 px / 14 = 70 patches a side = 4900 patches.
    assert teacher[0] == PackShape(10240, 10240, 1152)
    assert student[0] == PackShape(6272, 4992, 1152)  # 4902 + 1026 + 256 -> 6184 -> 6272


@pytest.mark.parametrize("stride", [14, 28])
def test_the_largest_image_is_counted_in_vit_patches_whatever_the_stride(stride):
    """A stride of 28 snaps sides to 28 px, but the ViT still cuts 14-px patches: the count is
    the resize rule's largest image (a large square, resized to 980 px: max_pixels is above
    980^2) in 14-px patches, 4900 for either stride."""
    transform = ImageTransform(980, 224, stride)
    width, height = transform.target_size(4000, 4000)
    want = (width // PATCH_SIZE) * (height // PATCH_SIZE)
    got = image_patches(dict(max_size=980, stride=stride, max_pixels=transform.max_pixels))
    assert got == want == 4900


def test_the_offline_row_has_the_problem_image_only_and_reference_targets():
    """Offline mode (configs/offline_7b.py): one pack, the text-only view. Its patches are one
    problem image (no VT images), its loss entries bounded by the row like SFT's targets."""
    from configs import offline_7b

    (shape,) = pack_shapes(offline_7b.get_config())["offline"]
    assert shape == PackShape(10240, 4992, 10240)  # 4900 patches -> 4992


def test_explicit_sizes_win_and_buckets_scale_every_size():
    config = smoke.get_config()
    with config.unlocked():
        config.pack_length_buckets = 2
    shapes = pack_shapes(config)
    assert shapes["teacher"] == [PackShape(512, 128, 64), PackShape(1024, 256, 64)]
    assert shapes["student"] == [PackShape(256, 128, 64), PackShape(512, 128, 64)]
    sft = common.base_config()
    with sft.unlocked():
        sft.mode = "sft"
    (shape,) = pack_shapes(sft)["sft"]
    assert shape.row_length == shape.loss_entries == 10240  # SFT targets: bounded by the row


def test_fit_rows_shares_rows_cuts_and_drops():
    # dims: tokens, patches (not cuttable)
    needs = [[60, 4], [50, 4], [40, 4], [30, 20]]
    rows, cuts = fit_rows(needs, [100, 16], 2, cuttable=[0, 0, 10, 30], cut_dims=[True, False])
    assert rows == [0, 1, 0, None]  # 60 + 40 | 50 (first fit); the 4th needs 20 patches: dropped
    assert cuts == [0, 0, 0, 0]
    # Whole, the three do not fit one row; cut, they do: rows by the smallest sizes, the room
    # left goes to the shortest completions first, so only the long one is cut.
    rows, cuts = fit_rows([[30], [20], [80]], [100], 1, cuttable=[5, 10, 70], cut_dims=[True])
    assert rows == [0, 0, 0] and cuts == [0, 0, 30]
    rows, cuts = fit_rows([[60], [50], [45]], [100], 1, cuttable=[0, 0, 20], cut_dims=[True])
    assert rows == [0, None, 0] and cuts == [0, 0, 5]  # the 50 cannot be cut: dropped
    index, rows, _ = choose_bucket([[60], [50]], [np.array([64]), np.array([128])], 1)
    assert index == 1 and rows == [0, 0]
    index, rows, _ = choose_bucket([[60]], [np.array([64]), np.array([128])], 1)
    assert index == 0


SHAPES = {"student": [PackShape(64, 16, 16)], "teacher": [PackShape(96, 16, 16)]}


def test_training_packs_take_the_fixed_shape_and_cut_completions_that_do_not_fit():
    samples = [sample("a"), sample("b", "qq")]
    packs = build_training_packs(
        samples,
        [[7, 8], [9]],
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=1,
        max_forward_tokens=256,
        shapes=SHAPES,
    )
    assert packs.student.tokens.shape == (1, 64) and packs.teacher.tokens.shape == (1, 96)
    assert packs.student.vit_patches.shape == (1, 16, 588)
    assert packs.student.loss_rows.shape == packs.teacher.loss_rows.shape == (1, 16)
    assert packs.kept == [0, 1] and packs.num_truncated == 0 and packs.num_dropped == 0
    assert set(np.unique(packs.teacher.segment_ids)) == {0, 1, 2}  # two samples in one row
    # Entries align: same targets, same samples, same mask.
    for field in ("loss_targets", "loss_mask", "loss_sample"):
        np.testing.assert_array_equal(getattr(packs.student, field), getattr(packs.teacher, field))

    # A long completion no longer fits next to the other sample: it is cut, in both packs.
    long = list(range(10, 40))
    packs = build_training_packs(
        samples,
        [[7, 8], long],
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=1,
        max_forward_tokens=256,
        shapes=SHAPES,
    )
    assert packs.num_truncated == 1 and packs.kept == [0, 1]
    assert 0 < len(packs.completions[1]) < len(long) and packs.completions[0] == [7, 8]
    assert int(packs.student.loss_mask.sum()) == 2 + 1 + len(packs.completions[1]) + 1
    for field in ("loss_targets", "loss_mask"):
        np.testing.assert_array_equal(getattr(packs.student, field), getattr(packs.teacher, field))


def test_a_sample_whose_context_alone_is_too_long_is_dropped_and_counted_not_fatal():
    """Over max_forward_tokens before its completion: dropped and counted beside one that fits;
    alone (one sample a micro-batch), an all-padding pack with nothing to learn from."""
    long = sample("long", question="q" * 300)
    kwargs = dict(num_rows=1, max_forward_tokens=96, shapes=SHAPES)
    packs = build_training_packs(
        [sample("a"), long], [[7, 8], [9]], encode, OPTIONS, SPECIAL, **kwargs
    )
    assert packs.kept == [0] and packs.num_dropped == 1
    alone = build_training_packs([long], [[9]], encode, OPTIONS, SPECIAL, **kwargs)
    assert alone.kept == [] and alone.num_dropped == 1
    assert alone.student.tokens.shape == (1, 64) and alone.teacher.tokens.shape == (1, 96)
    assert not alone.student.loss_mask.any() and not alone.teacher.segment_ids.any()


def test_sft_pack_takes_the_fixed_shape_and_samples_that_fit_no_row_are_dropped():
    long = sample("long", question="q" * 80)
    long.full_text_only_thought, long.thoughts = "", []
    short = sample("s")
    short.full_text_only_thought = "x"
    kwargs = dict(num_rows=1, max_forward_tokens=256, shapes=[PackShape(96, 8, 48)])
    packs = build_sft_packs([short, long], encode, OPTIONS, SPECIAL, **kwargs)
    assert packs.kept == [0] and packs.num_dropped == 1
    assert packs.pack.tokens.shape == (1, 96) and packs.pack.vit_patches.shape == (1, 8, 588)
    # Alone (one sample a micro-batch): an all-padding pack, counted, not the run's end.
    alone = build_sft_packs([long], encode, OPTIONS, SPECIAL, **kwargs)
    assert alone.kept == [] and alone.num_dropped == 1 and not alone.pack.loss_mask.any()
    assert alone.pack.tokens.shape == (1, 96)


def test_cut_and_dropped_samples_are_reported_with_the_sizes_to_raise():
    shapes = {"student": PackShape(512, 128, 64), "teacher": PackShape(1024, 256, 64)}
    assert cut_report(0, 0, 8, shapes) == []
    cut, dropped = cut_report(2, 1, 8, shapes)
    assert cut.startswith("2 of 8 samples since the last report had their completion cut")
    assert "student rows 512 tokens / 128 patches / 64 loss entries" in cut
    assert "teacher rows 1024 tokens" in cut and "pack_student_row_tokens" in cut
    assert dropped.startswith("1 of 8 samples since the last report were dropped")
    assert "pack_row_patches" in dropped and "pack_student_row_tokens" in dropped
