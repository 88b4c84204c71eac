"""Judge-free scoring of benchmark answers, by the rules of the harness the paper used (the
ThinkMorph fork of VLMEvalKit, hychaochao/VLMEvalKit_Thinkmorph): where it would then call an
LLM judge, we count a miss, so every score here is a lower bound of the judged one on the same
answers, and the records say which answers the rules could not read.

The `<answer>` tag (`tagged_answer`) is cut as the harness cuts it: only when the prediction
holds both `<answer>` and `</answer>` (anywhere, case-sensitive), the text after the first
`<answer>` up to the next `</answer>` or `<answer>`, whichever comes first, or to the end when
neither follows. Nothing is stripped. (A non-greedy `<answer>(.*?)</answer>` search differs:
when the thinking mentions `<answer>` it spans to the real tag's end, and it finds nothing when
the only `</answer>` comes before the `<answer>`.)

Multiple choice (`choice_of`): the letter is found by the rules VLMEvalKit applies to a model's
answer before it asks its judge (its utils/matching_util.py), on the whole answer first and
then on the answer's marked text (`final_answer`): the tag's cut, else (no tag pair) the first
`\\boxed{...}`, stripped, as the fork's multiple-choice extraction does; a marked text that is
empty is not read.

The letter rules, in order:
1. a refusal phrase makes the answer 'Z' (no option);
2. the punctuation `.()[],:;!*#{}` becomes spaces and the answer splits into words; exactly one
   of the option letters must be a word, and its first appearance must be among the last four
   words (a letter early in a long answer is an article or a label, not the choice); no letter
   but a word 'Z' is 'Z'; two or more letters are ambiguous (no choice);
3. failing that, exactly one option's text, lower-cased, inside the lower-cased answer (only
   for answers at most twice as long as all the options' texts together).

Lower-case letters are not letters here (`(b)` names no option), as in the harness.

ChartQA (`chartqa_answer`, `relaxed_correct`): the answer is the tag's cut only (after the
harness's `Round_0:` / `Round_1:` labels are blanked), stripped; an answer without the tag pair
goes to the harness's judge, here a miss (a `\\boxed{}` or a last line is not read). Relaxed
accuracy, with `parse`:
- 'harness' (the default): a text is a number when Python's `float` reads it, a trailing `%`
  dividing it by 100 (so '$1,200', '12 million' are text); the harness measures the 5% against
  the prediction, |gold - prediction| <= 5% of |prediction|; a prediction that is no number or
  is 0, or a gold that is no number, is compared as text, equal up to case;
- 'loose': what a judge would strip first is stripped by rule (a currency sign, thousands
  commas, one trailing unit word: '12 million' is 12), and the 5% is measured against the gold
  answer, as ChartQA defines it (a gold 0 is compared as text); this can score above the
  harness's rules.

VSP mazes (`maze_path`, `maze_path_solves`): the harness reads the last `\\boxed{...}` move list
(comma-separated R, L, U, D) by rule whether or not the answer is tagged, and has no judge for
mazes; walked on the row's map from S it must stay on the map, never step on a hole H, and end
on G.
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
OPEN_TAG, CLOSE_TAG = "<answer>", "</answer>"
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


def tagged_answer(prediction: str) -> str | None:
    """The harness's cut of the `<answer>` tag: None unless both `<answer>` and `</answer>`
    occur; else what follows the first `<answer>`, ended by the first `</answer>` or `<answer>`
    after it (or the prediction's end), unstripped."""
    if OPEN_TAG not in prediction or CLOSE_TAG not in prediction:
        return None
    after = prediction.split(OPEN_TAG)[1]  # up to a second <answer>, if any
    return after.split(CLOSE_TAG)[0]


def boxed_answer(prediction: str) -> str | None:
    """The first `\\boxed{...}`'s content (up to the first `}`), stripped; None without one."""
    boxed = _BOXED.search(prediction)
    return boxed.group(1).strip() if boxed else None


def final_answer(prediction: str) -> str | None:
    """What a multiple-choice prediction marks as its answer, as the harness reads it: the tag's
    cut when both tags occur (even when the cut is empty), else the first `\\boxed{...}`;
    None when it marks nothing."""
    tagged = tagged_answer(prediction)
    return tagged if tagged is not None else boxed_answer(prediction)


def rule_choice(prediction: str, options: dict[str, str]) -> str | None:
    """The option letter (or 'Z') the rules read in a prediction: the whole text first, then its
    marked answer (when not empty); None when they read nothing, where the harness would ask
    its judge."""
    choice = infer_choice(prediction, options)
    if not choice:
        marked = final_answer(prediction)
        if marked:
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


# ---- ChartQA: the tagged answer, relaxed accuracy ----------------------------------------------

CHARTQA_PARSES = ("harness", "loose")
# What the harness blanks in a prediction before it looks for the tag: the labels its ThinkMorph
# model class puts before each text round.
_ROUND_LABELS = ("Round_0:", "Round_1:")
_NUMBER_WITH_UNIT = re.compile(r"^[$€£]?\s*([-+]?\d[\d,]*(?:\.\d+)?)\s*(%?)\s*[A-Za-z]*\.?$")


def chartqa_answer(prediction: str) -> str | None:
    """A ChartQA prediction's answer as the harness reads it by rule: the tag's cut, stripped;
    None without the tag pair (the harness asks its judge; `\\boxed{}` is not read)."""
    for label in _ROUND_LABELS:
        prediction = prediction.replace(label, " ")
    tagged = tagged_answer(prediction)
    return None if tagged is None else tagged.strip()


def harness_number(text: str) -> float | None:
    """A number as the harness's relaxed accuracy reads one: what Python's `float` accepts
    ('12', ' 1e3', '-0.5'), or that followed by `%` signs (a percent: '12%' is 0.12); None
    for anything else ('$3', '1,200', '12 million')."""
    percent = text.endswith("%")
    try:
        value = float(text.rstrip("%") if percent else text)
    except ValueError:
        return None
    return value / 100.0 if percent else value


def as_number(text: str) -> float | None:
    """The loose parse: a number written as an answer, '12', '12.5%' (0.125), and, judge-free,
    what a judge would strip first: a currency sign, thousands commas, one trailing unit word
    ('12 million' is 12, '3.5 kg' is 3.5)."""
    text = text.strip()
    match = _NUMBER_WITH_UNIT.match(text)
    if not match:
        return None
    value = float(match.group(1).replace(",", ""))
    return value / 100 if match.group(2) else value


def relaxed_correct(
    gold: str, prediction: str, tolerance: float = 0.05, parse: str = "harness"
) -> bool:
    """ChartQA's relaxed accuracy with `tolerance`; `parse` (CHARTQA_PARSES): 'harness', its
    rule: plain numbers within `tolerance` of the prediction (relative to the prediction, as
    the harness passes them), a prediction that is no number or 0 compared as text, up to case;
    'loose': `as_number`'s numbers within `tolerance` of the gold one, a gold 0 as text."""
    if parse == "harness":
        prediction = prediction.strip()
        reference, value = harness_number(prediction), harness_number(gold)
        if value is not None and reference:  # None and 0 both fall back to text
            return abs(value - reference) / abs(reference) <= tolerance
        return gold.lower() == prediction.lower()
    if parse != "loose":
        raise ValueError(f"ChartQA parse {parse!r}: one of {', '.join(CHARTQA_PARSES)}")
    gold_value, value = as_number(gold), as_number(prediction)
    if gold_value is not None and value is not None and gold_value != 0:
        return abs(value - gold_value) / abs(gold_value) <= tolerance
    return prediction.strip().lower() == gold.strip().lower()


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


def maze_path(prediction: str) -> str | None:
    """The move list the harness reads: the last boxed list of R, L, U, D, its whitespace
    removed ('R,D'); None without one. A '\\b' of '\\boxed' decoded as a backspace counts."""
    prediction = prediction.replace("\x08", "\\b")
    found = _MOVES.findall(prediction)
    return re.sub(r"\s", "", found[-1]).strip(",") if found else None


def maze_path_solves(prediction: str, maze_map: str) -> bool:
    """The prediction's last boxed move list walks from S to G without leaving the map or
    stepping on a hole."""
    path = maze_path(prediction)
    if path is None:
        return False
    moves = [m for m in path.split(",") if m]
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
