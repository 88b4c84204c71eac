"""Every citation of docs/ in the code resolves: the file exists and has the cited section
(`docs/bagel_layout.md §4.1`, `docs/opsd_loss.md a.1` or `§c.2`; a range `§4.1-4.3` cites its
first section, `§10 item 8` an item of section 10's list)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# "docs/<file>.md" and the sections that follow it: "§4.1", "a.1", "section a", "§4.1-4.3",
# "§10 item 8", several joined by commas.
PART = (
    r"(?:section |§)?([0-9]+(?:\.[0-9]+)?|[a-c](?:\.[0-9]+)?)\b(?:-[0-9.]+)?(?: items? ([0-9]+))?"
)


def citations(text: str):
    found = []
    for m in re.finditer(
        r"docs/(\w+\.md)((?:,? (?:section |§)?(?:[0-9]+(?:\.[0-9]+)?|[a-c](?:\.[0-9]+)?)"
        r"\b(?:-[0-9.]+)?(?: items? [0-9]+)?)*)",
        text,
    ):
        parts = re.findall(PART, m.group(2))
        found += [(m.group(1), section, item or None) for section, item in parts] or [
            (m.group(1), None, None)
        ]
    return found


def sections(doc: str) -> set[str]:
    """The section numbers a doc's headings give: '4.1', '10', 'a', 'a.1', 'c.2'."""
    found = set()
    for line in doc.splitlines():
        m = re.match(r"#+ (?:\(([a-z])\)|([0-9]+(?:\.[0-9]+)?)\.?|([a-z]\.[0-9]+)) ", line)
        if m:
            found.add(next(g for g in m.groups() if g))
    return found


def items(doc: str, section: str) -> set[str]:
    """The numbered items of a section's list ('1.', '2.', ... at a line start)."""
    part = re.split(rf"\n#+ {re.escape(section)}\.? ", doc, maxsplit=1)[-1]
    part = re.split(r"\n#+ ", part, maxsplit=1)[0]
    return set(re.findall(r"^([0-9]+)\. ", part, re.M))


def test_every_docs_citation_in_the_code_resolves():
    files = [
        p
        for d in ("models", "opsd_jax", "configs", "scripts", "bench", "tests")
        for p in (ROOT / d).rglob("*.py")
        if p.name != "test_docs.py"
    ] + [ROOT / "train.py"]
    cited = [(p, c) for p in files for c in citations(p.read_text(encoding="utf-8"))]
    assert len(cited) >= 30  # the scan sees the citations
    problems = []
    for path, (name, section, item) in cited:
        doc_path = ROOT / "docs" / name
        where = f"{path.relative_to(ROOT)}: docs/{name}"
        if not doc_path.is_file():
            problems.append(f"{where}: no such file")
            continue
        doc = doc_path.read_text(encoding="utf-8")
        if section and section not in sections(doc):
            problems.append(f"{where} §{section}: no such section")
        elif section and item and item not in items(doc, section):
            problems.append(f"{where} §{section} item {item}: no such item")
    assert not problems, "\n".join(problems)


def test_a_missing_section_or_file_is_found():
    assert citations("see docs/opsd_loss.md §c.9 and docs/bagel_layout.md §10 item 4") == [
        ("opsd_loss.md", "c.9", None),
        ("bagel_layout.md", "10", "4"),
    ]
    assert "c.9" not in sections((ROOT / "docs" / "opsd_loss.md").read_text(encoding="utf-8"))
    assert "a.1" in sections((ROOT / "docs" / "opsd_loss.md").read_text(encoding="utf-8"))
    assert citations("docs/bagel_layout.md §4.1-4.3, §10 items 8") == [
        ("bagel_layout.md", "4.1", None),
        ("bagel_layout.md", "10", "8"),
    ]
    layout = (ROOT / "docs" / "bagel_layout.md").read_text(encoding="utf-8")
    assert "8" in items(layout, "10") and "99" not in items(layout, "10")


# --- docs/configuration.md's table against configs/common.py ---------------------------------

CONFIGURATION = ROOT / "docs" / "configuration.md"
# The order in which the table states `data.image_transform` (ConfigDict iterates sorted keys).
IMAGE_TRANSFORM_ORDER = ("max_size", "min_size", "stride", "max_pixels")


def config_table(text: str) -> list[tuple[list[str], str]]:
    """The key table's rows: (the backquoted names of the first column, the default cell)."""
    rows = []
    for line in text.splitlines():
        # Cells split at unescaped pipes (a `\|` inside a code span is part of the value).
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 3 and cells[0] not in ("key", "---"):
            rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[1]))
    return rows


def documented_keys() -> dict:
    """Every key the docs must name: the top-level keys and `data.*`, with their defaults."""
    from configs import common

    config = common.base_config()
    keys = {k: v for k, v in config.items() if k != "data"}
    keys.update({f"data.{k}": v for k, v in config.data.items()})
    return keys


