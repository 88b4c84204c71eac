"""Make a small synthetic visual-reasoning corpus in the ThinkMorph parquet layout (and JSONL).

What: two toy tasks whose visual thought (VT) image is the intermediate step that makes the answer
easy, in the spirit of ThinkMorph's Spatial_Navigation and Visual_Search:

* `toy_maze`: a 5x5 maze (black walls), a green start, a red goal (A) and a blue goal (B); exactly
  one goal is connected to the start. Question: which goal can be reached? Answer "A" or "B".
  VT: the same maze with the route from the start to the reachable goal drawn in orange.
* `toy_count`: 3-8 coloured shapes (circle / square / triangle in red / green / blue) on a 4x4
  grid of slots. Question: how many <colour> <shape>s? Answer "1".."4". VT: the target shapes
  boxed, every other shape faded to grey.
* `toy_majority` (opt-in, not in the default TASKS; the toy Visual-OPSD experiment): dots of four
  colours on a 6x6 grid (84 px images). Question: which colour has the most dots? Answer a colour
  word. VT: the winning colour's dots fill their cells, every other dot faded to grey.

Each row has the ThinkMorph columns: pid, question, answer, problem_image_0 and reasoning_image_0
({bytes, path} PNG structs), resoning_thought_0 (before the VT; the misspelled name is the real
one), resoning_thought_1 (after the VT, ending with the answer), full_text_only_thought (a
text-only chain of thought). Thoughts are plain text: the ThinkMorph training format adds the
`<think>` tags around them (opsd_loss_spec.md §c.2).

Why: tests and the tiny CPU config need real-looking data without downloads, and a task a tiny
model can learn, where privileged VT images visibly help the teacher. Images are 112x112 px (an
ImageTransform(112, 56, 14) keeps them at 8x8 = 64 ViT patches).

Layout written under --out (the held-out set is a separate file; the pipeline's eval split also
takes a sha1(pid) share of the train file, see opsd_jax/data/sources.py):

    <out>/<task>/data/train-00000-of-00001.parquet   --num_train rows
    <out>/<task>/data/test-00000-of-00001.parquet    --num_test rows
    <out>/<task>_jsonl/{train,test}.jsonl + images/  with --jsonl (image fields = relative paths)

Deterministic: the same --seed (and counts) gives byte-identical files. Usage, from the repo root:

    python scripts/make_toy_data.py --out /tmp/toy [--seed 0] [--jsonl] [--corpus_out corpus.txt]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import random
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from PIL import Image, ImageDraw

TASKS = ("toy_maze", "toy_count")  # the default toy data (tiny configs, tests)
# Opt-in tasks: written only when asked for by name (the toy Visual-OPSD experiment).
EXTRA_TASKS = ("toy_majority",)
ALL_TASKS = TASKS + EXTRA_TASKS
IMAGE_SIZE = 112
ROW_GROUP_SIZE = 64  # small, so readers exercise the multi-row-group path

# ----------------------------------------------------------------------------------------------
# toy_maze
# ----------------------------------------------------------------------------------------------

MAZE_N = 5
MAZE_MARGIN = 6
MAZE_CELL = (IMAGE_SIZE - 2 * MAZE_MARGIN) // MAZE_N  # 20 px
START_RGB, GOAL_A_RGB, GOAL_B_RGB = (0, 170, 0), (220, 0, 0), (0, 60, 230)
PATH_RGB = (255, 140, 0)
MOVES = {(1, 0): "down", (-1, 0): "up", (0, 1): "right", (0, -1): "left"}


def _neighbours(cell: tuple[int, int]) -> list[tuple[int, int]]:
    r, c = cell
    out = [(r + dr, c + dc) for dr, dc in MOVES]
    return [(a, b) for a, b in out if 0 <= a < MAZE_N and 0 <= b < MAZE_N]


def _component(start, passages) -> set:
    seen, stack = {start}, [start]
    while stack:
        cell = stack.pop()
        for nb in _neighbours(cell):
            if frozenset((cell, nb)) in passages and nb not in seen:
                seen.add(nb)
                stack.append(nb)
    return seen


def _route(start, goal, passages) -> list[tuple[int, int]]:
    # Breadth-first search; in a tree the route is unique, BFS just finds it.
    parent = {start: None}
    queue = [start]
    for cell in queue:
        if cell == goal:
            break
        for nb in _neighbours(cell):
            if frozenset((cell, nb)) in passages and nb not in parent:
                parent[nb] = cell
                queue.append(nb)
    route = [goal]
    while parent[route[-1]] is not None:
        route.append(parent[route[-1]])
    return route[::-1]


def make_maze(rng: random.Random) -> dict[str, Any]:
    """A spanning-tree maze with one passage removed: two components, one goal in each."""
    start_cell = (rng.randrange(MAZE_N), rng.randrange(MAZE_N))
    passages, visited, stack = set(), {start_cell}, [start_cell]
    while stack:  # randomized depth-first search -> a perfect maze (a spanning tree)
        cell = stack[-1]
        options = [nb for nb in _neighbours(cell) if nb not in visited]
        if not options:
            stack.pop()
            continue
        nb = options[rng.randrange(len(options))]
        passages.add(frozenset((cell, nb)))
        visited.add(nb)
        stack.append(nb)
    edges = sorted(passages, key=lambda e: sorted(e))  # sorted: set order must not leak in
    while True:
        cut = edges[rng.randrange(len(edges))]
        kept = passages - {cut}
        a, b = sorted(cut)
        comp_a, comp_b = _component(a, kept), _component(b, kept)
        if len(comp_a) >= 3 and len(comp_b) >= 3:
            break
    if rng.random() < 0.5:
        comp_a, comp_b = comp_b, comp_a
    start = rng.choice(sorted(comp_a))
    routes = {cell: _route(start, cell, kept) for cell in sorted(comp_a) if cell != start}
    # Prefer goals at least 3 moves away: a goal next to the start needs no maze reading at all.
    far = [cell for cell, route in routes.items() if len(route) >= 4]
    reach = rng.choice(far or sorted(routes))
    other = rng.choice(sorted(comp_b))
    answer = rng.choice("AB")
    goals = {"A": reach, "B": other} if answer == "A" else {"A": other, "B": reach}
    return {
        "passages": kept,
        "start": start,
        "goals": goals,
        "answer": answer,
        "route": routes[reach],
    }


def _cell_box(cell, inset=0) -> tuple[int, int, int, int]:
    r, c = cell
    x0, y0 = MAZE_MARGIN + c * MAZE_CELL, MAZE_MARGIN + r * MAZE_CELL
    return x0 + inset, y0 + inset, x0 + MAZE_CELL - inset, y0 + MAZE_CELL - inset


def _cell_centre(cell) -> tuple[int, int]:
    x0, y0, x1, y1 = _cell_box(cell)
    return (x0 + x1) // 2, (y0 + y1) // 2


def render_maze(maze: dict[str, Any], with_route: bool) -> Image.Image:
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for r in range(MAZE_N):
        for c in range(MAZE_N):
            x0, y0, x1, y1 = _cell_box((r, c))
            if c == MAZE_N - 1 or frozenset(((r, c), (r, c + 1))) not in maze["passages"]:
                draw.line([(x1, y0), (x1, y1)], fill=(0, 0, 0), width=2)
            if r == MAZE_N - 1 or frozenset(((r, c), (r + 1, c))) not in maze["passages"]:
                draw.line([(x0, y1), (x1, y1)], fill=(0, 0, 0), width=2)
            if c == 0:
                draw.line([(x0, y0), (x0, y1)], fill=(0, 0, 0), width=2)
            if r == 0:
                draw.line([(x0, y0), (x1, y0)], fill=(0, 0, 0), width=2)
    if with_route:
        draw.line([_cell_centre(cell) for cell in maze["route"]], fill=PATH_RGB, width=4)
    # Markers last, so the route passes under them.
    draw.rectangle(_cell_box(maze["start"], 5), fill=START_RGB)
    draw.rectangle(_cell_box(maze["goals"]["A"], 5), fill=GOAL_A_RGB)
    draw.rectangle(_cell_box(maze["goals"]["B"], 5), fill=GOAL_B_RGB)
    return image


def _where(cell) -> str:
    return f"row {cell[0] + 1}, column {cell[1] + 1}"


def maze_texts(maze: dict[str, Any]) -> dict[str, str]:
    answer = maze["answer"]
    lost = "B" if answer == "A" else "A"
    colour = {"A": "red", "B": "blue"}
    route = maze["route"]
    moves = [MOVES[(b[0] - a[0], b[1] - a[1])] for a, b in itertools.pairwise(route)]
    question = (
        f"The image shows a {MAZE_N}x{MAZE_N} maze with black walls. The green square is the "
        "start. Moving only through open passages, which goal can be reached: (A) the red square "
        "or (B) the blue square? Answer with A or B."
    )
    thought_0 = (
        "I need to find which goal is connected to the green start through open passages. "
        "I will trace the route through the maze from the start."
    )
    thought_1 = (
        f"The traced route leaves the start at {_where(maze['start'])} and reaches the "
        f"{colour[answer]} square at {_where(maze['goals'][answer])} after {len(moves)} moves. "
        f"The {colour[lost]} square is not connected to the start. So the answer is {answer}."
    )
    full = (
        f"The start is the green square at {_where(maze['start'])}. Following the open passages: "
        f"{', '.join(moves)}. This reaches the {colour[answer]} square at "
        f"{_where(maze['goals'][answer])}. The {colour[lost]} square at "
        f"{_where(maze['goals'][lost])} is walled off from the start. So the answer is {answer}."
    )
    return {"question": question, "answer": answer, "thoughts": [thought_0, thought_1],
            "full_text_only_thought": full}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# toy_count
# ----------------------------------------------------------------------------------------------

COUNT_SLOTS = 4
SLOT = IMAGE_SIZE // COUNT_SLOTS  # 28 px
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 30), "blue": (30, 60, 220)}
KINDS = ("circle", "square", "triangle")
FADED_RGB = (205, 205, 205)


def make_count(rng: random.Random) -> dict[str, Any]:
    target = (rng.choice(sorted(COLOURS)), rng.choice(KINDS))
    num_targets = rng.randint(1, 4)
    num_other = rng.randint(2, 4)
    others = [(c, k) for c in sorted(COLOURS) for k in KINDS if (c, k) != target]
    slots = rng.sample([(r, c) for r in range(COUNT_SLOTS) for c in range(COUNT_SLOTS)],
                       num_targets + num_other)  # fmt: skip
    shapes = []
    for i, slot in enumerate(slots):
        colour, kind = target if i < num_targets else rng.choice(others)
        jitter = (rng.randint(-2, 2), rng.randint(-2, 2))
        shapes.append({"slot": slot, "colour": colour, "kind": kind, "jitter": jitter})
    shapes.sort(key=lambda s: s["slot"])  # reading order, for the text-only thought
    return {"target": target, "shapes": shapes, "answer": str(num_targets)}


def render_count(puzzle: dict[str, Any], highlight: bool) -> Image.Image:
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for shape in puzzle["shapes"]:
        r, c = shape["slot"]
        cx = c * SLOT + SLOT // 2 + shape["jitter"][0]
        cy = r * SLOT + SLOT // 2 + shape["jitter"][1]
        is_target = (shape["colour"], shape["kind"]) == puzzle["target"]
        fill = COLOURS[shape["colour"]] if is_target or not highlight else FADED_RGB
        h = 8  # half size: an 18 px shape in a 28 px slot
        if shape["kind"] == "circle":
            draw.ellipse([cx - h, cy - h, cx + h, cy + h], fill=fill)
        elif shape["kind"] == "square":
            draw.rectangle([cx - h + 1, cy - h + 1, cx + h - 1, cy + h - 1], fill=fill)
        else:
            draw.polygon([(cx, cy - h), (cx - h, cy + h), (cx + h, cy + h)], fill=fill)
        if highlight and is_target:
            draw.rectangle([c * SLOT + 1, r * SLOT + 1, (c + 1) * SLOT - 2, (r + 1) * SLOT - 2],
                           outline=(0, 0, 0), width=2)  # fmt: skip
    return image


def count_texts(puzzle: dict[str, Any]) -> dict[str, str]:
    colour, kind = puzzle["target"]
    answer = puzzle["answer"]
    question = f"How many {colour} {kind}s are in the image? Answer with a number."
    thought_0 = (
        f"The image mixes shapes of different colours and kinds. I will box the {colour} "
        f"{kind}s and fade every other shape."
    )
    thought_1 = (
        f"Only the boxed shapes are {colour} {kind}s. Counting the boxes gives {answer}. "
        f"So the answer is {answer}."
    )
    rows = []
    for r in range(COUNT_SLOTS):
        names = [f"a {s['colour']} {s['kind']}" for s in puzzle["shapes"] if s["slot"][0] == r]
        rows.append(f"row {r + 1} has {', '.join(names) if names else 'nothing'}")
    full = (
        f"Going through the image row by row: {'; '.join(rows)}. Counting the {colour} {kind}s "
        f"gives {answer}. So the answer is {answer}."
    )
    return {"question": question, "answer": answer, "thoughts": [thought_0, thought_1],
            "full_text_only_thought": full}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# toy_majority (opt-in): the task of the toy Visual-OPSD experiment (scripts/toy_experiment.py)
# ----------------------------------------------------------------------------------------------
#
# The problem image is a 6x6 grid of 14 px cells (84 px; one ViT patch per cell) holding small
# dots of four colours; the answer is the colour with the most dots. It is fully determined by
# the problem image, but reading it there means pooling faint evidence (a dot covers ~10 % of its
# patch) over the whole image and comparing four totals (the winner may lead the runner-up by
# only MAJORITY_MARGIN dots). The VT image shows the decisive evidence saliently: the winning
# colour's dots fill their whole cells and every other dot is faded to grey, so the answer is
# nearly the image's mean colour. A tiny model thus learns the answer with VT much sooner than
# without, which is the gap Visual-OPSD should close.

MAJORITY_COLOURS = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 215),
    "yellow": (225, 200, 30),
}
MAJORITY_GRID = 6
MAJORITY_CELL = 14  # px: one ViT patch per cell
MAJORITY_IMAGE_SIZE = MAJORITY_GRID * MAJORITY_CELL  # 84 px: 36 patches, few tokens per image
MAJORITY_DOTS = (14, 24)  # total dots, inclusive range
MAJORITY_MARGIN = 3  # the winner has at least this many dots more than any other colour
MAJORITY_DOT_RADIUS = 2  # a 5 px dot in a 14 px cell (~10 % of the patch)
MAJORITY_BACKGROUND = (235, 235, 235)
MAJORITY_FADED = (200, 200, 200)
# (train, test) rows when write_toy_data is not given counts: the experiment's model learns from
# scratch, so it needs more rows, and 256 held-out rows make accuracy differences readable.
DEFAULT_SIZES = {"toy_majority": (4096, 256)}


def make_majority(rng: random.Random) -> dict[str, Any]:
    names = sorted(MAJORITY_COLOURS)
    total = rng.randint(*MAJORITY_DOTS)
    while True:  # rejection: a unique winner with the margin
        cuts = sorted(rng.sample(range(1, total), len(names) - 1))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
        ranked = sorted(counts)
        if ranked[-1] - ranked[-2] >= MAJORITY_MARGIN:
            break
    cells = rng.sample([(r, c) for r in range(MAJORITY_GRID) for c in range(MAJORITY_GRID)], total)
    dots, start = [], 0
    for name, count in zip(names, counts):
        for cell in cells[start : start + count]:
            jitter = (rng.randint(-1, 1), rng.randint(-1, 1))
            dots.append({"cell": cell, "colour": name, "jitter": jitter})
        start += count
    dots.sort(key=lambda d: d["cell"])
    answer = names[counts.index(ranked[-1])]
    return {"dots": dots, "counts": dict(zip(names, counts)), "answer": answer}


def render_majority(puzzle: dict[str, Any], highlight: bool) -> Image.Image:
    image = Image.new("RGB", (MAJORITY_IMAGE_SIZE, MAJORITY_IMAGE_SIZE), MAJORITY_BACKGROUND)
    draw = ImageDraw.Draw(image)
    for dot in puzzle["dots"]:
        r, c = dot["cell"]
        x0, y0 = c * MAJORITY_CELL, r * MAJORITY_CELL
        winner = dot["colour"] == puzzle["answer"]
        if highlight and winner:  # the decisive evidence, as large as it gets: the whole cell
            draw.rectangle([x0, y0, x0 + MAJORITY_CELL - 1, y0 + MAJORITY_CELL - 1],
                           fill=MAJORITY_COLOURS[dot["colour"]])  # fmt: skip
            continue
        fill = MAJORITY_FADED if highlight else MAJORITY_COLOURS[dot["colour"]]
        cx = x0 + MAJORITY_CELL // 2 + dot["jitter"][0]
        cy = y0 + MAJORITY_CELL // 2 + dot["jitter"][1]
        h = MAJORITY_DOT_RADIUS
        draw.ellipse([cx - h, cy - h, cx + h, cy + h], fill=fill)
    return image


def majority_texts(puzzle: dict[str, Any]) -> dict[str, str]:
    answer = puzzle["answer"]
    question = (
        "Dots of four colours are scattered over the image. Which colour has the most dots: "
        "red, green, blue or yellow?"
    )
    thought_0 = "I will keep the dots of the most frequent colour and fade the others."
    thought_1 = f"The kept dots are {answer}. So the answer is {answer}."
    # Short on purpose: the decisive token is the first colour word, and short completions keep
    # the experiment's sampling cheap.
    full = f"Most dots are {answer}."
    return {"question": question, "answer": answer, "thoughts": [thought_0, thought_1],
            "full_text_only_thought": full}  # fmt: skip


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
    render = {"toy_maze": render_maze, "toy_count": render_count,
              "toy_majority": render_majority}[task]  # fmt: skip
    return render(puzzle, False), render(puzzle, True)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # PIL's PNG encoder is deterministic for fixed settings
    return buffer.getvalue()


def make_rows(task: str, split: str, num: int, seed: int) -> list[dict[str, Any]]:
    """Rows in the ThinkMorph column layout (images as {bytes, path} dicts of PNG bytes)."""
    rows = []
    for i, puzzle in enumerate(make_puzzles(task, split, num, seed)):
        pid = f"{task}_{split}_{i:05d}"
        text = puzzle_texts(task, puzzle)
        problem, vt = render_puzzle(task, puzzle)
        rows.append({
            "pid": pid,
            "question": text["question"],
            "answer": text["answer"],
            "problem_image_0": {"bytes": _png(problem), "path": f"{pid}_problem.png"},
            "resoning_thought_0": text["thoughts"][0],
            "reasoning_image_0": {"bytes": _png(vt), "path": f"{pid}_vt0.png"},
            "resoning_thought_1": text["thoughts"][1],
            "full_text_only_thought": text["full_text_only_thought"],
        })  # fmt: skip
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
        # The ThinkMorph output format (§c.2), so a tokenizer also sees the tags in context.
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
    return pa.schema([
        ("pid", pa.string()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("problem_image_0", image),
        ("resoning_thought_0", pa.string()),
        ("reasoning_image_0", image),
        ("resoning_thought_1", pa.string()),
        ("full_text_only_thought", pa.string()),
    ])  # fmt: skip


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num_train",
        type=int,
        default=None,
        help="train rows per task (default 320, opt-in tasks: DEFAULT_SIZES)",
    )
    parser.add_argument(
        "--num_test",
        type=int,
        default=None,
        help="held-out rows per task (default 64, opt-in tasks: DEFAULT_SIZES)",
    )
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"comma list of {ALL_TASKS} (default: {','.join(TASKS)})")  # fmt: skip
    parser.add_argument("--jsonl", action="store_true", help="also write the JSONL+images layout")
    parser.add_argument("--corpus_out", default=None, help="also write the text corpus here")
    args = parser.parse_args(argv)

    tasks = [t for t in args.tasks.split(",") if t]
    written = write_toy_data(args.out, args.seed, args.num_train, args.num_test, tasks, args.jsonl)
    for name, path in written.items():
        print(f"{name}: {path}")
    if args.corpus_out:
        with open(args.corpus_out, "w", encoding="utf-8") as f:
            f.write(toy_corpus_text(args.seed, args.num_train, args.num_test, tasks))
        print(f"corpus: {args.corpus_out}")


if __name__ == "__main__":
    main()
