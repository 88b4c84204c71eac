"""A step's micro-batches per mode (opsd_jax/training/step_batches.py): what `pack` returns has
exactly the shapes the train step was compiled for (`abstract_batch`), and with several length
buckets every micro-batch of a step lands in the one bucket the longest needs."""

import jax
import numpy as np
import pytest
from test_opsd_packs import SPECIAL, encode
from test_sft import OPTIONS, SAMPLES

from opsd_jax import run_config
from opsd_jax.data import pack_shapes
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.training import step_flops
from opsd_jax.training.step_batches import OpsdBatches, SftBatches, step_batches_for

SIZES = dict(
    pack_row_tokens=192,
    pack_row_patches=16,
    pack_student_row_tokens=128,
    pack_student_row_patches=8,
    pack_loss_entries=64,
    samples_per_micro_batch=2,
    rows_per_micro_batch=1,
    gradient_accumulation_steps=2,
    max_forward_tokens=192,
)


def batches_for(mode, **changes):
    config = run_config.complete(dict(SIZES, mode=mode, teacher_mode="self", **changes))
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    return step_batches_for(
        mode,
        config,
        pack_shapes.pack_shapes(config),
        encode,
        OPTIONS,
        SPECIAL,
        mesh,
        local_samples=2,
        local_rows=1,
        sample_offset=0,
    )


def shapes_of(tree):
    return [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("mode, kind", [("opsd", OpsdBatches), ("sft", SftBatches)])
def test_packed_batches_have_the_compiled_shapes(mode, kind):
    batches = batches_for(mode)
    assert isinstance(batches, kind)
    samples = SAMPLES + SAMPLES[:1]  # 2 micro-batches of 2 samples
    completions = [[7, 8, 9], [7], [7, 7, 7, 7], [9]] if mode == "opsd" else None
    packed = batches.pack(0, samples, completions)
    assert packed.bucket == 0 and packed.tokens > 0
    # OPSD adds a third part: the rollout's log-probs at the student's entries (none given: NaN).
    assert len(packed.batch) == len(batches.pack_names) + (mode == "opsd")
    assert shapes_of(packed.batch) == shapes_of(batches.abstract_batch(0))
    assert all(x.shape[0] == 2 for x in jax.tree.leaves(packed.batch))  # [micro-batch, rows, ...]
    assert any(key.endswith("_padding") for key in packed.scalars)
    # What the step's FLOPs are counted from: each pack's positions, pairs and loss entries,
    # over both micro-batches, read from the very arrays put on the devices.
    assert len(packed.counts) == len(packed.batch)
    if mode == "opsd":
        assert packed.counts[2] is None and np.isnan(np.asarray(packed.batch[2])).all()
    for counts, part in zip(packed.counts, packed.batch[: len(batches.pack_names)]):
        assert counts == step_flops.counts_of(jax.device_get(part))
        assert counts.tokens == part.segment_ids.size and counts.llm_pairs > 0


def test_every_micro_batch_of_a_step_shares_the_longest_ones_bucket():
    batches = batches_for("opsd", pack_length_buckets=2)
    short, long = [[7]] * 2, [[7] * 40] * 2
    alone = batches.pack(0, SAMPLES[:2] * 2, short + short)
    assert alone.bucket == 0
    mixed = batches.pack(0, SAMPLES[:2] * 2, short + long)  # the second needs the larger bucket
    assert mixed.bucket == 1
    assert shapes_of(mixed.batch) == shapes_of(batches.abstract_batch(1))
    student = np.asarray(mixed.batch[0].segment_ids)
    assert (student[0] > 0).any() and (student[1] > 0).any()  # both micro-batches packed there
