"""Packing into prepared memory (opsd_jax/training/pack_memory.py): the step's arrays are the
prepared ones, written in place with no stacking copy, and hold exactly what packing into new
arrays gives; a slice is never handed out twice, so a step packed twice (length buckets) still
gets clean arrays."""

import jax
import numpy as np
import pytest
from test_opsd_packs import SPECIAL
from test_sft import SAMPLES
from test_step_batches import batches_for

from models.pack import Pack
from opsd_jax.data import packing
from opsd_jax.data.packing import Text, pack_samples

SAMPLES_2X2 = SAMPLES[:2] * 2  # 2 micro-batches of 2 samples
SHORT, LONG = [[7], [8, 9]], [[7] * 40, [9] * 38]


def host_pack(batches, completions, memory=None):
    """`batches.host_pack` packing into `memory` (None: into new arrays)."""
    batches.memory.take = lambda: memory
    return batches.host_pack(0, SAMPLES_2X2, completions)


def assert_same_arrays(got, want):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        nan = np.issubdtype(a.dtype, np.floating)  # the drawn log-probs: NaN where none
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=nan), jax.tree_util.keystr(
            path
        )


def test_packing_into_prepared_memory_writes_in_place_what_new_arrays_hold():
    want = host_pack(batches_for("opsd"), SHORT + SHORT)
    batches = batches_for("opsd")
    memory = batches.memory.make(0)
    got = host_pack(batches, SHORT + SHORT, memory)
    assert got[0] == want[0] == 0 and got[2] == want[2] and got[3] == want[3]
    # The student's and teacher's packs, then the rollout's drawn log-probs (OPSD's third part).
    assert len(got[1]) == len(memory.parts) == 3
    for part, prepared, reference in zip(got[1], memory.parts, want[1]):
        assert isinstance(part, Pack) == (part is not got[1][2])
        assert not isinstance(part, Pack) or part.vit_patches is not None
        # Every array is the prepared one itself: nothing was stacked or copied.
        for (path, array), mine in zip(
            jax.tree_util.tree_leaves_with_path(part), jax.tree.leaves(prepared)
        ):
            assert array is mine, jax.tree_util.keystr(path)
        assert_same_arrays(part, reference)


def test_a_slice_is_handed_out_once_and_only_for_its_bucket():
    memory = batches_for("opsd").memory.make(0)
    assert memory.views(0, 1) is None  # another bucket's shapes
    first = memory.views(0, 0)
    assert first is not None and np.shares_memory(first[0].tokens, memory.parts[0].tokens)
    assert memory.views(0, 0) is None  # already written: the packer makes new arrays


def test_a_step_packed_again_in_a_larger_bucket_gets_clean_arrays():
    # Memory for bucket 1: the first pass packs micro-batch 1 (long) into its slice; the
    # second, every micro-batch at bucket 1, must not reuse that written slice.
    want = host_pack(batches_for("opsd", pack_length_buckets=2), SHORT + LONG)
    batches = batches_for("opsd", pack_length_buckets=2)
    memory = batches.memory.make(1)
    got = host_pack(batches, SHORT + LONG, memory)
    assert got[0] == want[0] == 1
    for part, reference in zip(got[1], want[1]):
        assert_same_arrays(part, reference)


def test_the_next_steps_memory_is_made_after_a_step_is_packed():
    batches = batches_for("opsd")
    batches.pack(0, SAMPLES_2X2, SHORT + SHORT)
    memory = batches.memory.take()
    assert memory is not None and memory.bucket == 0
    empty = batches.empty_parts(0)
    for prepared, part in zip(memory.parts, empty):  # every slice holds an empty pack
        for array, value in zip(jax.tree.leaves(prepared), jax.tree.leaves(part)):
            assert array.shape == (2, *value.shape)  # NaN in the drawn log-probs: equal
            np.testing.assert_array_equal(array, np.broadcast_to(value, array.shape))
    assert batches.memory.take() is None  # taken once


def test_pack_samples_names_an_out_array_of_the_wrong_shape():
    out = pack_samples([[Text([5, 6], loss=True)]], 8, max_patches=4, special=SPECIAL)
    with pytest.raises(
        ValueError, match=r"out\.tokens is \(1, 8\) int32, the pack needs \(1, 16\)"
    ):
        pack_samples([[Text([5, 6], loss=True)]], 16, max_patches=4, special=SPECIAL, out=out)


def test_stack_takes_the_prepared_array_only_where_every_micro_batch_wrote_into_its_slice():
    memory = batches_for("opsd").memory.make(0)
    views = [memory.views(m, 0)[0] for m in range(2)]  # the student part of each micro-batch
    views[0].tokens[0, :3] = [5, 6, 7]
    elsewhere = views[1].replace(tokens=np.full_like(views[1].tokens, 9))  # a new array
    stacked = memory.stack(0, [views[0], elsewhere])
    assert stacked.positions is memory.parts[0].positions
    assert stacked.tokens is not memory.parts[0].tokens
    np.testing.assert_array_equal(stacked.tokens, np.stack([views[0].tokens, elsewhere.tokens]))


def test_large_image_copies_run_on_threads_and_pack_the_same(monkeypatch):
    """Above packing._THREADED_COPY_BYTES the patches are copied on a thread pool (a 7B step's
    ~0.5 GB of them sits on the step's path); the packs are the same as copied one by one."""
    want = host_pack(batches_for("opsd"), SHORT + SHORT)
    monkeypatch.setattr(packing, "_THREADED_COPY_BYTES", 0)
    monkeypatch.setattr(packing, "_copy_pool", None)
    got = host_pack(batches_for("opsd"), SHORT + SHORT)
    assert packing._copy_pool is not None
    assert got[1][0].vit_patches.any()  # there were patches to copy
    for part, reference in zip(got[1], want[1]):
        assert_same_arrays(part, reference)
