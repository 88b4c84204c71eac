"""The README's Python examples run as written (docs stay true to the code)."""

import pathlib
import re

from opsd_jax.run_config import checks

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_example(marker: str) -> str:
    """The README's ```python block that contains `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"README.md has {len(found)} python examples with {marker!r}"
    return found[0]


def test_readme_model_example_runs():
    namespace: dict = {}
    exec(compile(python_example("Bagel("), "README.md", "exec"), namespace)
    assert namespace["hidden"].shape == (1, 128, 64)
    assert namespace["logits"].shape == (1, 1, 1024)
    # The image block (54 patches + 2 markers) and the question (3 ids + 2 markers) fill 61 slots.
    assert namespace["last"] == 60


def test_readme_own_data_config_is_valid():
    namespace: dict = {}
    exec(compile(python_example("def get_config"), "README.md", "exec"), namespace)
    config = namespace["get_config"]()
    # Every value passes train.py's checks for the 8 GPUs the recipe runs on (the example's
    # folders are the user's, so no path is checked).
    checks.validate(config, 8, check_files=False)
    assert [d["name"] for d in config.data.datasets] == ["counting", "charts"]
