"""Judge-free scoring of benchmark answers.

Multiple choice (`choice_of`): the letter is found by the rules VLMEvalKit applies to a model's
answer before it asks an LLM judge (its utils/matching_util.py), on the whole answer first and
then on what the answer marks as final (`<answer>...</answer>`, else `\\boxed{...}`), as the
ThinkMorph fork of the harness does. Where the harness would then call a judge, we count a
miss: every score here is a lower bound of the judged one on the same answers.

The letter rules, in order:
1. a refusal phrase makes the answer 'Z' (no option);
2. the punctuation `.()[],:;!*#{}` becomes spaces and the answer splits into words; exactly one
   of the option letters must be a word, and its first appearance must be among the last four
   words (a letter early in a long answer is an article or a label, not the choice); no letter
   but a word 'Z' is 'Z'; two or more letters are ambiguous (no choice);
3. failing that, exactly one option's text, lower-cased, inside the lower-cased answer (only
   for answers at most twice as long as all the options' texts together).

Lower-case letters are not letters here (`(b)` names no option), as in the harness.

Free-form numbers (`relaxed_correct`): ChartQA's relaxed accuracy, a number within 5% of the
gold one (a trailing `%` divides by 100), any other answer by case-insensitive equality.

VSP mazes (`maze_path_solves`): the last `\\boxed{...}` move list (comma-separated R, L, U, D)
walked on the row's map from S must stay on the map, never step on a hole H, and end on G.
"""

from __future__ import annotations

import ast
import re

REFUSALS = (
    "Sorry, I can't help with images of people yet.",
    "I can't process this file.",
    "I'm sorry, but without the image provided",
    "Cannot determine the answer",
)
NO_CHOICE = "Z"  # the harness's letter for "none of the options"
_PUNCTUATION = re.compile(r"[.()\[\],:;!*#{}]")
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOXED = re.compile(r"\\boxed\{([^}]*)\}")
# Letters this close to the end of the word list count as the answer's choice.
LAST_WORDS = 4


def letter_in(answer: str, options: dict[str, str]) -> str | None:
    """Rules 1-2: the one option letter the answer names, 'Z', or None."""
    if any(phrase in answer for phrase in REFUSALS):
        return NO_CHOICE
    words = _PUNCTUATION.sub(" ", answer).split()
    named = [letter for letter in options if letter in words]
    if len(named) == 1:
        letter = named[0]
        return letter if words.index(letter) >= len(words) - LAST_WORDS else None
    if not named and NO_CHOICE in words:
        return NO_CHOICE
    return None


def option_text_in(answer: str, options: dict[str, str]) -> str | None:
    """Rule 3: the one option whose text is inside the answer, or None."""
    answer = answer.lower()
    if len(answer) > 2 * sum(len(text) for text in options.values()):
        return None
    found = [letter for letter, text in options.items() if text.lower() in answer]
    return found[0] if len(found) == 1 else None


def infer_choice(answer: str, options: dict[str, str]) -> str | None:
    """Rules 1-3 on one text."""
    return letter_in(answer, options) or option_text_in(answer, options)


def final_answer(prediction: str) -> str | None:
    """What a prediction marks as its answer: the first `<answer>...</answer>`, else the first
    `\\boxed{...}`; None when it marks nothing."""
    tagged = _TAGGED.search(prediction)
    if tagged:
        return tagged.group(1)
    boxed = _BOXED.search(prediction)
    return boxed.group(1) if boxed else None


def rule_choice(prediction: str, options: dict[str, str]) -> str | None:
    """The option letter (or 'Z') the rules read in a prediction: the whole text first, then its
    marked answer; None when they read nothing, where the harness would ask its judge."""
    choice = infer_choice(prediction, options)
    marked = final_answer(prediction)
    if not choice and marked is not None:
        choice = infer_choice(marked, options)
    return choice


def choice_of(prediction: str, options: dict[str, str]) -> str:
    """The option letter a prediction chooses; 'Z' (a miss) where the rules read nothing."""
    return rule_choice(prediction, options) or NO_CHOICE


def circular_hits(groups: dict[int, list[bool]]) -> dict[int, bool]:
    """Circular evaluation: a question counts only when every rotation of its options was
    answered right."""
    return {group: all(hits) for group, hits in groups.items()}


def pair_accuracy(hits: list[bool]) -> float:
    """MMVP's pair accuracy: rows 2i and 2i+1 (one image pair) must both be right."""
    pairs = [hits[i] and hits[i + 1] for i in range(0, len(hits) - 1, 2)]
    return sum(pairs) / len(pairs) if pairs else 0.0


# ---- free-form numbers (ChartQA) ----------------------------------------------------------------

_NUMBER_WITH_UNIT = re.compile(r"^[$€£]?\s*([-+]?\d[\d,]*(?:\.\d+)?)\s*(%?)\s*[A-Za-z]*\.?$")


def as_number(text: str) -> float | None:
    """A number written as an answer: '12', '12.5%' (0.125), and, judge-free, what a judge
    would strip first: a currency sign, thousands commas, one trailing unit word ('12 million'
    is 12, '3.5 kg' is 3.5)."""
    text = text.strip()
    match = _NUMBER_WITH_UNIT.match(text)
    if not match:
        return None
    value = float(match.group(1).replace(",", ""))
    return value / 100 if match.group(2) else value


def relaxed_correct(gold: str, prediction: str, tolerance: float = 0.05) -> bool:
    """ChartQA's relaxed accuracy: numbers within `tolerance` of the gold one (relative to it),
    other answers equal up to case. A gold 0 is compared as text."""
    gold_value, value = as_number(gold), as_number(prediction)
    if gold_value is not None and value is not None and gold_value != 0:
        return abs(value - gold_value) / abs(gold_value) <= tolerance
    return prediction.strip().lower() == gold.strip().lower()


def free_form_answer(prediction: str) -> str:
    """The answer of a free-form prediction: its marked answer, else its last non-empty line."""
    marked = final_answer(prediction)
    if marked is not None:
        return marked.strip()
    lines = [line.strip() for line in prediction.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def gold_answers(answer: str) -> list[str]:
    """A free-form row's gold answers: one, or a list written as a Python list."""
    text = answer.strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            value = ast.literal_eval(text)
            if isinstance(value, list):
                return [str(v) for v in value]
        except (ValueError, SyntaxError):
            pass
    return [text]


# ---- VSP mazes ---------------------------------------------------------------------------------

_MOVES = re.compile(r"\\{1,2}boxed\{([RLUD](?:\s*,\s*[RLUD])*)\}")
_STEP = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


def maze_rows(maze_map: str) -> list[str]:
    """The map's rows ('SFFH', ...): the quoted strings of the `maze_map` cell."""
    return re.findall(r"'([^']*)'", maze_map) or [maze_map.strip()]


def maze_path_solves(prediction: str, maze_map: str) -> bool:
    """The prediction's last boxed move list walks from S to G without leaving the map or
    stepping on a hole."""
    prediction = prediction.replace("\x08", "\\b")  # a '\b' of '\boxed' read as a backspace
    found = _MOVES.findall(prediction)
    if not found:
        return False
    moves = [m for m in re.sub(r"\s", "", found[-1]).strip(",").split(",") if m]
    rows = maze_rows(maze_map)
    start = [(r, row.index("S")) for r, row in enumerate(rows) if "S" in row]
    if not start:
        return False
    r, c = start[0]
    for move in moves:
        dr, dc = _STEP[move]
        r, c = r + dr, c + dc
        if not (0 <= r < len(rows) and 0 <= c < len(rows[r])) or rows[r][c] == "H":
            return False
    return rows[r][c] == "G"
