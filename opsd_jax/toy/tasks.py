"""The toy visual-reasoning tasks: puzzle generators, their images and their texts.

Three tasks whose visual thought (VT) image is the intermediate step that makes the answer easy,
in the spirit of ThinkMorph's Spatial_Navigation and Visual_Search:

* `toy_maze`: a 5x5 maze (black walls), a green start, a red goal (A) and a blue goal (B); exactly
  one goal is connected to the start. Question: which goal can be reached? Answer "A" or "B".
  VT: the same maze with the route from the start to the reachable goal drawn in orange.
* `toy_count`: 3-8 coloured shapes (circle / square / triangle in red / green / blue) on a 4x4
  grid of slots. Question: how many <colour> <shape>s? Answer "1".."4". VT: the target shapes
  boxed, every other shape faded to grey.
* `toy_majority` (opt-in, not in the default TASKS; the toy Visual-OPSD experiment): dots of four
  colours on a 6x6 grid (84 px images). Question: which colour has the most dots? Answer a colour
  word. VT: the winning colour's dots fill their cells, every other dot faded to grey.

A puzzle is pure data (a dict); rendering and texts are functions of it. data.py turns puzzles
into ThinkMorph rows and files.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

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


def _routes(start, passages) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """The route from start to every cell it reaches: one breadth-first search, each route read
    back along the parents (in a tree each route is unique; BFS just finds them all at once)."""
    parent = {start: None}
    queue = [start]
    for cell in queue:
        for nb in _neighbours(cell):
            if frozenset((cell, nb)) in passages and nb not in parent:
                parent[nb] = cell
                queue.append(nb)
    routes = {}
    for goal in parent:
        route = [goal]
        while parent[route[-1]] is not None:
            route.append(parent[route[-1]])
        routes[goal] = route[::-1]
    return routes


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
    reached = _routes(start, kept)
    routes = {cell: reached[cell] for cell in sorted(comp_a) if cell != start}
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
    return {
        "question": question,
        "answer": answer,
        "thoughts": [thought_0, thought_1],
        "full_text_only_thought": full,
    }


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
    slots = rng.sample(
        [(r, c) for r in range(COUNT_SLOTS) for c in range(COUNT_SLOTS)], num_targets + num_other
    )
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
            draw.rectangle(
                [c * SLOT + 1, r * SLOT + 1, (c + 1) * SLOT - 2, (r + 1) * SLOT - 2],
                outline=(0, 0, 0),
                width=2,
            )
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
    return {
        "question": question,
        "answer": answer,
        "thoughts": [thought_0, thought_1],
        "full_text_only_thought": full,
    }


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


# The accuracy of always giving one answer where the answer is uniform over a fixed set: the
# floor a held-out accuracy is read against (toy_count's counts are not uniform: no figure).
CHANCE_ACCURACY = {"toy_maze": 1 / 2, "toy_majority": 1 / len(MAJORITY_COLOURS)}


def chance_accuracy(tasks) -> float | None:
    """The chance level shared by `tasks`, or None (unknown for one, or they differ)."""
    levels = {CHANCE_ACCURACY.get(task) for task in tasks}
    return levels.pop() if len(levels) == 1 else None


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
            draw.rectangle(
                [x0, y0, x0 + MAJORITY_CELL - 1, y0 + MAJORITY_CELL - 1],
                fill=MAJORITY_COLOURS[dot["colour"]],
            )
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
    return {
        "question": question,
        "answer": answer,
        "thoughts": [thought_0, thought_1],
        "full_text_only_thought": full,
    }
