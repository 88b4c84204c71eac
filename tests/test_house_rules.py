"""The size rules a reader relies on: the README stays a user's page of at most 300 lines, and a
module over 450 lines says at its top why it is one module ("One module of about N lines: ...",
N within a quarter of its real length), so a newcomer knows the length is chosen, not grown."""

import ast
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
MODULE_MAX_LINES = 450
# "One module of about 600 lines: why", "One script of over 1000 lines: why".
STATED_LENGTH = re.compile(r"One (?:module|script|file) of [a-z ]*?(\d+) lines:\s*\S")


def length_problem(source: str, lines: int) -> str | None:
    """What is wrong with a module of `lines` lines and this source, or None."""
    if lines <= MODULE_MAX_LINES:
        return None
    match = STATED_LENGTH.search(ast.get_docstring(ast.parse(source)) or "")
    if not match:
        return f"{lines} lines and no 'One module of about N lines: <why>' in its docstring"
    stated = int(match.group(1))
    if abs(lines - stated) > lines / 4:
        return f"{lines} lines, but its docstring says {stated}"
    return None


def tracked_modules() -> list[pathlib.Path]:
    names = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / n for n in names if not n.startswith("tests/") and (ROOT / n).is_file()]


def test_every_module_over_450_lines_says_why_it_is_one():
    modules = tracked_modules()
    assert len(modules) > 100  # the walk found the package, not an empty tree
    problems = []
    for path in modules:
        text = path.read_text()
        problem = length_problem(text, len(text.splitlines()))
        if problem:
            problems.append(f"{path.relative_to(ROOT)}: {problem}")
    assert not problems, "\n".join(problems)


def test_a_long_module_without_its_reason_or_with_a_stale_one_is_found():
    body = "x = 1\n" * 500
    assert "no 'One module" in length_problem('"""A module."""\n' + body, 501)
    stale = '"""A module.\n\nOne module of about 300 lines: one idea."""\n' + body
    assert "says 300" in length_problem(stale, 503)
    good = '"""A module.\n\nOne module of about 500 lines: one idea, read together."""\n' + body
    assert length_problem(good, 503) is None
    assert length_problem("x = 1\n", 1) is None


def test_the_readme_is_at_most_300_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, over {README_MAX_LINES}: move figures and detail to docs/"
    )