def split_values(cell: str) -> list[str]:
    """A default cell's values: split at ', ' outside parentheses and code spans."""
    values, depth, code, start = [], 0, False, 0
    for i, ch in enumerate(cell):
        if ch == "`":
            code = not code
        elif not code and ch == "(":
            depth += 1
        elif not code and ch == ")":
            depth -= 1
        elif not code and depth == 0 and cell.startswith(", ", i):
            values.append(cell[start:i])
            start = i + 2
    return values + [cell[start:]]


def parse_value(text: str):
    """One stated default: a code span is the value as written; otherwise the text before any
    note in parentheses: True / False, a number, '' (the empty string) or a bare string."""
    text = text.strip()
    if text.startswith("`"):
        return text[1 : text.index("`", 1)].replace("\\|", "|")
    text = re.sub(r"\s*\(.*\)$", "", text).strip()
    if text in ("True", "False"):
        return text == "True"
    if text == "''":
        return ""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def default_problems(names: list[str], cell: str, defaults: dict) -> list[str]:
    """Where a row's stated defaults contradict configs/common.py. Scalars are compared as
    values; the nested dict (the image transform) by the numbers the cell lists, in order; an
    empty list as `[]`; a tuple (the prompt buckets) is described in words and not compared."""
    if all(isinstance(defaults[n], tuple) for n in names):
        return []
    values = split_values(cell)
    if len(values) == 1:
        values = values * len(names)  # one value for every key of the row
    if len(values) != len(names):
        return [f"{', '.join(names)}: {len(values)} defaults for {len(names)} keys: {cell!r}"]
    problems = []
    for name, text in zip(names, values, strict=True):
        actual = defaults[name]
        if hasattr(actual, "items"):
            stated = [int(n.replace(",", "")) for n in re.findall(r"[0-9][0-9,]*", text)]
            same = stated == [actual[k] for k in IMAGE_TRANSFORM_ORDER]
        elif isinstance(actual, list):
            same = text.strip() == "[]" and actual == []
        elif isinstance(actual, tuple):
            continue
        else:
            stated = parse_value(text)
            if type(stated) is bool or type(actual) is bool or isinstance(actual, str):
                same = stated == actual and type(stated) is type(actual)
            else:
                same = isinstance(stated, (int, float)) and stated == actual
        if not same:
            problems.append(f"{name}: the doc says {text.strip()!r}, configs/common.py {actual!r}")
    return problems


def config_table_problems(text: str) -> list[str]:
    defaults = documented_keys()
    rows = config_table(text)
    named = [name for names, _ in rows for name in names]
    problems = [f"{k}: not in docs/configuration.md" for k in defaults if k not in named]
    problems += [f"{n}: in docs/configuration.md, not a key" for n in named if n not in defaults]
    problems += [f"{n}: named twice" for n in sorted(set(named)) if named.count(n) > 1]
    for names, cell in rows:
        if all(n in defaults for n in names):
            problems += default_problems(names, cell, defaults)
    return problems


def test_configuration_doc_names_every_key_with_its_default():
    text = CONFIGURATION.read_text(encoding="utf-8")
    assert len(config_table(text)) >= 40  # the scan sees the table
    problems = config_table_problems(text)
    assert not problems, "\n".join(problems)


def test_a_missing_key_a_made_up_key_or_a_wrong_default_is_found():
    text = CONFIGURATION.read_text(encoding="utf-8")
    row = "| `jsd_weight`, `ce_weight`, `loss_reduction` | 1.0, 0.0, seq_mean |"
    assert row in text
    # A key left out of the table.
    missing = text.replace(row, "| `jsd_weight`, `loss_reduction` | 1.0, seq_mean |")
    assert config_table_problems(missing) == ["ce_weight: not in docs/configuration.md"]
    # A name that is no key.
    made_up = text.replace(row, row.replace("`ce_weight`", "`ce_weight`, `ce_wieght`"))
    assert "ce_wieght: in docs/configuration.md, not a key" in config_table_problems(made_up)
    # A default that contradicts the code, and one of the wrong type.
    wrong = text.replace(row, row.replace("1.0, 0.0, seq_mean", "1.0, 0.5, seq_mean"))
    assert config_table_problems(wrong) == ["ce_weight: the doc says '0.5', configs/common.py 0.0"]
    flag = text.replace("| `unroll_layers` | False |", "| `unroll_layers` | 0 |")
    assert config_table_problems(flag) == [
        "unroll_layers: the doc says '0', configs/common.py False"
    ]
    pixels = text.replace("980 / 378 / 14 / 2,007,040", "980 / 378 / 14 / 1,806,336")
    assert config_table_problems(pixels)[0].startswith("data.image_transform: the doc says")


# --- every repository path the code and the docs cite exists ------------------------------------

