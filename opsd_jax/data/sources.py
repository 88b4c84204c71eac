"""Random-access readers for Visual-OPSD training data: ThinkMorph parquet and JSONL + image files.

What (the dataset config, `DataConfig`, is data_config.py's): two grain-compatible random-access sources
(`__len__` / `__getitem__` returning one raw row as a dict), a deterministic held-out split by a
hash of `pid`, and `decode_row`, which turns a raw row into a `RawSample` (PIL images + text) or a
`Skipped(reason)` marker.

Why this shape: the pipeline (pipeline.py) shuffles indices globally, so a source must serve any
row by index without loading a whole file's images (ThinkMorph rows carry encoded PNG/JPEG bytes;
a task is hundreds of MB). Parquet is read one row group at a time, only the needed columns, with
a small LRU cache; only the `pid` column is read eagerly (to build the split). Decoding is kept
out of the sources so that a bad row becomes a counted `Skipped` element downstream instead of an
exception inside grain's worker threads. For the same reason a source never raises for a row it
cannot read (a JSONL line that is not UTF-8 or not a JSON object, a damaged parquet row group): it
returns `{"_error": "<file>...: <why>"}`, which `decode_row` turns into `Skipped(read_error)`.

Layouts (docs/opsd_loss.md §c.1):

* parquet: `<task>/data/*.parquet` (or a `.parquet` file, or a directory of them); columns
  `pid`, `question`, `answer`, `problem_image_0`, `resoning_thought_k` (the misspelling is the
  real column name), `reasoning_image_k`, `full_text_only_thought`; images are `{bytes, path}`
  structs (a missing `bytes` falls back to `path`, relative to the parquet file).
* jsonl: `*.jsonl` (a file or a directory, also `<dir>/data/*.jsonl`), one object per line with
  the same field names; an image field is a path relative to the JSONL file (or a `{path}` /
  `{bytes, path}` object).

Splits: files with "train" in their name are train files (if no file has, all are). Rows of train
files whose `pid` hashes below `heldout_fraction` (sha1, so identical on every machine and run) are
held out. `split="train"` = train files minus held-out rows; `split="eval"` = held-out rows plus all
rows of the other files (e.g. a `test-*.parquet`); `split="all"` = everything.

One module of under 600 lines: finding a data set's files, splitting it and decoding its
rows are the one job of reading a data set, and the constants (column names, skip reasons) are
shared by all three.
"""

from __future__ import annotations

import bisect
import codecs
import collections
import dataclasses
import glob
import hashlib
import io
import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from PIL import Image

from opsd_jax.data.data_config import DatasetSpec

SPLITS = ("train", "eval", "all")
THOUGHT_PREFIX = "resoning_thought_"  # sic: the ThinkMorph column name
THOUGHT_PREFIX_FIXED = "reasoning_thought_"  # accepted too, for hand-made JSONL
VT_IMAGE_PREFIX = "reasoning_image_"
PROBLEM_IMAGE = "problem_image_0"
TEXT_FIELDS = ("pid", "question", "answer", "full_text_only_thought")

# Skip reasons (keys of the pipeline's counters).
MISSING_FIELD = "missing_field"
EMPTY_QUESTION = "empty_question"
BAD_IMAGE = "bad_image"
MISSING_VT_IMAGE = "missing_vt_image"
TOO_LONG = "too_long"
READ_ERROR = "read_error"
DECODE_ERROR = "decode_error"  # anything unexpected while decoding (counted, never raised)
SKIP_REASONS = (
    MISSING_FIELD,
    EMPTY_QUESTION,
    BAD_IMAGE,
    MISSING_VT_IMAGE,
    TOO_LONG,
    READ_ERROR,
    DECODE_ERROR,
)


# ----------------------------------------------------------------------------------------------
# Decoded sample and skip marker
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RawSample:
    """One decoded row: RGB-convertible PIL images and the raw text fields."""

    pid: str
    dataset: str
    question: str
    answer: str
    problem_image: Image.Image
    vt_images: list[Image.Image]
    thoughts: list[str]  # resoning_thought_0.. (text before VT 0, after VT 0, ...)
    full_text_only_thought: str | None


