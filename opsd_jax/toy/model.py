"""Write a tiny random BAGEL checkpoint directory in the exact HF layout of the 7B release.

Tests and CPU runs need a model directory that goes through the same loading path as
BAGEL-7B-MoT / ThinkMorph-7B without downloading 29 GB. This writes:

* `llm_config.json`, `vit_config.json` for `BagelConfig.tiny()`. As in the release, the ViT json
  says one layer more than is built and stored, and `from_hf_json` reads both back to
  exactly `BagelConfig.tiny()`;
* the weights under BAGEL's key names, gen expert and generation-only keys included, with
  the shapes the mapping table derives from the config (opsd_jax/io/hf_layout.py `hf_key_shapes`):
  bf16 `ema.safetensors` like BAGEL, or fp32 / `model.safetensors` / N shards plus an index
  json like a ThinkMorph or trainer checkpoint;
* a byte-level BPE tokenizer in Qwen2 format (normaliser, pre-tokeniser and decoder taken
  from transformers' Qwen2Tokenizer), trained on `--corpus` or a small built-in corpus. The
  Qwen2 special tokens come after the BPE ids, as in Qwen2.5, and the table has more rows
  than the tokenizer has ids, as in Qwen2.5 (152064 > 151665).

Everything is a function of the arguments and `--seed`, so the output is deterministic.

CLI: scripts/make_toy_model.py.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from models.bagel import sincos_2d_table
from models.configs import BagelConfig
from opsd_jax.io import hf_layout
from opsd_jax.io.safetensors_io import index_name, write_file
from opsd_jax.io.tokenizer import transformers  # quiet import (see there)

# Qwen2's special tokens that BAGEL uses, in Qwen2.5's id order, after the BPE ids.
QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
)
DTYPES = {"bf16": ("BF16", ml_dtypes.bfloat16), "fp32": ("F32", np.float32)}

_WORDS = (
    "the a an of to in on at by for with from into over under left right above below next "
    "is are was were be has have had do does did can will would should may might must "
    "red green blue yellow black white orange purple gray brown large small big tiny tall short "
    "circle square triangle cube sphere cylinder line point angle edge side corner center "
    "image picture figure chart table graph map grid row column cell box arrow label "
    "count number total sum difference product ratio half double area length width height "
    "question answer reason step first second third then next finally therefore because so "
    "look see find show draw mark zoom crop highlight compare measure check verify "
    "cat dog bird car tree house road river person ball cup book chair door window "
    "what which where when how why who many much more less most least same different"
).split()
_TAGS = ("<think>", "</think>", "<answer>", "</answer>", "<image_start>", "<image_end>")


def builtin_corpus() -> list[str]:
    """English words, digits, punctuation and ThinkMorph's plain-text tags, deterministically."""
    rng = np.random.default_rng(1234)
    lines = [
        " ".join(_WORDS),
        " ".join(_TAGS),
        "0 1 2 3 4 5 6 7 8 9 10 42 100 2025 3.14 -7 1/2",
        ". , ; : ! ? ' \" ( ) [ ] { } + - * / = < > % $ # @ & _ | ~",
    ]
    for _ in range(400):
        words = rng.choice(_WORDS, size=rng.integers(5, 14))
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        number = int(rng.integers(0, 1000))
        lines.append(
            f"<think> {sentence} </think><image_start> {number} <image_end>"
            f"<answer> {rng.choice(_WORDS)} {number} </answer>"
        )
    return lines


