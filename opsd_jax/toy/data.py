"""A small synthetic visual-reasoning corpus in the ThinkMorph parquet layout (and JSONL).

Each row has the ThinkMorph columns: pid, question, answer, problem_image_0 and reasoning_image_0
({bytes, path} PNG structs), resoning_thought_0 (before the VT; the misspelled name is the real
one), resoning_thought_1 (after the VT, ending with the answer), full_text_only_thought (a
text-only chain of thought). Thoughts are plain text: the ThinkMorph training format adds the
`<think>` tags around them (docs/opsd_loss.md §c.2). The tasks are in tasks.py.

Why: tests and the tiny CPU config need real-looking data without downloads, and a task a tiny
model can learn, where privileged VT images visibly help the teacher. Images are 112x112 px (an
ImageTransform(112, 56, 14) keeps them at 8x8 = 64 ViT patches).

Layout written under `out` (the held-out set is a separate file; the pipeline's eval split also
takes a sha1(pid) share of the train file, see opsd_jax/data/sources.py):

    <out>/<task>/data/train-00000-of-00001.parquet   num_train rows
    <out>/<task>/data/test-00000-of-00001.parquet    num_test rows
    <out>/<task>_jsonl/{train,test}.jsonl + images/  with jsonl=True (image fields = relative paths)

Deterministic: the same seed (and counts) gives byte-identical files. CLI: scripts/make_toy_data.py.
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Sequence
from typing import Any

from PIL import Image

from opsd_jax.toy.tasks import (
    ALL_TASKS,
    DEFAULT_SIZES,
    ROW_GROUP_SIZE,
    TASKS,
    count_texts,
    majority_texts,
    make_count,
    make_majority,
    make_maze,
    maze_texts,
    render_count,
    render_majority,
    render_maze,
)

# ----------------------------------------------------------------------------------------------
# Rows, corpus, writers
# ----------------------------------------------------------------------------------------------


def tasks_for(names: Sequence[str]) -> list[str]:
    """The tasks to write for a config's dataset names: the default TASKS when it names only
    those (the tiny configs' data and tokenizer stay as they are), else exactly the names."""
    return list(TASKS) if set(names) <= set(TASKS) else list(names)


def _rng(seed: int, task: str, split: str) -> random.Random:
    # A string seed is hashed with sha512 by `random`: stable across runs and machines, and the
    # tasks / splits get independent streams.
    return random.Random(f"{seed}:{task}:{split}")


def make_puzzles(task: str, split: str, num: int, seed: int) -> list[dict[str, Any]]:
    """`num` puzzle specs (pure data: no images rendered yet)."""
    if task not in ALL_TASKS:
        raise ValueError(f"unknown toy task {task!r}; one of {ALL_TASKS}")
    rng = _rng(seed, task, split)
    make = {"toy_maze": make_maze, "toy_count": make_count, "toy_majority": make_majority}[task]
    return [make(rng) for _ in range(num)]


def puzzle_texts(task: str, puzzle: dict[str, Any]) -> dict[str, Any]:
    texts = {"toy_maze": maze_texts, "toy_count": count_texts, "toy_majority": majority_texts}
    return texts[task](puzzle)


def render_puzzle(task: str, puzzle: dict[str, Any]) -> tuple[Image.Image, Image.Image]:
    """(problem image, VT image)."""
    render = {"toy_maze": render_maze, "toy_count": render_count, "toy_majority": render_majority}[
        task
    ]
    return render(puzzle, False), render(puzzle, True)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    # PIL's PNG encoder is deterministic for fixed settings. zlib's fastest level: the pixels are
    # the same at every level, and a tiny run writes 8704 images at its first start (the data
    # set: 4.2 s -> 3.65 s).
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def make_rows(task: str, split: str, num: int, seed: int) -> list[dict[str, Any]]:
    """Rows in the ThinkMorph column layout (images as {bytes, path} dicts of PNG bytes)."""
    rows = []
    for i, puzzle in enumerate(make_puzzles(task, split, num, seed)):
        pid = f"{task}_{split}_{i:05d}"
        text = puzzle_texts(task, puzzle)
        problem, vt = render_puzzle(task, puzzle)
        rows.append(
            {
                "pid": pid,
                "question": text["question"],
                "answer": text["answer"],
                "problem_image_0": {"bytes": _png(problem), "path": f"{pid}_problem.png"},
                "resoning_thought_0": text["thoughts"][0],
                "reasoning_image_0": {"bytes": _png(vt), "path": f"{pid}_vt0.png"},
                "resoning_thought_1": text["thoughts"][1],
                "full_text_only_thought": text["full_text_only_thought"],
            }
        )
    return rows


def corpus_lines(task: str, puzzle: dict[str, Any]) -> list[str]:
    text = puzzle_texts(task, puzzle)
    t0, t1 = text["thoughts"]
    return [
        text["question"],
        text["answer"],
        t0,
        t1,
        text["full_text_only_thought"],
        # The ThinkMorph output format (docs/opsd_loss.md §c.2), so a tokenizer also sees the tags in context.
        f"<think>{t0}</think><image_start>",
        f"<image_end><think>{t1}</think><answer>{text['answer']}</answer>",
        f"<think>{text['full_text_only_thought']}</think><answer>{text['answer']}</answer>",
    ]


def _sizes(task: str, num_train: int | None, num_test: int | None) -> tuple[int, int]:
    train, test = DEFAULT_SIZES.get(task, (320, 64))
    return (train if num_train is None else num_train), (test if num_test is None else num_test)


def toy_corpus_text(
    seed: int = 0,
    num_train: int | None = None,
    num_test: int | None = None,
    tasks: Sequence[str] = TASKS,
) -> str:
    """All question / answer / thought strings of the toy corpus, one per line (for a tokenizer).

    Counts left as None: 320 / 64 per task (DEFAULT_SIZES for the opt-in tasks)."""
    lines = []
    for task in tasks:
        for split, num in zip(("train", "test"), _sizes(task, num_train, num_test)):
            for puzzle in make_puzzles(task, split, num, seed):
                lines += corpus_lines(task, puzzle)
    return "\n".join(lines) + "\n"


def _arrow_schema():
    import pyarrow as pa

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.schema(
        [
            ("pid", pa.string()),
            ("question", pa.string()),
            ("answer", pa.string()),
            ("problem_image_0", image),
            ("resoning_thought_0", pa.string()),
            ("reasoning_image_0", image),
            ("resoning_thought_1", pa.string()),
            ("full_text_only_thought", pa.string()),
        ]
    )


def write_parquet(rows: list[dict[str, Any]], path: str, row_group_size: int = ROW_GROUP_SIZE):
    """Rows -> one parquet file with the ThinkMorph schema (nullable fields: None is allowed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    schema = _arrow_schema()
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)


def write_jsonl(rows: list[dict[str, Any]], path: str) -> None:
    """Rows -> JSONL with images as PNG files under images/, referenced by relative path."""
    base = os.path.dirname(os.path.abspath(path))
    os.makedirs(os.path.join(base, "images"), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            out = {}
            for key, value in row.items():
                if isinstance(value, dict):  # an image struct: bytes go to a file
                    rel = os.path.join("images", value["path"])
                    with open(os.path.join(base, rel), "wb") as img:
                        img.write(value["bytes"])
                    out[key] = rel
                else:
                    out[key] = value
            f.write(json.dumps(out, ensure_ascii=False, sort_keys=True) + "\n")


def write_toy_data(
    out: str,
    seed: int = 0,
    num_train: int | None = None,
    num_test: int | None = None,
    tasks: Sequence[str] = TASKS,
    jsonl: bool = False,
) -> dict[str, str]:
    """Write every task; returns {dataset name: directory} (JSONL datasets named <task>_jsonl).

    Counts left as None: 320 / 64 per task (DEFAULT_SIZES for the opt-in tasks)."""
    written = {}
    for task in tasks:
        for split, num in zip(("train", "test"), _sizes(task, num_train, num_test)):
            rows = make_rows(task, split, num, seed)
            write_parquet(rows, os.path.join(out, task, "data", f"{split}-00000-of-00001.parquet"))
            if jsonl:
                write_jsonl(rows, os.path.join(out, f"{task}_jsonl", f"{split}.jsonl"))
        written[task] = os.path.join(out, task)
        if jsonl:
            written[f"{task}_jsonl"] = os.path.join(out, f"{task}_jsonl")
    return written
