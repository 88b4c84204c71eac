"""The paper's nine benchmarks (Visual-OPSD Table 2), the VLMEvalKit datasets each is made of,
and how each dataset is prompted and scored here.

Where the datasets come from (the URLs VLMEvalKit downloads them from) and how the harness the
paper used (a ThinkMorph fork of VLMEvalKit) treats each, from its dataset classes:
VSP is a maze whose answer is a path (checked by walking it; the harness needs no judge);
VisPuzzle, V*, BLINK-Jigsaw, MMVP, BLINK and CV-Bench are multiple choice (the question,
options and hint; CV-Bench's own `prompt` column); SAT is multiple choice with each question's
options rotated (circular: all rotations must be right); ChartQA is free-form (relaxed
accuracy). The paper's protocol names an LLM judge for ChartQA, VisPuzzle and V*: our scores
there are judge-free (see scoring.py) and marked so. The harness also falls back to its judge
on every multiple-choice set for an answer its rules cannot read (they read the `<answer>` tag,
else a `\\boxed{}`), and on ChartQA for an answer without the `<answer>` tag pair (a `\\boxed{}`
is not read there); those answers are misses here, and the table counts them. VSP's boxed path
is read by rule, tagged or not.
"""

from __future__ import annotations

import dataclasses

PROMPT_KINDS = ("choice", "plain", "own_prompt")
SCORE_KINDS = ("choice", "circular", "relaxed", "maze")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One VLMEvalKit dataset (one TSV file, `<name>.tsv`)."""

    name: str
    prompt: str  # choice: hint + question + options; plain: the question; own_prompt: `prompt`
    score: str  # choice | circular | relaxed | maze
    # The score the paper quotes: 'mean' of rows, or 'mean_over_source' (CV-Bench-2D: the mean
    # of its ADE20K and COCO parts' accuracies, as the harness reports it).
    report: str = "mean"
    # Rows 2i and 2i+1 are one image pair (MMVP): the pair accuracy is reported beside the score.
    pairs: bool = False
    # The question places the images itself with `<IMAGE-n>` / `<TEST-IMAGE>` tags (VSP).
    image_tags: bool = False


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A column of the paper's Table 2: its datasets, averaged when there are several."""

    name: str
    title: str
    datasets: tuple[Dataset, ...]
    judged_in_paper: bool  # the paper's protocol used an LLM judge here: ours is judge-free


_CHOICE = dict(prompt="choice", score="choice")

BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark(
            "vsp",
            "VSP",
            (
                Dataset(
                    "VSP_maze_task_main_original", prompt="plain", score="maze", image_tags=True
                ),
            ),
            judged_in_paper=False,
        ),
        Benchmark("vispuzzle", "VisPuzzle", (Dataset("VisPuzzle", **_CHOICE),), True),
        Benchmark(
            "chartqa",
            "ChartQA",
            (
                Dataset("ChartQA_h_bar", prompt="plain", score="relaxed"),
                Dataset("ChartQA_v_bar", prompt="plain", score="relaxed"),
            ),
            judged_in_paper=True,
        ),
        Benchmark("vstar", "V*", (Dataset("VStarBench", **_CHOICE),), True),
        Benchmark("blink_jigsaw", "BLINK-J", (Dataset("BLINK_Jigsaw", **_CHOICE),), False),
        Benchmark("mmvp", "MMVP", (Dataset("MMVP", **_CHOICE, pairs=True),), False),
        Benchmark(
            "sat", "SAT", (Dataset("SAT_circular", prompt="choice", score="circular"),), False
        ),
        Benchmark("blink", "BLINK", (Dataset("BLINK", **_CHOICE),), False),
        Benchmark(
            "cvbench",
            "CV-Bench",
            (
                Dataset(
                    "CV-Bench-2D", prompt="own_prompt", score="choice", report="mean_over_source"
                ),
                Dataset("CV-Bench-3D", prompt="own_prompt", score="choice"),
            ),
            judged_in_paper=False,
        ),
    )
}
PAPER_ORDER = tuple(BENCHMARKS)
# Table 2 of the paper (averages over the nine): the baseline and the method.
PAPER_AVERAGES = {"ThinkMorph-7B": 70.63, "Visual-OPSD": 74.03}


def benchmarks_named(names: str) -> list[Benchmark]:
    """`vsp,chartqa,...` (or `all`) -> the benchmarks, in the order given; an unknown name is
    an error that lists the valid ones."""
    wanted = list(PAPER_ORDER) if names.strip() == "all" else [n.strip() for n in names.split(",")]
    unknown = [n for n in wanted if n not in BENCHMARKS]
    if unknown:
        raise ValueError(
            f"--benchmarks: unknown {', '.join(map(repr, unknown))}; the benchmarks are "
            f"{', '.join(PAPER_ORDER)} (or all)"
        )
    return [BENCHMARKS[n] for n in wanted]
