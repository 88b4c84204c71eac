"""Which base weights a LoRA run's adapters apply to: a directory, a file stem and a digest.

A LoRA checkpoint holds adapters only; they mean something over the exact base they were
trained on. `identity(model_path, stem)` names that base: its directory, the weights file stem
(`model` / `ema`) and a sha256 over each weight file's name, size and safetensors header (every
tensor's name, dtype, shape and offsets) and, for files over FULL_HASH_BYTES, SAMPLES evenly
spaced blocks of SAMPLE_BYTES of their data (a 7B base: 64 MiB read of 16 GB, about a second;
a fine-tune of the same architecture differs in nearly every block, so it differs here too).
Smaller files are hashed whole. A resume compares the digest, not the path: a moved directory
is the same base, a different fine-tune at the same path is not.
"""

from __future__ import annotations

import hashlib
import os

from opsd_jax.io.safetensors_io import WeightDirectory

FULL_HASH_BYTES = 256 * 2**20
ITEM_WHOLE_BYTES = 4 * 2**20  # a checkpoint item's files (checkpoint_item_identity)
SAMPLES = 64
SAMPLE_BYTES = 2**20


def _update_with_data(digest, f, start: int, size: int, whole_up_to: int) -> None:
    """The file's bytes from `start`: whole up to `whole_up_to` bytes, else SAMPLES blocks."""
    f.seek(start)
    if size <= whole_up_to:
        for block in iter(lambda: f.read(2**22), b""):
            digest.update(block)
        return
    span = size - start - SAMPLE_BYTES
    for i in range(SAMPLES):
        f.seek(start + span * i // (SAMPLES - 1))
        digest.update(f.read(SAMPLE_BYTES))


def _update_with_file(
    digest, path: str, name: str | None = None, whole_up_to: int = FULL_HASH_BYTES
) -> None:
    size = os.path.getsize(path)
    digest.update(f"{name or os.path.basename(path)}:{size}:".encode())
    with open(path, "rb") as f:
        start = 0
        if size > whole_up_to and path.endswith(".safetensors"):  # its header, whole
            header_length = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header_length))
            start = 8 + header_length
        _update_with_data(digest, f, start, size, whole_up_to)


def identity(model_path: str | os.PathLike, stem: str) -> dict:
    """{'model_path', 'weights', 'digest'} of the `stem` weights of `model_path`."""
    files = WeightDirectory(model_path, stem)
    digest = hashlib.sha256()
    for name in sorted(files.file_names):
        _update_with_file(digest, os.path.join(files.directory, name))
    return {
        "model_path": os.path.abspath(model_path),
        "weights": files.stem,
        "digest": digest.hexdigest(),
    }


def checkpoint_item_identity(item_dir: str | os.PathLike) -> dict:
    """{'model_path', 'weights', 'digest', 'checkpoint'} of one item of a training checkpoint
    (`<step>/params`, `<step>/ema_params`): every file of it, by its path in the item, its size
    and its data as above (a teacher that starts from a checkpoint is named by it)."""
    item_dir = os.path.abspath(item_dir)
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(item_dir)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            # Orbax writes a 7B item in many files: whole only up to a few MiB, so the
            # item is read in about a second, as a weights file is.
            _update_with_file(digest, path, os.path.relpath(path, item_dir), ITEM_WHOLE_BYTES)
    return {
        "model_path": item_dir,
        "weights": os.path.basename(item_dir),
        "digest": digest.hexdigest(),
        "checkpoint": True,
    }


def describe(base: dict) -> str:
    return f"{base['model_path']} ({base['weights']}.safetensors, digest {base['digest'][:12]})"
