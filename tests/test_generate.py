"""scripts/generate.py's --image_size is parsed and checked before the model loads: a value
that is not MAX,MIN or not positive used to surface only after the load (0,0 as a traceback).
The whole script runs in tests/test_train_cli.py; here the loaders are stand-ins that fail."""

from __future__ import annotations

import builders
import pytest

from scripts import generate


@pytest.fixture
def no_load(monkeypatch):
    builders.refuse_loads(
        monkeypatch, "--image_size", (generate, "load_config"), (generate, "load_model")
    )


@pytest.mark.parametrize(
    "image_size, message",
    [
        ("0,0", r"^--image_size '0,0': ImageTransform.max_size must be a positive int, got 0$"),
        ("112,-1", r"ImageTransform.min_size must be a positive int, got -1"),
        ("112", r"^--image_size '112': expected MAX,MIN \(two integers\)$"),
    ],
)
def test_a_bad_image_size_stops_the_script_before_any_load(tmp_path, no_load, image_size, message):
    from PIL import Image

    Image.new("RGB", (28, 28), (200, 30, 30)).save(tmp_path / "image.png")
    argv = ["--model_dir", str(tmp_path), "--image", str(tmp_path / "image.png")]
    with pytest.raises(SystemExit, match=message):
        generate.main([*argv, "--question", "Which colour?", "--image_size", image_size])
