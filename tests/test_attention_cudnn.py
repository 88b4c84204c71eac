"""models/attention_cudnn.py: the cudnn backend's choice between cuDNN with lengths (no mask
array) and the dense mask, run on a CPU with jax's XLA implementation in place of cuDNN, so the
choice and the layouts are checked here and only the kernel is left to a GPU (bench/gpu_check.py
parity runs it there)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import max_diff, random_qkv

from models import attention as attention_lib
from models import attention_cudnn
from models.siglip import image_ranges

MASK, LENGTHS, SEGMENTS = attention_cudnn.PATHS


def image_rows(images_per_row, length):
    """(q ids, kv ids, k_start, k_end) of ViT rows as siglip packs them: images (runs of ids
    1, 2, ... of the given sizes) from position 0, then padding; each patch sees its own image
    (siglip.image_ranges)."""
    seg = np.zeros((len(images_per_row), length), np.int32)
    for b, sizes in enumerate(images_per_row):
        ends = np.cumsum(sizes, dtype=int)
        for i, (start, end) in enumerate(zip(ends - np.asarray(sizes, int), ends), 1):
            seg[b, start:end] = i
    k_start, k_end = (np.asarray(x) for x in image_ranges(jnp.asarray(seg)))
    return seg, seg, k_start, k_end


def branch(ids, segment_length):
    """Which of the three the backend takes for these rows."""
    return attention_cudnn.PATHS[int(attention_cudnn.path_taken(*ids, segment_length))]


@pytest.mark.parametrize(
    "images, segment_length, taken",
    [
        ([[29], [40], [], [7]], 0, LENGTHS),  # one image a row (and a row of padding)
        ([[29], [12, 20], [40]], 0, MASK),  # a row of two images, no segment layout
        ([[12, 9, 3], [16], [16, 16, 16]], 16, SEGMENTS),  # up to 48 // 16 = 3 images of <= 16
        ([[12, 17], [16]], 16, MASK),  # an image longer than the layout's rows
        ([[4, 4, 4, 4], [16]], 16, MASK),  # four images, three rows
    ],
    ids=["one_image_a_row", "two_images", "segments", "too_long", "too_many"],
)
def test_each_branch_equals_the_reference_in_output_and_gradients(images, segment_length, taken):
    """The branch the backend takes is the expected one, and its output and gradients equal
    the reference backend's (padding exactly 0, nothing NaN). Were rows of several images sent
    down the lengths path, or a segment layout used beyond what fits, their images would see
    each other or lose patches and the parity would fail."""
    rng = np.random.default_rng(11)
    ids = image_rows(images, 48)
    assert branch(ids, segment_length) == taken
    q, k, v = random_qkv(rng, len(images), 48, 48, 4, 2, 8)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def run(kernel):
        def loss(q, k, v):
            out = kernel(q, k, v, *ids)
            return jnp.sum(out * cotangent), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
        return (out, *grads)

    cudnn_as_xla = functools.partial(
        attention_cudnn.cudnn_attention, implementation="xla", segment_length=segment_length
    )
    got, want = run(cudnn_as_xla), run(attention_lib._reference)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.isfinite(np.asarray(a)).all(), name
        assert max_diff(a, b) < 2e-5, (name, max_diff(a, b))
    assert (np.asarray(got[0])[ids[0] == 0] == 0).all()


def test_only_whole_segments_from_the_start_are_plain_or_laid_out():
    """The lengths path takes one segment from position 0 that every query sees whole; the
    segment layout takes whole runs only (not causal text, not ranges that cross runs)."""
    seg = np.array([[1, 1, 1, 0]], np.int32)
    whole = (np.zeros((1, 4), np.int32), np.array([[3, 3, 3, 0]], np.int32))
    causal = (np.zeros((1, 4), np.int32), np.array([[1, 2, 3, 0]], np.int32))
    late = np.array([[0, 1, 1, 0]], np.int32)  # the segment starts at position 1
    assert branch((seg, seg, *whole), 0) == LENGTHS
    assert branch((seg, seg, *causal), 4) == MASK
    assert branch((late, late, *whole), 0) == MASK
    late_ranges = (np.array([[0, 1, 1, 0]], np.int32), np.array([[0, 3, 3, 0]], np.int32))
    assert branch((late, late, *late_ranges), 2) == SEGMENTS
    two = np.array([[1, 1, 2, 2]], np.int32)
    crossing = (np.zeros((1, 4), np.int32), np.full((1, 4), 4, np.int32))  # ranges over both
    assert branch((two, two, *crossing), 2) == MASK
