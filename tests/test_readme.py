"""The README's Python example runs as written (docs stay true to the code)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_model_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["hidden"].shape == (1, 128, 64)
    assert namespace["logits"].shape == (1, 1, 1024)
    # The image block (54 patches + 2 markers) and the question (3 ids + 2 markers) fill 61 slots.
    assert namespace["last"] == 60
