"""Student / teacher / prompt packs of Visual-OPSD against hand-written layouts."""

import dataclasses
import types

import builders
import numpy as np
import pytest

from opsd_jax.data.image_transform import VitImageInputs, vit_position_ids
from opsd_jax.data.opsd_packs import (
    build_prompt_pack,
    build_training_packs,
    prompt_shape_bound,
)
from opsd_jax.data.packing import SpecialTokens

SPECIAL = SpecialTokens(im_start=1000, im_end=1001, vision_start=1002, vision_end=1003)
IMS, IME, VS, VE = 1000, 1001, 1002, 1003
OPTIONS = builders.prompt_options(
    system_prompt="ab", reference_intro="c", transition_prompt="d", instruction_suffix="!"
)


def encode(text):
    return [ord(c) for c in text]


def vit(grid_h, grid_w, value):
    patches = np.full((grid_h * grid_w, 588), value, np.float32)
    return VitImageInputs(patches, vit_position_ids(grid_h, grid_w), grid_h, grid_w)


def sample(pid="p0", question="q", problem=(1, 2), vts=((1, 1),)):
    return types.SimpleNamespace(
        pid=pid,
        question=question,
        answer="A",
        problem_image=vit(*problem, 0.5),
        vt_images=[vit(h, w, -0.5) for h, w in vts],
        thoughts=["t0", "t1"],
    )


def real(pack, row=0):
    n = int((pack.segment_ids[row] > 0).sum())
    return {
        k: getattr(pack, k)[row, :n].tolist() for k in ("tokens", "positions", "k_start", "k_end")
    }


