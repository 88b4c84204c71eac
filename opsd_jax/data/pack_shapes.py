"""Fixed Pack shapes: row length, ViT patches and loss entries per row, set by the config.

Why fixed: every new shape is a new compilation of the train step (minutes at 7B), and the
step is compiled ahead of time, before step 1 (train.py), for a small fixed set of shapes: one
by default, `pack_length_buckets` of them at most. Samples are then fitted into these rows,
several per row where they fit (each keeps its own segment), so a fixed row is not a padded
one-sample row.

A shape per pack: the teacher's (OPSD) or the only one (SFT, offline) comes from
`pack_row_tokens`, `pack_row_patches`; the OPSD student's from `pack_student_row_tokens`,
`pack_student_row_patches`; both packs share `pack_loss_entries` (their loss entries align).
The offline pack is the text-only view (opsd_jax/training/offline/views.py): no teacher rows (the
teacher is the cache, read at the pack's loss entries, so the cache arrays take the same fixed
[rows, loss entries, top-k] shape).
0 (the default) derives a value, rounded up to a multiple of `MULTIPLE`, with k =
ceil(samples / rows) samples per row:

* row tokens: `max_forward_tokens` (it is the teacher's per-row budget: one sample never
  exceeds it; k samples share it);
* student row tokens: k x (one problem image + a `sample_max_new_tokens` completion +
  `PROMPT_TOKENS` of system prompt and question), at most the teacher's;
* patches: k x the largest image the image transform makes (x (1 + max_reference_rounds) in a
  teacher or SFT row; the offline row has the problem image only), at most the row's tokens;
* loss entries: k x (sample_max_new_tokens + 1) (the closing EOS is scored too) in OPSD; in SFT
  and offline the targets are the reference texts, bounded only by the row.

With `pack_length_buckets = n > 1` bucket j (1..n) scales every size by j / n; a micro-batch
takes the smallest bucket that holds all its samples uncut. A sample that fits in no row of
the largest bucket has its completion cut to fit (OPSD, counted as truncated) or is dropped
(SFT, offline, or when its context alone does not fit; counted).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from opsd_jax.data.image_transform import PATCH_SIZE

MULTIPLE = 128  # sizes are rounded up to this: TPU lanes / GPU attention blocks, loss chunks
PROMPT_TOKENS = 256  # per-sample allowance for system prompt + question in the derived student row


@dataclasses.dataclass(frozen=True)
class PackShape:
    """The per-row sizes of one Pack (the row count is the config's rows per micro-batch)."""

    row_length: int
    patches: int
    loss_entries: int

    def scaled(self, fraction: float) -> PackShape:
        """Every size times `fraction`, rounded up, never above its own size."""
        return PackShape(
            *(min(v, round_up(math.ceil(v * fraction))) for v in dataclasses.astuple(self))
        )


def round_up(n: int, multiple: int = MULTIPLE) -> int:
    return max(multiple, -(-int(n) // multiple) * multiple)


def image_patches(image_transform, patch_size: int = PATCH_SIZE) -> int:
    """The most ViT patches one image can have under the resize rule (max side, max pixels).

    The resize snaps each side to the stride, so an image is whole stride cells; each cell is
    (stride / patch_size)^2 ViT patches (a stride of 28 over 14-px patches: 4 a cell)."""
    stride = image_transform["stride"]
    side = image_transform["max_size"] // stride
    cells = min(side * side, image_transform["max_pixels"] // stride**2)
    return cells * (stride // patch_size) ** 2


def pack_shapes(config) -> dict[str, list[PackShape]]:
    """{'teacher', 'student'} (OPSD), {'sft'} or {'offline'} -> the shape of each length bucket,
    ascending."""
    per_row = -(-config.samples_per_micro_batch // config.rows_per_micro_batch)
    image = image_patches(config.data.image_transform)
    completion = config.sample_max_new_tokens + 2  # <|im_start|> ... <|im_end|>

    def size(key, derived):
        return config[key] or round_up(derived)

    tokens = size("pack_row_tokens", config.max_forward_tokens)
    patches = size(
        "pack_row_patches", min(tokens, per_row * image * (1 + config.max_reference_rounds))
    )
    if config.mode == "sft":
        full = {"sft": PackShape(tokens, patches, size("pack_loss_entries", tokens))}
    elif config.mode == "offline":  # the text-only view: the problem image only, no VT images
        full = {
            "offline": PackShape(
                tokens,
                size("pack_row_patches", min(tokens, per_row * image)),
                size("pack_loss_entries", tokens),
            )
        }
    else:
        loss = size("pack_loss_entries", per_row * (config.sample_max_new_tokens + 1))
        student = size(
            "pack_student_row_tokens",
            min(tokens, per_row * (image + 2 + completion + PROMPT_TOKENS)),
        )
        full = {
            "teacher": PackShape(tokens, patches, loss),
            "student": PackShape(
                student, size("pack_student_row_patches", min(student, per_row * image)), loss
            ),
        }
    n = config.pack_length_buckets
    return {
        name: [shape.scaled(j / n) if j < n else shape for j in range(1, n + 1)]
        for name, shape in full.items()
    }


def fit_rows(
    needs, capacity, num_rows: int, *, cuttable=None, cut_dims=None
) -> tuple[list[int | None], list[int]]:
    """Each sample's row (None: dropped) and how many completion tokens it loses.

    `needs` [N, D]: what each sample takes of each per-row size (tokens, patches, loss entries,
    of one or two packs); `capacity` [D]. First fit, largest first (dimension 0). If some
    sample does not fit whole, samples may lose up to `cuttable[i]` completion tokens, each
    shrinking every dimension in `cut_dims` by one: rows are then assigned by the samples'
    smallest sizes (so a long completion never pushes a whole sample out), and each row's room
    goes back to its completions, the shortest first (only long completions are cut).
    """
    needs = np.asarray(needs, np.int64).reshape(len(needs), -1)
    capacity = np.asarray(capacity, np.int64)
    rows = _first_fit(needs, capacity, num_rows)
    no_cuts = [0] * len(needs)
    if None not in rows or cuttable is None or not np.any(cuttable):
        return rows, no_cuts
    cuttable, cut_dims = np.asarray(cuttable, np.int64), np.asarray(cut_dims, bool)
    smallest = needs - cuttable[:, None] * cut_dims
    rows = _first_fit(smallest, capacity, num_rows)
    free = np.tile(capacity, (num_rows, 1))
    for i, row in enumerate(rows):
        if row is not None:
            free[row] -= smallest[i]
    cuts = no_cuts
    for i in sorted(
        (i for i, row in enumerate(rows) if row is not None), key=lambda i: cuttable[i]
    ):
        give = min(int(cuttable[i]), int(free[rows[i], cut_dims].min()))
        free[rows[i]] -= give * cut_dims
        cuts[i] = int(cuttable[i]) - give
    return rows, cuts


def _first_fit(needs: np.ndarray, capacity: np.ndarray, num_rows: int) -> list[int | None]:
    free = np.tile(capacity, (num_rows, 1))
    rows: list[int | None] = [None] * len(needs)
    for i in sorted(range(len(needs)), key=lambda i: -needs[i, 0]):
        fits = np.flatnonzero(np.all(free >= needs[i], axis=1))
        if fits.size:
            rows[i] = int(fits[0])
            free[rows[i]] -= needs[i]
    return rows


def choose_bucket(needs, buckets: list[np.ndarray], num_rows: int, **cut):
    """(bucket index, rows, cuts): the smallest bucket that takes every sample uncut, else the
    largest with cuts / drops (see `fit_rows`)."""
    for index, capacity in enumerate(buckets[:-1]):
        rows, cuts = fit_rows(needs, capacity, num_rows)
        if None not in rows:
            return index, rows, cuts
    return len(buckets) - 1, *fit_rows(needs, buckets[-1], num_rows, **cut)


def cut_report(cut: int, dropped: int, seen: int, shapes: dict[str, PackShape]) -> list[str]:
    """Console lines for samples the fixed rows cut (`cut`: completions shortened to fit) or
    dropped (`dropped`: fit no row at all) among `seen`, naming the rows' sizes (`shapes`: pack
    name -> its largest shape) and the keys that raise them."""
    sizes = "; ".join(
        f"{name} rows {s.row_length} tokens / {s.patches} patches / {s.loss_entries} loss entries"
        for name, s in shapes.items()
    )
    lines = []
    if cut:
        lines.append(
            f"{cut} of {seen} samples since the last report had their completion cut "
            f"to fit the pack rows ({sizes}): raise pack_student_row_tokens / "
            f"pack_row_tokens / pack_loss_entries, or set them to 0 for sizes that "
            f"always fit"
        )
    if dropped:
        lines.append(
            f"{dropped} of {seen} samples since the last report were dropped: they fit "
            f"no pack row ({sizes}); raise pack_row_tokens / pack_row_patches (OPSD "
            f"students: pack_student_row_tokens / pack_student_row_patches), or set "
            f"them to 0 for sizes that always fit"
        )
    return lines
