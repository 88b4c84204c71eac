"""The toy Qwen2 tokenizer and BAGEL's special-token rule (docs/bagel_layout.md §7)."""

import json
import pathlib
import subprocess
import sys

import pytest
import transformers
from conftest import subprocess_env

from opsd_jax.data.packing import SpecialTokens
from opsd_jax.io.tokenizer import BAGEL_SPECIAL_TOKENS, add_special_tokens, load_tokenizer
from opsd_jax.toy import model as toy_model
from scripts import make_toy_model


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer = toy_model.write_tokenizer(
        directory, toy_model.builtin_corpus(), vocab_size=1000, model_max_length=4096
    )
    return directory, tokenizer


def test_toy_tokenizer_loads_offline_as_qwen2_and_round_trips_text(toy_dir):
    directory, _ = toy_dir
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert type(hf_tokenizer).__name__ == "Qwen2Tokenizer"
    tokenizer = load_tokenizer(directory)
    assert tokenizer.num_added == 0
    for text in [
        "<think> How many red circles are left of the box? </think>",
        "<answer> 42 </answer><image_start> 3.14 <image_end>",
        "Ünïcödé, 日本語 & emoji 🙂 — tabs\tand\nnewlines  ",
        "",
    ]:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)  # as AutoTokenizer
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < tokenizer.vocab_length for i in ids)
    # Digits are split one by one (the Qwen2 pre-tokeniser), unseen bytes still encode.
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2025")] == ["2", "0", "2", "5"]
    assert tokenizer.vocab_length <= 1000 < 1024  # fits BagelConfig.tiny()'s embedding rows


def test_special_ids_follow_bagels_rule_and_convert_to_packer_tokens(toy_dir):
    directory, _ = toy_dir
    tokenizer = load_tokenizer(directory)
    hf_tokenizer = tokenizer.hf
    n = tokenizer.vocab_length
    # Qwen2.5 order after the BPE ids: <|endoftext|>, <|im_start|>, <|im_end|>, vision start/end.
    assert hf_tokenizer.convert_tokens_to_ids("<|endoftext|>") == n - 5
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (n - 4, n - 3)
    assert (tokenizer.start_of_image, tokenizer.end_of_image) == (n - 2, n - 1)
    assert tokenizer.special_tokens() == SpecialTokens(
        im_start=n - 4, im_end=n - 3, vision_start=n - 2, vision_end=n - 1
    )
    # encode adds no BOS/EOS; a marker in text is one id; decode keeps the markers.
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids) == "<|im_start|>hi<|im_end|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"
    assert hf_tokenizer.eos_token == "<|im_end|>"


def test_missing_markers_are_added_after_the_existing_ids(tmp_path):
    toy_model.write_tokenizer(
        tmp_path,
        ["a small corpus of words 123"],
        vocab_size=300,
        model_max_length=64,
        special_tokens=("<|endoftext|>", "<|im_start|>"),
    )
    tokenizer = load_tokenizer(tmp_path)
    n = tokenizer.vocab_length - 3
    assert tokenizer.num_added == 3
    assert tokenizer.bos_token_id == n - 1  # existing <|im_start|> keeps its id
    assert (tokenizer.eos_token_id, tokenizer.start_of_image, tokenizer.end_of_image) == (
        n,
        n + 1,
        n + 2,
    )
    assert tokenizer.encode("x<|vision_end|>")[-1] == tokenizer.end_of_image
    assert add_special_tokens(tokenizer.hf) == 0  # idempotent
    # A saved copy keeps the added tokens.
    tokenizer.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.num_added == 0 and again.special_tokens() == tokenizer.special_tokens()


def test_toy_tokenizer_is_deterministic_and_trains_on_a_given_corpus(toy_dir, tmp_path):
    directory, _ = toy_dir
    toy_model.write_tokenizer(
        tmp_path, toy_model.builtin_corpus(), vocab_size=1000, model_max_length=4096
    )
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (directory / name).read_bytes(), name
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert {v["content"] for v in config["added_tokens_decoder"].values()} >= set(
        BAGEL_SPECIAL_TOKENS.values()
    )

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("zyzzyva quokka\n" * 50)
    out = tmp_path / "model"
    make_toy_model.main(
        [
            "--out",
            str(out),
            "--corpus",
            str(corpus),
            "--dtype",
            "fp32",
            "--weights_name",
            "model",
            "--tokenizer_vocab_size",
            "400",
        ]
    )
    tokenizer = load_tokenizer(out)
    assert len(tokenizer.encode(" quokka")) == 1 and tokenizer.vocab_length <= 400
    assert (out / "model.safetensors").exists() and not (out / "ema.safetensors").exists()


def test_a_directory_without_tokenizer_files_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer files found"):
        load_tokenizer(tmp_path)


def test_importing_the_tokenizer_without_pytorch_prints_nothing():
    """transformers advises on import that PyTorch is missing; a JAX user need not hear it."""
    code = "import sys; sys.modules['torch'] = None; import opsd_jax.io.tokenizer"  # torch hidden
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in subprocess_env(1).items() if not k.startswith("TRANSFORMERS_")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result.stderr
