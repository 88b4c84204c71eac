"""Safetensors files and weight directories, read lazily through memmaps and written streaming.

Why not the `safetensors` package: its numpy backend has no bfloat16 (BAGEL's `ema.safetensors`
is bf16), its flax backend places every tensor on the default accelerator, and its writers want
every tensor in memory at once. The format is small (an 8-byte little-endian header length, a
JSON header `name -> {dtype, shape, data_offsets}`, then raw little-endian C-order bytes), so a
reader that hands out zero-copy memmap views and a writer that streams tensor by tensor take a
few lines each, and a damaged file can be reported with its name and what is wrong with it.

A weight directory holds one file (`ema.safetensors`, `model.safetensors`) or several shards
listed by `<name>.safetensors.index.json` (HF's `weight_map`); `WeightDirectory` hides which.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype names -> numpy dtypes (bf16 and fp8 through ml_dtypes).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")

# The weight file stems BAGEL-style directories use: BAGEL ships `ema`, ThinkMorph `model`.
WEIGHT_STEMS = ("ema", "model")
# A header larger than this is not a plausible safetensors file (the reference caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


class SafetensorsError(ValueError):
    """A weight file or directory that cannot be read as safetensors."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One safetensors file: its header, validated on open, and zero-copy array views."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors, self.metadata = _read_header(self.path)
        self._memmap: np.memmap | None = None

    def keys(self) -> list[str]:
        """Tensor names in file (byte offset) order."""
        return list(self.tensors)

    def _bytes(self) -> np.memmap:
        if self._memmap is None:
            self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._memmap

    def raw(self, key: str) -> np.ndarray:
        """The tensor's bytes (a read-only uint8 view)."""
        info = self.tensors[key]
        return self._bytes()[info.start : info.end]

    def array(self, key: str) -> np.ndarray:
        """The tensor as a read-only numpy view of the file (nothing is read until used)."""
        info = self.tensors[key]
        return self.raw(key).view(DTYPES[info.dtype]).reshape(info.shape)


def _read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str] | None]:
    def corrupt(why: str) -> SafetensorsError:
        return SafetensorsError(f"{path}: not a valid safetensors file: {why}")

    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise corrupt(f"{file_size} bytes, shorter than the 8-byte header length")
            header_size = int.from_bytes(prefix, "little")
            if header_size > min(_MAX_HEADER_BYTES, file_size - 8):
                raise corrupt(f"header length {header_size} exceeds the file ({file_size} bytes)")
            header_bytes = f.read(header_size)
    except FileNotFoundError:
        raise SafetensorsError(f"weight file not found: {path}") from None
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    data_start = 8 + header_size
    tensors = {}
    for key, entry in header.items():
        try:
            dtype, shape, (begin, end) = (
                entry["dtype"],
                tuple(entry["shape"]),
                entry["data_offsets"],
            )
        except (TypeError, KeyError, ValueError):
            raise corrupt(f"malformed header entry for {key!r}: {entry!r}") from None
        if dtype not in DTYPES:
            raise corrupt(f"{key!r} has unknown dtype {dtype!r}")
        if not all(isinstance(n, int) and n >= 0 for n in shape):
            raise corrupt(f"{key!r} has an invalid shape {list(shape)}")
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != expected:
            raise corrupt(
                f"{key!r}: byte range [{begin}, {end}) does not hold {dtype}{list(shape)}"
            )
        if begin < 0 or data_start + end > file_size:
            raise corrupt(
                f"{key!r} ends at byte {data_start + end} but the file has {file_size} bytes "
                "(truncated?)"
            )
        tensors[key] = TensorInfo(dtype, shape, data_start + begin, data_start + end)
    ordered = dict(sorted(tensors.items(), key=lambda item: item[1].start))
    return ordered, metadata


