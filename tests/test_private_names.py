"""A module's underscore names are its own: no file of the package, the scripts or the benches
imports one from another module (`from m import _x`) or reaches one through a module
(`m._x`). A name another file needs is public in the module that defines it.

Tests may look inside (they are white-box), so they are not scanned.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ["models", "opsd_jax", "scripts", "bench", "train.py", "configs"]
# Underscore names of other libraries' modules that the code calls on purpose.
OUTSIDE = {"torch"}


def private_uses(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    modules = {}  # local name -> module it stands for (`import x as y`, `from p import m`)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in OUTSIDE:
                continue
            uses += [
                f"from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and modules[node.value.id].split(".")[0] not in OUTSIDE
        ):
            uses.append(f"{node.value.id}.{node.attr} ({modules[node.value.id]})")
    return uses


def scanned_files():
    for name in SCANNED:
        path = ROOT / name
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def test_no_private_name_is_used_across_modules():
    found = {str(p.relative_to(ROOT)): u for p in scanned_files() if (u := private_uses(p))}
    assert not found, found


def test_the_scan_finds_both_kinds_of_use(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from opsd_jax.sampling.sampler import _x\n"
        "from opsd_jax.sampling import sampler\n"
        "sampler._y()\n"
        "import torch\ntorch._foreach_add_\n"
    )
    assert private_uses(bad) == [
        "from opsd_jax.sampling.sampler import _x",
        "sampler._y (opsd_jax.sampling.sampler)",
    ]
