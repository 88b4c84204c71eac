"""Benchmark files in the layout VLMEvalKit distributes them: one TSV per dataset, read as its
harness reads them.

Columns (VLMEvalKit's docs/en/Development.md and its dataset classes): `index` (a unique int),
`image` (base64; several images as the text of a Python list of base64 strings; a value of at
most 64 characters is not an image but the `index` of the row whose image it reuses), optional
`image_path`, `question`, optional `hint`, one column per option letter (`A`, `B`, ...; an empty
cell means the row has no such option), `answer` (the option letter, or free text for VQA sets),
and per-dataset extras: `category` / `l2-category` / `split`, `g_index` (circular sets: the
rotations of one question; absent, it is `index % 1_000_000`), `prompt` / `source` (CV-Bench),
`maze_map` / `maze_size` (VSP).

Read with pandas as the harness reads it (`read_csv(sep='\\t')`), so a cell means what it means
there: pandas' missing-value words ('None', 'N/A', 'NA', 'null', ...) are empty cells (such an
option is not offered), and a column of numbers is numbers ('0.50' in an all-number option
column is shown as '0.5'). The images are what the harness hands the model: it writes each one
to a file first (`<index>.jpg` for a row's one image, `<index>_<i>.png` for a list, the
`image_path` names where given) and the model reads that file, so a `.jpg` name means the pixels
went through a JPEG encode (PIL's default quality).

A bad file is an error naming the file (and the row and column where there is one); a row
without an image is skipped and counted, as VLMEvalKit skips it.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import io
import os
import string

import pandas as pd
from PIL import Image

OPTION_LETTERS = tuple(string.ascii_uppercase)
REQUIRED_COLUMNS = ("index", "image", "question")
# A value of the `image` column this short is another row's index, not base64 image data.
ALIAS_MAX_CHARS = 64
CIRCULAR_GROUP = 1_000_000  # circular sets: rotation k of question i has index i + k * 1e6


class BenchmarkFileError(ValueError):
    """A benchmark file that cannot be read as a VLMEvalKit TSV; the message names it."""


@dataclasses.dataclass(frozen=True)
class BenchmarkRow:
    """One question of a benchmark, as its TSV gives it (images still encoded)."""

    index: int
    images_b64: tuple[str, ...]  # base64 image files, in the order the prompt shows them
    question: str
    options: dict[str, str]  # letter -> option text, only the options the row has, A.. order
    answer: str | None  # the option letter, or the free-form answer; None on a test split
    hint: str | None
    extra: dict[str, str]  # every other non-empty column (category, g_index, prompt, maze_map...)
    # The file names the harness writes the images to (their extension decides the encoding).
    image_files: tuple[str, ...] = ()

    @property
    def group(self) -> int:
        """The circular group this row belongs to (its own index outside circular sets)."""
        value = self.extra.get("g_index")
        return int(float(value)) if value else self.index % CIRCULAR_GROUP

    def images(self) -> list[Image.Image]:
        """The images as the model sees them (RGB): decoded, through the harness's image file."""
        files = self.image_files or ("image.png",) * len(self.images_b64)
        return [
            as_harness_file(decode_image(b64), name) for b64, name in zip(self.images_b64, files)
        ]


@dataclasses.dataclass
class BenchmarkFile:
    """A benchmark's rows, and how many were skipped (and why)."""

    path: str
    rows: list[BenchmarkRow]
    skipped: dict[str, int]


def decode_image(b64: str) -> Image.Image:
    """A base64 image as the harness decodes it: palette and alpha images become RGB."""
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    return image.convert("RGB") if image.mode in ("RGBA", "P", "LA") else image


def as_harness_file(image: Image.Image, name: str) -> Image.Image:
    """`image` written in the format its file name says and read back as RGB, as the harness's
    model reads the file it dumped (a JPEG name costs the JPEG encode's loss)."""
    fmt = Image.registered_extensions().get(os.path.splitext(name)[1].lower(), "PNG")
    buffer = io.BytesIO()
    try:
        image.save(buffer, format=fmt)
    except OSError:  # a mode the format cannot hold (e.g. 16-bit into JPEG)
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format=fmt)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def _missing(value) -> bool:
    return value is None or bool(pd.isna(value))