def train_tokenizer(lines: list[str], vocab_size: int, special_tokens=QWEN2_SPECIAL_TOKENS):
    """A Qwen2-format transformers tokenizer with at most `vocab_size` ids (specials included)."""
    qwen2 = transformers.Qwen2Tokenizer()  # only its pipeline: NFC, Qwen2 split, byte level
    backend = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    backend.normalizer = qwen2.backend_tokenizer.normalizer
    backend.pre_tokenizer = qwen2.backend_tokenizer.pre_tokenizer
    backend.decoder = qwen2.backend_tokenizer.decoder
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special_tokens),
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    backend.train_from_iterator(lines, trainer)
    bpe = json.loads(backend.to_str())["model"]
    vocab = dict(bpe["vocab"])
    for token in special_tokens:
        vocab[token] = len(vocab)
    tokenizer = transformers.Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(pair) for pair in bpe["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>" if "<|im_end|>" in vocab else None,
        pad_token="<|endoftext|>" if "<|endoftext|>" in vocab else None,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tokenizer, vocab, bpe["merges"]


def write_tokenizer(
    out_dir: Path,
    lines,
    vocab_size: int,
    model_max_length: int,
    special_tokens=QWEN2_SPECIAL_TOKENS,
) -> transformers.PreTrainedTokenizerBase:
    """tokenizer.json + tokenizer_config.json (transformers), vocab.json + merges.txt (slow)."""
    tokenizer, vocab, merges = train_tokenizer(lines, vocab_size, special_tokens)
    tokenizer.model_max_length = model_max_length
    tokenizer.save_pretrained(os.fspath(out_dir))
    # The slow-tokenizer files BAGEL's own Qwen2Tokenizer copy reads, plus the added-token
    # table it needs to know the specials (as in the Qwen2.5 release).
    bpe_vocab = {token: i for token, i in vocab.items() if token not in special_tokens}
    (out_dir / "vocab.json").write_text(json.dumps(bpe_vocab, ensure_ascii=False))
    (out_dir / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    )
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["added_tokens_decoder"] = {
        str(vocab[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in special_tokens
    }
    tokenizer_config.update(
        errors="replace", clean_up_tokenization_spaces=False, split_special_tokens=False
    )
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    return tokenizer


def llm_config_json(config: BagelConfig, bos_token_id, eos_token_id, dtype: str) -> dict:
    llm = config.llm
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": llm.vocab_size,
        "hidden_size": llm.hidden_size,
        "intermediate_size": llm.intermediate_size,
        "num_hidden_layers": llm.num_hidden_layers,
        "num_attention_heads": llm.num_attention_heads,
        "num_key_value_heads": llm.num_key_value_heads,
        "hidden_act": "silu",
        "rms_norm_eps": llm.rms_norm_eps,
        "rope_theta": llm.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": llm.max_position_embeddings,
        "max_window_layers": llm.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": llm.max_position_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
    }


def vit_config_json(config: BagelConfig) -> dict:
    vit = config.vit
    return {
        "architectures": ["SiglipVisionModel"],
        "model_type": "siglip_vision_model",
        "hidden_size": vit.hidden_size,
        "intermediate_size": vit.intermediate_size,
        "num_attention_heads": vit.num_attention_heads,
        # The release's json names one layer more than it stores; every loader drops it.
        "num_hidden_layers": vit.num_hidden_layers + 1,
        "patch_size": vit.patch_size,
        "image_size": vit.image_size,
        "num_channels": vit.num_channels,
        "hidden_act": vit.hidden_act,
        "layer_norm_eps": vit.layer_norm_eps,
        "attention_dropout": 0.0,
    }


def toy_tensors(config: BagelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random float32 values for every BAGEL key (sorted), shaped by the mapping table.

    Norm weights near 1 and non-zero biases, so a misplaced tensor changes the logits; the two
    sin-cos tables hold their real values, as in the release.
    """
    rng = np.random.default_rng(seed)
    tensors = {}
    for key, shape in sorted(hf_layout.hf_key_shapes(config).items()):
        if key == "vit_pos_embed.pos_embed":
            value = sincos_2d_table(config.vit_max_num_patch_per_side, config.llm.hidden_size)
        elif key == "latent_pos_embed.pos_embed":
            value = sincos_2d_table(config.max_latent_size, config.llm.hidden_size)
        elif "norm" in key and key.endswith(".weight"):
            value = rng.uniform(0.5, 1.5, shape)
        elif key.endswith(".bias"):
            value = rng.normal(0.0, 0.1, shape)
        else:
            value = rng.normal(0.0, 0.05, shape)
        tensors[key] = np.asarray(value, np.float32)
    return tensors


def write_weights(
    out_dir: Path, tensors: dict[str, np.ndarray], dtype: str, stem: str, num_shards: int
) -> list[str]:
    """One `<stem>.safetensors`, or `num_shards` files plus `<stem>.safetensors.index.json`."""
    st_dtype, np_dtype = DTYPES[dtype]
    keys = list(tensors)
    if not 1 <= num_shards <= len(keys):
        raise ValueError(f"num_shards must be in [1, {len(keys)}], got {num_shards}")
    groups = np.array_split(np.arange(len(keys)), num_shards)
    names = (
        [f"{stem}.safetensors"]
        if num_shards == 1
        else [f"{stem}-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    )
    weight_map = {}
    for name, group in zip(names, groups, strict=True):
        items = [
            (
                keys[i],
                st_dtype,
                tensors[keys[i]].shape,
                lambda key=keys[i]: tensors[key].astype(np_dtype),
            )
            for i in group
        ]
        write_file(out_dir / name, items, metadata={"format": "pt"})
        weight_map.update({keys[i]: name for i in group})
    if num_shards > 1:
        total = sum(math.prod(t.shape) * np.dtype(np_dtype).itemsize for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / index_name(stem)).write_text(json.dumps(index, indent=2) + "\n")
        names.append(index_name(stem))
    return names


def write_toy_model(
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bf16",
    num_shards: int = 1,
    weights_name: str = "ema",
    seed: int = 0,
    corpus: list[str] | None = None,
    tokenizer_vocab_size: int = 1000,
    special_tokens=QWEN2_SPECIAL_TOKENS,
    config: BagelConfig | None = None,
    weights: bool = True,
) -> Path:
    """Write the toy directory; returns its path. `config` defaults to BagelConfig.tiny().
    `weights=False` writes the configs and the tokenizer only (for `weights='random'` runs)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = config or BagelConfig.tiny()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if tokenizer_vocab_size > config.llm.vocab_size:
        raise ValueError(
            f"tokenizer_vocab_size={tokenizer_vocab_size} exceeds the model's "
            f"vocab_size={config.llm.vocab_size}"
        )
    tokenizer = write_tokenizer(
        out_dir,
        corpus or builtin_corpus(),
        tokenizer_vocab_size,
        config.llm.max_position_embeddings,
        special_tokens,
    )
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # Qwen2's config bos (BAGEL ignores)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (out_dir / hf_layout.LLM_CONFIG).write_text(
        json.dumps(llm_config_json(config, bos, eos, dtype), indent=2) + "\n"
    )
    (out_dir / hf_layout.VIT_CONFIG).write_text(
        json.dumps(vit_config_json(config), indent=2) + "\n"
    )
    if weights:
        write_weights(out_dir, toy_tensors(config, seed), dtype, weights_name, num_shards)
    return out_dir
