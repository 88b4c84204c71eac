"""Pulling the final answer out of a completion and comparing it with the reference.

Extraction (`extract_answer`), in order:
1. the content of the last complete `<answer>...</answer>` (one with no other `<answer>` inside:
   in "I will use <answer> tags.</think><answer>B</answer>" that is "B");
2. a completion cut off inside its answer: the text after the last unclosed `<answer>`;
3. no tag: the text after the last "answer is" / "answer:" / "answer is:" (any case, "final"
   allowed before it), up to the end of that line, the next tag, or the end of the sentence;
4. otherwise None (counted as wrong).

Normalisation (`normalize_answer`): Unicode NFKC, lower case, whitespace collapsed, `\\boxed{}` /
`\\text{}` unwrapped, surrounding quotes / `*` / `$` and trailing punctuation removed; option
letters written "(B)", "[B]", "B)", "B.", "option B" become "b"; numbers compare by value
("3.0" == "3" == "03", "1,000" == "1000"). `is_correct` also accepts "(B) the blue square" for
the reference "B": a leading option marker followed by text, when the reference is a letter.
"""

from __future__ import annotations

import re
import unicodedata

# A tagged answer may not contain another opening tag: an earlier `<answer>` that a thought
# mentions would otherwise open the match and swallow the real tag.
_ANSWER_TAG = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.IGNORECASE | re.DOTALL)
_OPEN_TAG = re.compile(r"<answer>", re.IGNORECASE)
# "answer is", "answer:" and "answer is:" (the colon after "is" is not part of the answer).
_ANSWER_PHRASE = re.compile(r"(?:final\s+)?answer\s*(?:is\b\s*:?|:)\s*", re.IGNORECASE)
# The end of a phrase answer: a line break, the next tag, or a sentence end (". " or "." at the
# end), so "the answer is 3.5 m." keeps "3.5 m" and "the answer is B. Because ..." keeps "B".
_PHRASE_END = re.compile(r"\n|<|[.!?](?=\s|$)")
_WRAPPERS = re.compile(r"\\(?:boxed|text|textbf|mathrm)\{([^{}]*)\}")
_OPTION = re.compile(r"(?:(?:option|choice)\s*)?[(\[]?([a-z])[)\]]?")
_LEADING_OPTION = re.compile(r"(?:(?:option|choice)\s*)?[(\[]?([a-z])[)\].:](?:\s|$)")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The final answer written in a completion (see the module docstring for the rules)."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    opened = list(_OPEN_TAG.finditer(text))
    if opened:
        rest = text[opened[-1].end() :].strip()
        return rest or None
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if phrases:
        rest = text[phrases[-1].end() :]
        end = _PHRASE_END.search(rest)
        rest = (rest[: end.start()] if end else rest).strip()
        return rest or None
    return None


def normalize_answer(answer: str) -> str:
    """A canonical form for exact-match comparison (see the module docstring)."""
    s = unicodedata.normalize("NFKC", answer).strip().lower()
    previous = None
    while previous != s:  # nested wrappers: \boxed{\text{b}}
        previous, s = s, _WRAPPERS.sub(r"\1", s)
    s = re.sub(r"\s+", " ", s)
    previous = None
    while previous != s:  # quotes, markdown bold, math dollars and trailing punctuation, any order
        previous = s
        s = s.strip(" '\"`*$").rstrip(".,;:!?。")
    option = _OPTION.fullmatch(s)
    if option:
        return option.group(1)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _NUMBER.fullmatch(s):
        value = float(s)
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))  # also turns "-0" into "0"
        return repr(value)
    return s


def is_correct(prediction: str | None, reference: str) -> bool:
    """Exact match after normalisation; a missing prediction is wrong."""
    if prediction is None:
        return False
    predicted, expected = normalize_answer(prediction), normalize_answer(reference)
    if predicted == expected:
        return True
    if len(expected) == 1 and expected.isalpha():
        # Multiple choice: "(b) the blue square" answers "B".
        leading = _LEADING_OPTION.match(predicted)
        return bool(leading) and leading.group(1) == expected
    return False


def has_answer_tag(text: str) -> bool:
    """Whether a completion wrote a complete `<answer>...</answer>`."""
    return bool(_ANSWER_TAG.search(text))
