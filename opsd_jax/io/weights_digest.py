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
SAMPLES = 64
SAMPLE_BYTES = 2**20


def _update_with_file(digest, path: str) -> None:
    size = os.path.getsize(path)
    digest.update(f"{os.path.basename(path)}:{size}:".encode())
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(2**22), b""):
                digest.update(block)
            return
        header_length = int.from_bytes(f.read(8), "little")
        digest.update(f.read(header_length))
        start = 8 + header_length
        span = size - start - SAMPLE_BYTES
        for i in range(SAMPLES):
            f.seek(start + span * i // (SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))


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


def describe(base: dict) -> str:
    return f"{base['model_path']} ({base['weights']}.safetensors, digest {base['digest'][:12]})"