def _text(value) -> str | None:
    """A cell as the harness formats it (`f'{value}'`), or None when pandas read it as empty."""
    return None if _missing(value) else f"{value}"


def _as_list(text: str) -> list[str]:
    """The `image` / `image_path` column: one string, or a Python list of them written as text."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        value = ast.literal_eval(text)
        if not isinstance(value, list):
            raise ValueError("a list cell must hold a list")
        return [str(v) for v in value]
    return [text]


def _index_key(text: str) -> str:
    """An index as a lookup key ('12', '12.0' and ' 12' are one row)."""
    try:
        return str(int(float(text)))
    except ValueError:
        return text.strip()


def read_tsv(path: str | os.PathLike) -> BenchmarkFile:
    """Every row of a VLMEvalKit benchmark TSV (see the module docstring)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"benchmark file {path}: no such file")
    try:
        table = pd.read_csv(path, sep="\t")
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise BenchmarkFileError(f"benchmark file {path}: not a readable TSV ({e})") from None
    columns = [str(c) for c in table.columns]
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise BenchmarkFileError(
            f"benchmark file {path}: no column {', '.join(map(repr, missing))} "
            f"(it has {', '.join(columns)})"
        )
    records = table.to_dict("records")
    lines = range(2, len(records) + 2)  # line 1 is the header
    skipped = {}
    kept = []
    for line, record in zip(lines, records):
        if _missing(record["image"]):
            skipped["no_image"] = skipped.get("no_image", 0) + 1
        else:
            kept.append((line, record))
    # Aliases may point at any row of the file, before or after (the harness maps them all).
    image_of = {_index_key(f"{r['index']}"): f"{r['image']}" for _, r in kept}
    option_columns = [c for c in columns if c in OPTION_LETTERS]
    known = {*REQUIRED_COLUMNS, "image_path", "hint", "answer", *option_columns}
    rows = []
    for line, record in kept:
        where = f"benchmark file {path}, line {line}"
        cells = {c: _text(record[c]) for c in columns}
        index_text = f"{record['index']}"
        try:
            index = int(float(index_text))
        except ValueError:
            raise BenchmarkFileError(f"{where}: index {index_text!r} is not an integer") from None
        image = f"{record['image']}"
        if len(image) <= ALIAS_MAX_CHARS:  # another row's image, by its index
            target = image_of.get(_index_key(image))
            if target is None or len(target) <= ALIAS_MAX_CHARS:
                raise BenchmarkFileError(
                    f"{where}: column 'image' refers to row {image!r}, which has no image data"
                )
            image = target
        try:
            images = _as_list(image)
            paths = _as_list(cells["image_path"]) if cells.get("image_path") else []
        except (ValueError, SyntaxError) as e:
            raise BenchmarkFileError(f"{where}: column 'image' / 'image_path': {e}") from None
        if paths:
            files = paths
        elif len(images) == 1:
            files = [f"{index}.jpg"]
        else:
            files = [f"{index}_{i}.png" for i in range(len(images))]
        question = cells["question"]
        if question is None:
            raise BenchmarkFileError(f"{where}: column 'question' is empty")
        options = {c: cells[c] for c in option_columns if cells[c] is not None}
        extra = {c: v for c, v in cells.items() if c not in known and v is not None}
        rows.append(
            BenchmarkRow(
                index=index,
                images_b64=tuple(images),
                question=question,
                options=dict(sorted(options.items())),
                answer=cells.get("answer"),
                hint=cells.get("hint"),
                extra=extra,
                image_files=tuple(files),
            )
        )
    return BenchmarkFile(path=path, rows=rows, skipped=skipped)


def write_tsv(path: str | os.PathLike, rows: list[dict]) -> None:
    """A TSV in the same layout (tests and small hand-made benchmarks): `rows` are dicts of
    column -> value, `image` a PIL image, a list of them, or another row's index."""
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]

    def text(value) -> str:
        if isinstance(value, Image.Image):
            return _encode(value)
        if isinstance(value, list):
            return repr([_encode(v) for v in value])
        return "" if value is None else str(value)

    with open(path, "w", encoding="utf-8") as f:
        f.write("\t".join(columns) + "\n")
        for row in rows:
            f.write("\t".join(text(row.get(c)) for c in columns) + "\n")


def _encode(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
