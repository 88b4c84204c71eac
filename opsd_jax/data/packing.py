"""Sequence plans -> Packs: BAGEL's sample layout (docs/bagel_layout.md §5.3) in fixed-shape arrays.

A sample is an ordered list of items:

* `Text(ids, loss)` becomes `<|im_start|> ids <|im_end|>` with consecutive RoPE ids, causal.
  With `loss=True` the outputs at `<|im_start|>` and every text token are scored, with targets
  `ids + [<|im_end|>]` (the model learns to close the segment); the `<|im_end|>` position is not.
* `Image(patches, position_ids)` becomes `<|vision_start|> N patch slots <|vision_end|>`, every
  token at one RoPE id (the counter then advances by 1), attending bidirectionally within the
  block and to everything before it.

Samples are placed first-fit into rows of `row_length` tokens; each sample keeps its own
segment id, RoPE ids restart at 0 per sample, and the key range [k_start, k_end) of every
token encodes BAGEL's causal/full split mask exactly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Sequence

import numpy as np

from models.pack import Pack


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """BAGEL's structural ids (Qwen2.5 values by default; a toy tokenizer has its own)."""

    im_start: int = 151644
    im_end: int = 151645
    vision_start: int = 151652
    vision_end: int = 151653


@dataclasses.dataclass(frozen=True)
class Text:
    ids: Sequence[int]
    loss: bool = False


@dataclasses.dataclass(frozen=True)
class Image:
    patches: np.ndarray  # [N, 588]
    position_ids: np.ndarray  # [N] r*G + c (G: the ViT's position grid, 70 at 7B)

    def __post_init__(self):
        if self.patches.ndim != 2 or self.patches.shape[0] != len(self.position_ids):
            raise ValueError(
                f"Image: patches {self.patches.shape} and position_ids "
                f"{np.shape(self.position_ids)} disagree"
            )


def sample_length(items: Sequence[Text | Image]) -> int:
    """Tokens the sample occupies in a row (markers included)."""
    return sum(len(it.ids) + 2 if isinstance(it, Text) else len(it.patches) + 2 for it in items)


def _place_rows(
    lengths: list[int], row_length: int, num_rows: int | None, one_per_row: bool
) -> list[int]:
    """First-fit (or one sample per row): the row of every sample, in input order per row."""
    free: list[int] = []
    assignment = []
    for i, n in enumerate(lengths):
        if n > row_length:
            raise ValueError(f"sample {i} needs {n} tokens, more than row_length={row_length}")
        row = None if one_per_row else next((r for r, sp in enumerate(free) if sp >= n), None)
        if row is None:
            free.append(row_length)
            row = len(free) - 1
        free[row] -= n
        assignment.append(row)
    if num_rows is not None and len(free) > num_rows:
        raise ValueError(
            f"the samples need {len(free)} rows of {row_length} tokens, "
            f"only num_rows={num_rows} allowed"
        )
    return assignment