@dataclasses.dataclass(frozen=True)
class Skipped:
    """Marker for a bad row; the consumer counts it by `reason` and drops it."""

    reason: str
    dataset: str = ""
    pid: str | None = None
    detail: str = ""


# ----------------------------------------------------------------------------------------------
# Held-out split
# ----------------------------------------------------------------------------------------------


def pid_fraction(pid: str) -> float:
    """A number in [0, 1) from sha1(pid): the same on every machine, run and Python version."""
    digest = hashlib.sha1(str(pid).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(pid: str, fraction: float) -> bool:
    return pid_fraction(pid) < fraction


def _row_in_split(pid: str | None, key: str, is_train_file: bool, split: str, frac: float) -> bool:
    if split == "all":
        return True
    if not is_train_file:
        return split == "eval"
    # A row without pid still needs a stable place; it is skipped later as missing_field anyway.
    held = is_heldout(pid if pid is not None else key, frac)
    return held if split == "eval" else not held


# ----------------------------------------------------------------------------------------------
# File discovery
# ----------------------------------------------------------------------------------------------


def find_files(path: str, format: str = "auto") -> tuple[str, list[str]]:
    """(format, sorted files) for a dataset path: a file, `<dir>/data/*.ext` or `<dir>/*.ext`."""
    path = os.path.expanduser(path)
    formats = ("parquet", "jsonl") if format == "auto" else (format,)
    if os.path.isfile(path):
        ext = path.rsplit(".", 1)[-1]
        if ext not in formats:
            raise ValueError(f"{path}: expected a {' or '.join(formats)} file")
        return ext, [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"dataset path does not exist: {path}")
    for fmt in formats:
        for pattern in (os.path.join(path, "data", f"*.{fmt}"), os.path.join(path, f"*.{fmt}")):
            files = sorted(glob.glob(pattern))
            if files:
                return fmt, files
    raise FileNotFoundError(f"no {' or '.join(formats)} files under {path} (or {path}/data)")


def _train_flags(files: Sequence[str]) -> list[bool]:
    flags = ["train" in os.path.basename(f) for f in files]
    # A dataset with no file named *train* (e.g. a single hand-made JSONL) is all train data.
    return flags if any(flags) else [True] * len(files)


def _wanted_columns(max_reference_rounds: int) -> list[str]:
    cols = list(TEXT_FIELDS) + [PROBLEM_IMAGE]
    for k in range(max_reference_rounds + 1):  # one more thought than VT images (the last one)
        cols += [f"{THOUGHT_PREFIX}{k}", f"{THOUGHT_PREFIX_FIXED}{k}"]
    cols += [f"{VT_IMAGE_PREFIX}{k}" for k in range(max_reference_rounds)]
    return cols


class DataError(ValueError):
    """A data file that cannot serve at all (unreadable, or without a required column): named
    with the file, before any compute. A bad row, by contrast, is skipped and counted."""


def required_columns(require_vt: bool = True) -> list[str]:
    """The columns without which no row of a file can be used."""
    return ["pid", "question", "answer", PROBLEM_IMAGE] + (
        [f"{VT_IMAGE_PREFIX}0"] if require_vt else []
    )


def _open_parquet(path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None


def check_dataset(spec, *, require_vt: bool = True) -> int:
    """Every file of a dataset opens and has the required columns (a parquet file's schema is
    in its footer: nothing else is read); DataError naming the file and column otherwise.
    Returns the number of files."""
    fmt, files = find_files(spec.path, spec.format)
    required = required_columns(require_vt)
    for path in files:
        if fmt == "parquet":
            names = set(_open_parquet(path).schema_arrow.names)
        else:
            names = set()
            first_bad_line = None
            try:
                for _, record in read_jsonl_lines(path):
                    if "_error" in record:  # a bad line is a bad row (skipped and counted)
                        first_bad_line = first_bad_line or record["_error"]
                    else:
                        names.update(record)
            except OSError as e:
                raise DataError(f"dataset {spec.name!r}: {path}: cannot read ({e})") from None
            if not names and first_bad_line:
                # e.g. a UTF-16 file: "no column 'pid'" alone would hide why.
                raise DataError(
                    f"dataset {spec.name!r}: {path} has no readable line "
                    f"(first error: {first_bad_line})"
                )
        missing = [c for c in required if c not in names]
        if missing:
            raise DataError(
                f"dataset {spec.name!r}: {path} has no column "
                f"{', '.join(repr(c) for c in missing)} (every file needs "
                f"{', '.join(required)})"
            )
    return len(files)


# ----------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------


def _error_on_one_line(error: Exception) -> str:
    # pyarrow's messages span lines ("Couldn't deserialize thrift: ...\nDeserializing page ...").
    return " ".join(f"{type(error).__name__}: {error}".split())


def read_jsonl_lines(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number from 1, object) for each non-blank line of a JSONL file.

    A line that is not UTF-8, not JSON or not an object gives `{"_error": "<file>:<line>: why"}`
    instead: one bad line is one bad row (skipped and counted), never the whole file. Lines are
    read as bytes and decoded one by one, because a text-mode file raises UnicodeDecodeError from
    the iteration itself, for the whole file. A UTF-8 byte-order mark (Notepad, PowerShell) at the
    start of the file is dropped, so line 1 is read like any other.
    """
    name = os.path.basename(path)
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, {"_error": f"{name}:{line_no}: not UTF-8 ({e})"}
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                record = {"_error": f"{name}:{line_no}: {e}"}
            if not isinstance(record, dict):
                record = {"_error": f"{name}:{line_no}: not an object"}
            yield line_no, record


class ParquetSource:
    """Random access to the rows of some parquet files, one row group at a time.

    `__getitem__(i)` returns a dict of the needed columns (image structs as {bytes, path}) plus
    `_base_dir` (to resolve image paths). Reads take a lock (pyarrow file handles are not meant for
    concurrent use) and keep the last `row_group_cache` row groups, so consecutive indices in one
    row group cost one read. Picklable: handles and cache are dropped and reopened lazily.
    """

    def __init__(
        self,
        files: Sequence[str],
        split: str,
        heldout_fraction: float,
        max_reference_rounds: int,
        num_used_data: int = -1,
        row_group_cache: int = 4,
    ):
        import pyarrow as pa

        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self._files = list(files)
        self._cache_size = max(1, row_group_cache)
        wanted = _wanted_columns(max_reference_rounds)
        self._columns: list[list[str]] = []
        self._group_starts: list[list[int]] = []  # cumulative row offsets of each row group
        index: list[tuple[int, int]] = []  # (file, row within file)
        for file_idx, (path, is_train) in enumerate(zip(self._files, _train_flags(self._files))):
            meta = _open_parquet(path)
            names = set(meta.schema_arrow.names)
            self._columns.append([c for c in wanted if c in names])
            starts = [0]
            for g in range(meta.metadata.num_row_groups):
                starts.append(starts[-1] + meta.metadata.row_group(g).num_rows)
            self._group_starts.append(starts)
            # The pid column is small; reading it for every row is what makes the split possible.
            if "pid" in names:
                try:
                    pids = meta.read(columns=["pid"]).column("pid").to_pylist()
                except (pa.ArrowException, OSError) as e:
                    # The footer was fine (_open_parquet), but a pid column chunk is damaged.
                    raise DataError(
                        f"{path}: cannot read the pid column ({_error_on_one_line(e)})"
                    ) from None
            else:
                pids = [None] * starts[-1]
            base = os.path.basename(path)
            for row, pid in enumerate(pids):
                if _row_in_split(pid, f"{base}:{row}", is_train, split, heldout_fraction):
                    index.append((file_idx, row))
        if num_used_data > 0:
            index = index[:num_used_data]
        self._index = index
        self._lock = threading.Lock()
        self._handles: dict[int, Any] = {}
        self._cache: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import pyarrow as pa

        file_idx, row = self._index[i]
        path = self._files[file_idx]
        starts = self._group_starts[file_idx]
        group = bisect.bisect_right(starts, row) - 1
        try:
            table = self._row_group(file_idx, group)
        except (pa.ArrowException, OSError) as e:
            # A damaged row group (the footer, checked up front, can be fine) costs its rows, each
            # skipped and counted, not the run: this runs inside grain's reader threads.
            record = {"_error": f"{path}: row group {group}: cannot read ({_error_on_one_line(e)})"}
        else:
            record = table.slice(row - starts[group], 1).to_pylist()[0]
        record["_base_dir"] = os.path.dirname(os.path.abspath(path))
        return record

    def _row_group(self, file_idx: int, group: int):
        """The needed columns of one row group, cached; raises what pyarrow raises (a failed
        read is not cached: the next row of the group tries again and is counted on its own)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        key = (file_idx, group)
        with self._lock:
            table = self._cache.get(key)
            if table is not None:
                self._cache.move_to_end(key)
                return table
            handle = self._handles.get(file_idx)
            if handle is None:
                handle = self._handles[file_idx] = pq.ParquetFile(self._files[file_idx])
            try:
                table = handle.read_row_group(group, columns=self._columns[file_idx])
            except (pa.ArrowException, OSError):
                # Reopen next time rather than trust a handle whose read failed half-way.
                self._handles.pop(file_idx, None)
                raise
            self._cache[key] = table
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return table

    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(_lock=None, _handles={}, _cache=collections.OrderedDict())
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ParquetSource({len(self._files)} files, {len(self)} rows)"


class JsonlSource:
    """Rows of JSONL files (text only: image fields are paths, read when the row is decoded)."""

    def __init__(
        self,
        files: Sequence[str],
        split: str,
        heldout_fraction: float,
        num_used_data: int = -1,
    ):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rows: list[dict[str, Any]] = []
        for path, is_train in zip(files, _train_flags(files)):
            base_dir = os.path.dirname(os.path.abspath(path))
            # A bad line is kept as an `_error` row, so it is counted as skipped, not lost silently.
            for line_no, record in read_jsonl_lines(path):
                record["_base_dir"] = base_dir
                pid = record.get("pid")
                # 0-based in the key, as it always was: the split of pid-less rows must not move.
                key = f"{os.path.basename(path)}:{line_no - 1}"
                if _row_in_split(pid, key, is_train, split, heldout_fraction):
                    rows.append(record)
        if num_used_data > 0:
            rows = rows[:num_used_data]
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self._rows[i])

    def __repr__(self) -> str:
        return f"JsonlSource({len(self)} rows)"


def open_source(
    spec: DatasetSpec,
    split: str = "train",
    *,
    heldout_fraction: float,
    max_reference_rounds: int,
    row_group_cache: int = 4,
) -> ParquetSource | JsonlSource:
    """The random-access source of one dataset's rows in `split` (capped by num_used_data)."""
    fmt, files = find_files(spec.path, spec.format)
    if fmt == "parquet":
        return ParquetSource(
            files,
            split,
            heldout_fraction,
            max_reference_rounds,
            spec.num_used_data,
            row_group_cache,
        )
    return JsonlSource(files, split, heldout_fraction, spec.num_used_data)


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _image_bytes(value: Any, base_dir: str) -> bytes | None:
    """Encoded image bytes from a {bytes, path} struct, a path string, or raw bytes; None if empty."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value) or None
    path = None
    if isinstance(value, Mapping):
        data = value.get("bytes")
        if data:
            return bytes(data)
        path = value.get("path")
    elif isinstance(value, str):
        path = value
    if not path:
        return None
    full = path if os.path.isabs(path) else os.path.join(base_dir, path)
    try:
        with open(full, "rb") as f:
            return f.read()
    except OSError as e:
        raise _BadRow(BAD_IMAGE, f"cannot read image file {path}: {e}") from None


def _decode_image(data: bytes, what: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now: PIL is lazy, and a truncated file must fail here, not later
    except Exception as e:  # noqa: BLE001 — PIL raises many types (UnidentifiedImageError, ...)
        raise _BadRow(BAD_IMAGE, f"{what}: {type(e).__name__}: {e}") from None
    if image.width <= 0 or image.height <= 0:
        raise _BadRow(BAD_IMAGE, f"{what}: empty image")
    return image


def _text(record: Mapping[str, Any], field: str) -> str:
    value = record.get(field)
    if value is None:
        raise _BadRow(MISSING_FIELD, f"{field} is missing")
    if not isinstance(value, str):
        raise _BadRow(MISSING_FIELD, f"{field} is {type(value).__name__}, not str")
    return value


def decode_row(
    record: Mapping[str, Any],
    dataset: str,
    *,
    max_reference_rounds: int,
    max_question_chars: int = 8192,
    require_vt: bool = True,
) -> RawSample | Skipped:
    """A raw row -> RawSample, or Skipped(reason) if the row cannot be used.

    Reasons: missing_field (pid/question/answer/problem image absent or None), empty_question,
    too_long (question over max_question_chars), missing_vt_image (no reasoning_image_0 while
    require_vt), bad_image (undecodable or unreadable image), read_error (a JSONL line that is not
    a UTF-8 JSON object, a parquet row group that cannot be read). Cheap text checks run before
    any image is decoded.
    """
    pid = record.get("pid")
    # Integer ids (some hand-made JSONL) are fine; they are used as strings everywhere.
    pid = str(pid) if isinstance(pid, (str, int)) and not isinstance(pid, bool) else None
    try:
        if "_error" in record:
            raise _BadRow(READ_ERROR, record["_error"])
        if pid is None:
            raise _BadRow(MISSING_FIELD, "pid is missing")
        question = _text(record, "question")
        answer = _text(record, "answer")
        if not question.strip():
            raise _BadRow(EMPTY_QUESTION)
        if len(question) > max_question_chars:
            raise _BadRow(TOO_LONG, f"question has {len(question)} chars > {max_question_chars}")
        full_text = record.get("full_text_only_thought")
        full_text = full_text if isinstance(full_text, str) else None

        base_dir = record.get("_base_dir", "")
        problem_bytes = _image_bytes(record.get(PROBLEM_IMAGE), base_dir)
        if problem_bytes is None:
            raise _BadRow(MISSING_FIELD, f"{PROBLEM_IMAGE} is missing")
        vt_bytes = []
        for k in range(max_reference_rounds):
            data = _image_bytes(record.get(f"{VT_IMAGE_PREFIX}{k}"), base_dir)
            if data is None:
                break  # rounds are contiguous: the first missing VT ends the list
            vt_bytes.append(data)
        if require_vt and not vt_bytes:
            raise _BadRow(MISSING_VT_IMAGE)

        problem_image = _decode_image(problem_bytes, PROBLEM_IMAGE)
        vt_images = [_decode_image(b, f"{VT_IMAGE_PREFIX}{k}") for k, b in enumerate(vt_bytes)]

        thoughts = []
        for k in range(max_reference_rounds + 1):
            value = record.get(f"{THOUGHT_PREFIX}{k}", record.get(f"{THOUGHT_PREFIX_FIXED}{k}"))
            if not isinstance(value, str):
                break
            thoughts.append(value)
    except _BadRow as bad:
        return Skipped(bad.reason, dataset, pid, bad.detail)
    return RawSample(
        pid=pid,
        dataset=dataset,
        question=question,
        answer=answer,
        problem_image=problem_image,
        vt_images=vt_images,
        thoughts=thoughts,
        full_text_only_thought=full_text,
    )


def iter_samples(
    spec: DatasetSpec,
    split: str,
    *,
    heldout_fraction: float,
    max_reference_rounds: int,
    **decode_kwargs,
) -> Iterable[RawSample | Skipped]:
    """Every row of a dataset in file order, decoded (for scripts and evaluation; no grain)."""
    source = open_source(
        spec, split, heldout_fraction=heldout_fraction, max_reference_rounds=max_reference_rounds
    )
    for i in range(len(source)):
        yield decode_row(
            source[i], spec.name, max_reference_rounds=max_reference_rounds, **decode_kwargs
        )