def test_hand_built_sample_layouts():
    packs = build_training_packs(
        [sample()], [[7, 8]], encode, OPTIONS, SPECIAL, num_rows=1, max_forward_tokens=64
    )
    q, ex = ord("q"), ord("!")
    student = real(packs.student)
    assert student["tokens"] == [IMS, 97, 98, IME, VS, 0, 0, VE, IMS, q, ex, IME, IMS, 7, 8, IME]
    assert student["positions"] == [0, 1, 2, 3, 4, 4, 4, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert student["k_end"] == [1, 2, 3, 4, 8, 8, 8, 8] + list(range(9, 17))
    assert student["k_start"] == [0] * 16
    teacher = real(packs.teacher)
    assert teacher["tokens"] == [
        IMS,
        97,
        98,
        IME,
        VS,
        0,
        0,
        VE,
        IMS,
        q,
        ex,
        IME,
        IMS,
        ord("c"),
        IME,
        VS,
        0,
        VE,
        IMS,
        ord("d"),
        IME,
        IMS,
        7,
        8,
        IME,
    ]
    assert teacher["positions"] == [
        0,
        1,
        2,
        3,
        4,
        4,
        4,
        4,
        5,
        6,
        7,
        8,
        9,
        10,
        11,
        12,
        12,
        12,
        13,
        14,
        15,
        16,
        17,
        18,
        19,
    ]
    assert teacher["k_end"][15:18] == [18, 18, 18]
    # Loss entries: outputs at <|im_start|>, 7, 8 predict 7, 8, <|im_end|>.
    assert packs.student.loss_rows[0, :3].tolist() == [12, 13, 14]
    assert packs.teacher.loss_rows[0, :3].tolist() == [21, 22, 23]
    for pack in (packs.student, packs.teacher):
        assert pack.loss_targets[0, :3].tolist() == [7, 8, IME]
        assert pack.loss_mask[0].tolist() == [True, True, True] + [False] * (
            pack.loss_mask.shape[1] - 3
        )
    # Patch slots: the problem image in both; the VT image only in the teacher, after the intro.
    assert packs.student.vit_slots[0, :2].tolist() == [5, 6]
    assert packs.teacher.vit_slots[0, :3].tolist() == [5, 6, 16]
    assert packs.teacher.vit_patches[0, 2, 0] == -0.5 and packs.teacher.vit_patches[0, 0, 0] == 0.5


def test_prompt_pack_and_toggles():
    pack = build_prompt_pack([sample(), sample(question="qq")], encode, OPTIONS, SPECIAL)
    assert pack.num_rows == 2 and pack.segment_ids.max() == 1
    assert real(pack, 1)["tokens"][-5:] == [IMS, ord("q"), ord("q"), ord("!"), IME]
    bare = builders.prompt_options(
        use_system_prompt=False, use_reference_intro=False, use_transition_prompt=False
    )
    packs = build_training_packs(
        [sample()], [[7]], encode, bare, SPECIAL, num_rows=1, max_forward_tokens=64
    )
    assert real(packs.teacher)["tokens"] == [
        VS,
        0,
        0,
        VE,
        IMS,
        ord("q"),
        IME,
        VS,
        0,
        VE,
        IMS,
        7,
        IME,
    ]
    ablation = builders.prompt_options(
        use_system_prompt=False,
        use_reference_intro=False,
        use_transition_prompt=False,
        privileged_thoughts=True,
        privileged_answer=True,
    )
    tokens = real(
        build_training_packs(
            [sample()], [[7]], encode, ablation, SPECIAL, num_rows=1, max_forward_tokens=64
        ).teacher
    )["tokens"]
    text = "".join(chr(t) for t in tokens if t < 1000 and t > 0)
    assert "t0" in text and "t1" in text and "The correct answer is A." in text


def test_student_and_teacher_entries_align_across_rows():
    samples = [sample(f"p{i}", "q" * (i + 1), vts=((1, 1),) * (1 + i % 2)) for i in range(5)]
    completions = [[10 + i] * (2 + i) for i in range(5)]
    packs = build_training_packs(
        samples, completions, encode, OPTIONS, SPECIAL, num_rows=2, max_forward_tokens=256
    )
    s, t = packs.student, packs.teacher
    assert s.num_rows == t.num_rows == 2 and s.loss_rows.shape == t.loss_rows.shape
    np.testing.assert_array_equal(s.loss_targets, t.loss_targets)
    np.testing.assert_array_equal(s.loss_mask, t.loss_mask)
    np.testing.assert_array_equal(s.loss_sample, t.loss_sample)
    assert int(s.loss_mask.sum()) == sum(len(c) + 1 for c in completions)
    # Each entry's target really is the next token at that row in each pack.
    for pack in (s, t):
        rows, cols = np.nonzero(pack.loss_mask)
        np.testing.assert_array_equal(
            pack.tokens[rows, pack.loss_rows[rows, cols] + 1], pack.loss_targets[rows, cols]
        )
    assert 0.0 <= packs.padding_fraction["teacher"] < 1.0


def test_truncation_keeps_both_packs_equal_and_drops_what_cannot_fit():
    long = [list(range(10, 60))]
    packs = build_training_packs(
        [sample()], long, encode, OPTIONS, SPECIAL, num_rows=1, max_forward_tokens=40
    )
    # Teacher context is 21 tokens; 40 - 21 - 2 markers leaves 17 completion tokens.
    assert packs.completions == [list(range(10, 27))] and packs.num_truncated == 1
    assert int((packs.teacher.segment_ids > 0).sum()) == 40
    np.testing.assert_array_equal(packs.student.loss_targets, packs.teacher.loss_targets)
    packs = build_training_packs(
        [sample(question="q" * 50), sample()],
        [[7], [8]],
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=1,
        max_forward_tokens=40,
    )
    assert packs.kept == [1]
    with pytest.raises(ValueError, match="no sample fits"):
        build_training_packs(
            [sample(question="q" * 50)],
            [[7]],
            encode,
            OPTIONS,
            SPECIAL,
            num_rows=1,
            max_forward_tokens=40,
        )


def test_noise_vt_replaces_only_vt_pixels_and_is_seeded():
    noisy = dataclasses.replace(OPTIONS, noise_vt=True)
    clean = build_training_packs(
        [sample()], [[7]], encode, OPTIONS, SPECIAL, num_rows=1, max_forward_tokens=64
    )
    a = build_training_packs(
        [sample()], [[7]], encode, noisy, SPECIAL, num_rows=1, max_forward_tokens=64
    )
    b = build_training_packs(
        [sample()], [[7]], encode, noisy, SPECIAL, num_rows=1, max_forward_tokens=64
    )
    assert a.teacher.vit_patches.shape == clean.teacher.vit_patches.shape
    np.testing.assert_array_equal(a.teacher.tokens, clean.teacher.tokens)
    np.testing.assert_array_equal(a.teacher.vit_patches[0, :2], clean.teacher.vit_patches[0, :2])
    assert not np.allclose(a.teacher.vit_patches[0, 2], clean.teacher.vit_patches[0, 2])
    np.testing.assert_array_equal(a.teacher.vit_patches, b.teacher.vit_patches)
    np.testing.assert_array_equal(a.student.vit_patches, clean.student.vit_patches)


def test_prompt_lengths_and_patches_round_up_to_the_configured_buckets():
    # A prompt of ~15 tokens and 2 patches, another of ~40 tokens and 12 patches.
    samples = [sample(), sample(question="q" * 20, problem=(3, 4))]
    pack = build_prompt_pack(samples, encode, OPTIONS, SPECIAL, buckets=(24, 48, 96))
    assert pack.row_length == 48 and pack.vit_patches.shape[1] == 24
    assert prompt_shape_bound((24, 48, 96)) == 9  # lengths x patches <= length, + no images
    with pytest.raises(ValueError, match=r"sample_prompt_buckets=\(16,\)"):
        build_prompt_pack(samples, encode, OPTIONS, SPECIAL, buckets=(16,))