def header_bytes(entries: Iterable[tuple[str, str, tuple[int, ...]]], metadata=None) -> bytes:
    """The length-prefixed JSON header for tensors laid out back to back in the given order."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[key] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded


# One tensor to write: (name, safetensors dtype, shape, a function returning its bytes).
TensorSource = tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]


def write_file(path: str | os.PathLike, tensors: list[TensorSource], metadata=None) -> int:
    """Write tensors in order, fetching each one only when it is written; returns bytes written.

    Each producer returns an array (or uint8 bytes view) whose byte size must match the header;
    a mismatch is a bug in the caller and raises before the file is complete.
    """
    head = header_bytes([(key, dtype, shape) for key, dtype, shape, _ in tensors], metadata)
    total = len(head)
    with open(path, "wb") as f:
        f.write(head)
        for key, dtype, shape, produce in tensors:
            data = np.ascontiguousarray(produce())
            expected = math.prod(shape) * DTYPES[dtype].itemsize
            if data.nbytes != expected:
                raise ValueError(
                    f"{path}: {key!r} produced {data.nbytes} bytes, expected "
                    f"{expected} for {dtype}{list(shape)}"
                )
            f.write(memoryview(data.reshape(-1).view(np.uint8)))  # bf16 has no buffer format
            total += data.nbytes
    return total


def index_name(stem: str) -> str:
    return f"{stem}.safetensors.index.json"


def present_stems(directory: str | os.PathLike, stems=WEIGHT_STEMS) -> list[str]:
    """The `stems` (in their order) that have `<stem>.safetensors` or its index in `directory`."""
    directory = Path(directory)
    return [
        stem
        for stem in stems
        if (directory / f"{stem}.safetensors").exists() or (directory / index_name(stem)).exists()
    ]


class WeightDirectory:
    """The weight files of a checkpoint directory: one file, or shards plus an index json.

    `stem` picks `ema` or `model` (or any `<stem>.safetensors[.index.json]`); by default the
    first present of `ema` (BAGEL's release) and `model` (ThinkMorph's). Every key maps to the
    file that holds it; a key listed twice or an index that disagrees with its shards is an error.
    """

    def __init__(self, directory: str | os.PathLike, stem: str | None = None):
        self.directory = Path(directory)
        if stem is not None and stem.endswith(".safetensors"):
            stem = stem[: -len(".safetensors")]
        stems = [stem] if stem is not None else list(WEIGHT_STEMS)
        found = present_stems(self.directory, stems)
        if not found:
            names = ", ".join(f"{s}.safetensors[.index.json]" for s in stems)
            raise SafetensorsError(f"{self.directory}: no weights found (looked for {names})")
        self.stem = found[0]
        single = self.directory / f"{self.stem}.safetensors"
        index = self.directory / index_name(self.stem)
        self.index: dict | None = None
        if index.exists():
            self.index = _read_index(index)
            file_names = list(dict.fromkeys(self.index["weight_map"].values()))
        else:
            file_names = [single.name]
        self.files = [SafetensorsFile(self.directory / name) for name in file_names]
        self.file_of: dict[str, SafetensorsFile] = {}
        duplicates = []
        for file in self.files:
            for key in file.tensors:
                if key in self.file_of:
                    duplicates.append(
                        f"{key} (in {self.file_of[key].path.name} and {file.path.name})"
                    )
                self.file_of[key] = file
        if duplicates:
            raise SafetensorsError(f"{self.directory}: keys stored twice: {', '.join(duplicates)}")
        if self.index is not None:
            listed = self.index["weight_map"]
            found = {key: file.path.name for key, file in self.file_of.items()}
            wrong = [
                f"{key} (index: {listed.get(key, 'absent')}, shards: {found.get(key, 'absent')})"
                for key in sorted(set(listed) | set(found))
                if listed.get(key) != found.get(key)
            ]
            if wrong:
                raise SafetensorsError(
                    f"{index}: the index disagrees with its shards: " + "; ".join(wrong)
                )

    @property
    def file_names(self) -> list[str]:
        """Every weight file of the checkpoint, index included."""
        names = [file.path.name for file in self.files]
        return names + ([index_name(self.stem)] if self.index is not None else [])

    def keys(self) -> list[str]:
        return list(self.file_of)

    def info(self, key: str) -> TensorInfo:
        return self.file_of[key].tensors[key]

    def array(self, key: str) -> np.ndarray:
        return self.file_of[key].array(key)

    def raw(self, key: str) -> np.ndarray:
        return self.file_of[key].raw(key)

    def header(self) -> dict[str, TensorInfo]:
        return {key: self.info(key) for key in self.keys()}

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)


def _read_index(path: Path) -> dict:
    try:
        with open(path) as f:
            index = json.load(f)
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise SafetensorsError(f"{path}: an index json needs a 'weight_map' object")
    missing = sorted({n for n in index["weight_map"].values() if not (path.parent / n).exists()})
    if missing:
        raise SafetensorsError(f"{path}: shard files listed but not found: {', '.join(missing)}")
    return index