def pack_samples(
    samples: Sequence[Sequence[Text | Image]],
    row_length: int,
    *,
    num_rows: int | None = None,
    max_patches: int | None = None,
    max_loss_entries: int | None = None,
    special: SpecialTokens = SpecialTokens(),
    one_sample_per_row: bool = False,
    rows_of: Sequence[int] | None = None,
    out: Pack | None = None,
) -> Pack:
    """Lay samples out in fixed-shape rows. Sizes left as None are fitted to the content.

    Loss entries are listed per row in sample order and, within a sample, in sequence order;
    `loss_sample` holds the sample's index in `samples`. `one_sample_per_row` gives every
    sample its own row (sampler prompts); `rows_of` fixes every sample's row instead (so two
    packs of the same samples can share one layout). `out`: arrays to write the pack into
    instead of new ones (opsd_jax/training/pack_memory.py), each of the pack's shape and dtype and
    holding an empty pack (zeros, `vit_slots` -1); the returned Pack holds them.
    """
    lengths = [sample_length(s) for s in samples]
    if rows_of is None:
        assignment = _place_rows(lengths, row_length, num_rows, one_sample_per_row)
    else:
        assignment = list(rows_of)
        if len(assignment) != len(samples):
            raise ValueError(f"rows_of has {len(assignment)} entries for {len(samples)} samples")
        used = np.bincount(assignment, weights=lengths, minlength=1)
        if used.max() > row_length:
            raise ValueError(f"rows_of puts {int(used.max())} tokens in a row of {row_length}")
    rows = num_rows if num_rows is not None else max(assignment, default=-1) + 1
    row_patches = [0] * rows
    row_loss = [0] * rows
    for sample, row in zip(samples, assignment):
        for item in sample:
            if isinstance(item, Image):
                row_patches[row] += len(item.patches)
            elif item.loss:
                row_loss[row] += len(item.ids) + 1
    has_images = any(row_patches)
    num_patches = max(row_patches, default=0) if max_patches is None else max_patches
    num_loss = max(row_loss, default=0) if max_loss_entries is None else max_loss_entries
    if max(row_patches, default=0) > num_patches:
        raise ValueError(f"a row needs {max(row_patches)} patches, max_patches={num_patches}")
    if max(row_loss, default=0) > num_loss:
        raise ValueError(f"a row needs {max(row_loss)} loss entries, max_loss_entries={num_loss}")

    patch_dim = next(
        (it.patches.shape[1] for s in samples for it in s if isinstance(it, Image)), 588
    )
    by_row, by_patch, by_loss = (rows, row_length), (rows, num_patches), (rows, num_loss)
    shapes = dict(
        tokens=by_row,
        positions=by_row,
        segment_ids=by_row,
        k_start=by_row,
        k_end=by_row,
        vit_patches=(*by_patch, patch_dim),
        vit_pos_ids=by_patch,
        vit_slots=by_patch,
        vit_image_ids=by_patch,
        loss_rows=by_loss,
        loss_targets=by_loss,
        loss_mask=by_loss,
        loss_sample=by_loss,
    )
    arrays = _empty_arrays(shapes) if out is None else _given_arrays(out, shapes)
    tokens, positions, segment_ids = arrays["tokens"], arrays["positions"], arrays["segment_ids"]
    k_start, k_end = arrays["k_start"], arrays["k_end"]
    vit_patches, vit_pos_ids = arrays["vit_patches"], arrays["vit_pos_ids"]
    vit_slots, vit_image_ids = arrays["vit_slots"], arrays["vit_image_ids"]
    loss_rows, loss_targets = arrays["loss_rows"], arrays["loss_targets"]
    loss_mask, loss_sample = arrays["loss_mask"], arrays["loss_sample"]
    cursor, patch_cursor, loss_cursor = [0] * rows, [0] * rows, [0] * rows
    segments, images = [0] * rows, [0] * rows
    patch_copies = []  # (destination, image patches): copied together at the end

    for sample_index, (sample, row) in enumerate(zip(samples, assignment)):
        segments[row] += 1
        start = t = cursor[row]
        rope = 0
        for item in sample:
            if isinstance(item, Text):
                ids = [special.im_start, *item.ids, special.im_end]
                n = len(ids)
                span = slice(t, t + n)
                tokens[row, span] = ids
                positions[row, span] = rope + np.arange(n)
                k_end[row, span] = np.arange(t, t + n) + 1
                if item.loss:
                    c = loss_cursor[row]
                    entries = slice(c, c + n - 1)
                    loss_rows[row, entries] = np.arange(t, t + n - 1)
                    loss_targets[row, entries] = ids[1:]
                    loss_mask[row, entries] = True
                    loss_sample[row, entries] = sample_index
                    loss_cursor[row] += n - 1
                rope += n
            else:
                num = len(item.patches)
                n = num + 2
                span = slice(t, t + n)
                tokens[row, span] = [special.vision_start] + [0] * num + [special.vision_end]
                positions[row, span] = rope
                k_end[row, span] = t + n
                images[row] += 1
                p = patch_cursor[row]
                patch_copies.append((vit_patches[row, p : p + num], item.patches))
                vit_pos_ids[row, p : p + num] = item.position_ids
                vit_slots[row, p : p + num] = np.arange(t + 1, t + 1 + num)
                vit_image_ids[row, p : p + num] = images[row]
                patch_cursor[row] += num
                rope += 1
            segment_ids[row, span] = segments[row]
            k_start[row, span] = start
            t += n
        cursor[row] = t
    _copy_patches(patch_copies)

    pack = Pack(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        k_start=k_start,
        k_end=k_end,
        # Understanding packs hold no gen-expert token; None says so statically, so a model
        # built with the gen expert compiles without it (models/qwen2_mot.py).
        gen_mask=None,
        vit_patches=vit_patches if has_images else None,
        vit_pos_ids=vit_pos_ids if has_images else None,
        vit_slots=vit_slots if has_images else None,
        vit_image_ids=vit_image_ids if has_images else None,
        loss_rows=loss_rows,
        loss_targets=loss_targets,
        loss_mask=loss_mask,
        loss_sample=loss_sample,
    )
    pack.validate()
    return pack


# Image patches are most of a pack's bytes (a 7B training step copies ~0.5 GB of them, after the
# rollout and before the step can start): above this many bytes the copies run on threads (numpy
# releases the GIL while it copies), which the host's memory bandwidth rewards.
_THREADED_COPY_BYTES = 64 * 2**20
_copy_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _copy_patches(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """destination[...] = patches for every pair; on up to 8 threads when they are large."""
    global _copy_pool
    if sum(source.nbytes for _, source in copies) < _THREADED_COPY_BYTES:
        for destination, source in copies:
            destination[...] = source
        return
    if _copy_pool is None:
        workers = min(8, os.cpu_count() or 1)
        _copy_pool = concurrent.futures.ThreadPoolExecutor(workers, "patch-copy")
    list(_copy_pool.map(lambda pair: np.copyto(*pair), copies))  # waits; re-raises an error


# An empty pack's value and dtype per field (every field not named: 0, int32).
_DTYPES = {"vit_patches": np.float32, "loss_mask": np.bool_}
_FILL = {"vit_slots": -1}


def _empty_arrays(shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    return {
        name: np.full(shape, _FILL[name], np.int32)
        if name in _FILL
        else np.zeros(shape, _DTYPES.get(name, np.int32))
        for name, shape in shapes.items()
    }


def _given_arrays(out: Pack, shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """`out`'s arrays, checked against the pack's shapes and dtypes (their content is trusted to
    be an empty pack's: checking it would read every page, the cost `out` is there to save)."""
    arrays = {}
    for name, shape in shapes.items():
        array = getattr(out, name)
        dtype = np.dtype(_DTYPES.get(name, np.int32))
        if array is None or array.shape != shape or array.dtype != dtype:
            have = None if array is None else f"{array.shape} {array.dtype}"
            raise ValueError(f"pack_samples: out.{name} is {have}, the pack needs {shape} {dtype}")
        arrays[name] = array
    return arrays
