"""Which folder the persistent compilation cache uses for a config value (on by default)."""

import os

from opsd_jax.io import compile_cache


def test_auto_is_the_environment_else_the_per_user_default(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "from_env"))
    assert compile_cache.resolve("auto") == str(tmp_path / "from_env")
    monkeypatch.delenv(compile_cache.ENV)
    assert compile_cache.resolve("auto") == os.path.expanduser(compile_cache.DEFAULT_DIR)


def test_off_and_explicit_folders(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "from_env"))
    assert compile_cache.resolve("") is None and compile_cache.resolve("off") is None
    assert compile_cache.resolve(str(tmp_path / "mine")) == str(tmp_path / "mine")  # key wins
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compile_cache.resolve("~/c") == str(tmp_path / "c")
