"""Benchmark files in the layout VLMEvalKit distributes them: one TSV per dataset.

Columns (VLMEvalKit's docs/en/Development.md and its dataset classes): `index` (a unique int),
`image` (base64; several images as the text of a Python list of base64 strings; a value of at
most 64 characters is not an image but the `index` of the row whose image it reuses), optional
`image_path`, `question`, optional `hint`, one column per option letter (`A`, `B`, ...; an empty
cell means the row has no such option), `answer` (the option letter, or free text for VQA sets),
and per-dataset extras: `category` / `l2-category` / `split`, `g_index` (circular sets: the
rotations of one question; absent, it is `index % 1_000_000`), `prompt` / `source` (CV-Bench),
`maze_map` / `maze_size` (VSP).

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

import pyarrow as pa
import pyarrow.csv as pa_csv
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

    @property
    def group(self) -> int:
        """The circular group this row belongs to (its own index outside circular sets)."""
        value = self.extra.get("g_index")
        return int(float(value)) if value else self.index % CIRCULAR_GROUP

    def images(self) -> list[Image.Image]:
        """The decoded images (RGB)."""
        return [decode_image(b64) for b64 in self.images_b64]


@dataclasses.dataclass
class BenchmarkFile:
    """A benchmark's rows, and how many were skipped (and why)."""

    path: str
    rows: list[BenchmarkRow]
    skipped: dict[str, int]


def decode_image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")


def _cell(value) -> str | None:
    """A TSV cell as text; an empty cell (VLMEvalKit's NaN) as None."""
    if value is None:
        return None
    text = str(value)
    return None if text == "" or text.lower() == "nan" else text


def _image_list(text: str) -> list[str]:
    """The `image` column: one base64 string, or a Python list of them written as text."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        value = ast.literal_eval(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("a list image cell must hold base64 strings")
        return value
    return [text]


def read_tsv(path: str | os.PathLike) -> BenchmarkFile:
    """Every row of a VLMEvalKit benchmark TSV (see the module docstring)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"benchmark file {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            header = f.readline().rstrip("\r\n").split("\t")
        table = pa_csv.read_csv(
            path,
            # Rows with base64 images run to megabytes: a block must hold a whole row.
            read_options=pa_csv.ReadOptions(block_size=1 << 28),
            parse_options=pa_csv.ParseOptions(delimiter="\t", newlines_in_values=True),
            # Every column as text, as written (no number parsing: option "0.50" stays "0.50").
            convert_options=pa_csv.ConvertOptions(
                strings_can_be_null=True, column_types={name: pa.string() for name in header}
            ),
        )
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        raise BenchmarkFileError(f"benchmark file {path}: not a readable TSV ({e})") from None
    columns = table.column_names
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise BenchmarkFileError(
            f"benchmark file {path}: no column {', '.join(map(repr, missing))} "
            f"(it has {', '.join(columns)})"
        )
    records = table.to_pylist()
    by_index: dict[str, list[str]] = {}
    rows, skipped = [], {}
    option_columns = [c for c in columns if c in OPTION_LETTERS]
    known = {*REQUIRED_COLUMNS, "image_path", "hint", "answer", *option_columns}
    for number, record in enumerate(records, start=2):  # line 1 is the header
        where = f"benchmark file {path}, line {number}"
        index_text = _cell(record["index"])
        try:
            index = int(float(index_text))
        except (TypeError, ValueError):
            raise BenchmarkFileError(f"{where}: index {index_text!r} is not an integer") from None
        image = _cell(record["image"])
        if image is None:
            skipped["no_image"] = skipped.get("no_image", 0) + 1
            continue
        if len(image) <= ALIAS_MAX_CHARS:  # another row's image, by its index
            alias = str(int(float(image))) if image.replace(".", "").isdigit() else image
            if alias not in by_index:
                raise BenchmarkFileError(f"{where}: image refers to row {image!r}, not before it")
            images = by_index[alias]
        else:
            try:
                images = _image_list(image)
            except (ValueError, SyntaxError) as e:
                raise BenchmarkFileError(f"{where}: column 'image': {e}") from None
        by_index[str(index)] = images
        question = _cell(record["question"])
        if question is None:
            raise BenchmarkFileError(f"{where}: column 'question' is empty")
        options = {c: str(record[c]) for c in option_columns if _cell(record[c]) is not None}
        extra = {c: _cell(record[c]) for c in columns if c not in known}
        rows.append(
            BenchmarkRow(
                index=index,
                images_b64=tuple(images),
                question=question,
                options=dict(sorted(options.items())),
                answer=_cell(record.get("answer")),
                hint=_cell(record.get("hint")),
                extra={k: v for k, v in extra.items() if v is not None},
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