# A path of this repository: it starts at one of its top-level folders or files.
TOP_LEVEL = ("models", "opsd_jax", "configs", "scripts", "bench", "tests", "docs", ".ci")
TOP_FILES = r"train\.py|README\.md|DESIGN\.md|pyproject\.toml|requirements(?:-\w+)?\.txt"
REPO_PATH = re.compile(
    r"(?<![\w./<>{}$~-])((?:" + "|".join(re.escape(d) for d in TOP_LEVEL) + r")/[\w./*-]*"
    r"|(?:" + TOP_FILES + r")(?![\w.-]))"
)
# Paths of other repositories that share a top-level folder name with ours, cited as theirs.
OTHER_REPOSITORIES = (
    "scripts/visual_opsd/",  # the PyTorch Visual-OPSD trainer (TiezMind/Visual-OPSD)
    "docs/en/",  # VLMEvalKit's documentation (open-compass/VLMEvalKit)
)
# Paths that must not exist: a test's made-up config file.
MADE_UP = ("configs/nope.py",)  # tests/test_train_cli.py: --config of a missing file


def cited_paths(text: str) -> list[tuple[str, int]]:
    """The repository paths a text names, each with its offset: `opsd_jax/io/hf_load.py`,
    `configs/toy_*.py`, `models/layers.scan_layers` (a module and a name in it), `docs/`."""
    found = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".,")  # a sentence's full stop or comma is not part of it
        if not path.startswith(OTHER_REPOSITORIES) and path not in MADE_UP:
            found.append((path, m.start()))
    return found


def path_problem(path: str) -> str | None:
    """None when `path` names what exists: a file or folder, a glob matching at least one
    file, or `module.name` with `name` in the module's source."""
    if "*" in path:
        return None if list(ROOT.glob(path)) else "matches no file"
    if (ROOT / path).exists():
        return None
    module, _, name = path.rpartition(".")
    source = ROOT / f"{module}.py"
    if module and name.isidentifier() and source.is_file():
        found = re.search(rf"\b{re.escape(name)}\b", source.read_text(encoding="utf-8"))
        return None if found else f"{module}.py has no {name}"
    return "no such file or folder"


def citing_files() -> list[pathlib.Path]:
    code = [
        p
        for d in ("models", "opsd_jax", "configs", "scripts", "bench", "tests")
        for p in (ROOT / d).rglob("*.py")
        if p.name != "test_docs.py"  # its examples below are made up on purpose
    ]
    return code + [ROOT / "train.py", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_repository_path_cited_in_the_code_and_the_docs_exists():
    problems, count = [], 0
    for file in citing_files():
        text = file.read_text(encoding="utf-8")
        for path, offset in cited_paths(text):
            count += 1
            problem = path_problem(path)
            if problem:
                line = text.count("\n", 0, offset) + 1
                problems.append(f"{file.relative_to(ROOT)}:{line}: {path}: {problem}")
    assert count >= 300  # the scan sees the citations
    assert not problems, "\n".join(problems)


def test_a_made_up_path_is_found():
    text = (
        "see opsd_jax/io/hf_load.py, configs/toy_*.py, models/layers.scan_layers and docs/; "
        "not opsd_jax/io/hf_loader.py, configs/nothing_*.py, models/layers.no_such_name, "
        "bench/gone/; another repo's scripts/visual_opsd/train_visual_opsd.py, results/tiny, "
        "<run>/checkpoints/1, https://github.com/x/y/blob/main/models/z.py"
    )
    paths = [path for path, _ in cited_paths(text)]
    assert paths == [
        "opsd_jax/io/hf_load.py",
        "configs/toy_*.py",
        "models/layers.scan_layers",
        "docs/",
        "opsd_jax/io/hf_loader.py",
        "configs/nothing_*.py",
        "models/layers.no_such_name",
        "bench/gone/",
    ]
    assert [path_problem(p) for p in paths] == [None] * 4 + [
        "no such file or folder",
        "matches no file",
        "models/layers.py has no no_such_name",
        "no such file or folder",
    ]


# --- every link between the README and docs/ lands on a file and a heading --------------------


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_between_the_readme_and_the_docs_resolves():
    problems, count = [], 0
    for file in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(
            r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)", file.read_text(encoding="utf-8")
        ):
            count += 1
            doc = (file.parent / target).resolve()
            if not doc.is_file():
                problems.append(f"{file.relative_to(ROOT)}: {target}: no such file")
            elif anchor and anchor not in anchors(doc.read_text(encoding="utf-8")):
                problems.append(f"{file.relative_to(ROOT)}: {target}#{anchor}: no such heading")
    assert count >= 20  # the scan sees the links
    assert not problems, "\n".join(problems)


def test_a_heading_anchor_is_spelled_as_github_spells_it():
    text = "# On a GPU: `bench/gpu_check.py`\n## Will it fit? Ask the compiler\n```\n# not\n```"
    assert anchors(text) == {"on-a-gpu-benchgpu_checkpy", "will-it-fit-ask-the-compiler"}
