"""The Qwen2 tokenizer of a BAGEL / ThinkMorph directory, with BAGEL's special-token rule.

BAGEL frames every text segment as `<|im_start|> text <|im_end|>` and every image block as
`<|vision_start|> patches <|vision_end|>` (docs/bagel_layout.md §7). At load time it makes sure those
four tokens exist, adding any that are missing, and resizes the embeddings if it added some. The
shipped Qwen2.5 tokenizer already has all four, so nothing is added there; a smaller tokenizer
(the toy model's, a user's own) may lack some. This module adds them and reports how many it
added. Resizing the embedding table is the model loader's job (opsd_jax/io/hf_load.py), because only it
holds the table.

The ids come back under BAGEL's names (`bos_token_id` = `<|im_start|>`, not the config's
`<|endoftext|>`; `eos_token_id` = `<|im_end|>`; `start_of_image`; `end_of_image`). They convert to
the packer's `SpecialTokens`. `vocab_length` is the number of real ids. Embedding rows beyond it
are padding (Qwen2.5: 151665 real ids, 152064 rows) and must never be sampled.
"""

from __future__ import annotations

import os
from pathlib import Path

# transformers advises on import that PyTorch is missing ("Models won't be available"): true
# and irrelevant, since we only take its tokenizer. Advisory warnings only; a user's own
# setting wins.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
import transformers
from tokenizers import AddedToken

from opsd_jax.data.packing import SpecialTokens

# BAGEL's structural tokens, under the names its `add_special_tokens` returns them.
BAGEL_SPECIAL_TOKENS = {
    "bos_token_id": "<|im_start|>",
    "eos_token_id": "<|im_end|>",
    "start_of_image": "<|vision_start|>",
    "end_of_image": "<|vision_end|>",
}
# Either of these file sets is enough for transformers to build a Qwen2 BPE tokenizer.
_TOKENIZER_FILE_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"))


def add_special_tokens(hf_tokenizer) -> int:
    """Add whichever BAGEL structural tokens are missing (as special tokens); returns how many.

    New tokens take the ids from `len(hf_tokenizer)` up, in the order of BAGEL_SPECIAL_TOKENS.
    """
    vocab = hf_tokenizer.get_vocab()
    missing = [token for token in BAGEL_SPECIAL_TOKENS.values() if token not in vocab]
    if not missing:
        return 0
    # normalized=False: the marker must match literally, before NFC or byte-level mapping.
    return hf_tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


class BagelTokenizer:
    """A transformers Qwen2 tokenizer plus BAGEL's structural ids.

    `encode` adds no BOS/EOS (BAGEL frames segments itself); `decode` keeps special tokens by
    default, since the sampler needs them to split its output (docs/bagel_layout.md §7.1).
    """

    def __init__(self, hf_tokenizer, num_added: int = 0):
        self.hf = hf_tokenizer
        self.num_added = num_added
        ids = {
            name: hf_tokenizer.convert_tokens_to_ids(token)
            for name, token in BAGEL_SPECIAL_TOKENS.items()
        }
        absent = [BAGEL_SPECIAL_TOKENS[name] for name, i in ids.items() if i is None]
        if absent:
            raise ValueError(f"tokenizer lacks {absent}; load it with load_tokenizer()")
        self.bos_token_id: int = ids["bos_token_id"]
        self.eos_token_id: int = ids["eos_token_id"]
        self.start_of_image: int = ids["start_of_image"]
        self.end_of_image: int = ids["end_of_image"]

    @property
    def vocab_length(self) -> int:
        """Number of real ids (added tokens included); logits beyond it are padding rows."""
        return len(self.hf)

    def __len__(self) -> int:
        return self.vocab_length

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_tokens(self) -> SpecialTokens:
        """The ids the packer frames segments and images with."""
        return SpecialTokens(
            im_start=self.bos_token_id,
            im_end=self.eos_token_id,
            vision_start=self.start_of_image,
            vision_end=self.end_of_image,
        )

    def save(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer files (added tokens included) in HF format."""
        self.hf.save_pretrained(os.fspath(directory))


def load_tokenizer(model_dir: str | os.PathLike) -> BagelTokenizer:
    """Load the directory's Qwen2 tokenizer offline (no remote code) and apply BAGEL's rule."""
    model_dir = Path(model_dir)
    if not any(
        all((model_dir / name).exists() for name in names) for names in _TOKENIZER_FILE_SETS
    ):
        wanted = " or ".join(" + ".join(names) for names in _TOKENIZER_FILE_SETS)
        raise FileNotFoundError(f"{model_dir}: no tokenizer files found (need {wanted})")
    # Qwen2Tokenizer by name, as BAGEL loads it (not AutoTokenizer: whatever tokenizer_config
    # says, BAGEL models use this one; and AutoTokenizer's config machinery imports torch when
    # it is installed, seconds per launch that a JAX trainer has no use for).
    hf_tokenizer = transformers.Qwen2Tokenizer.from_pretrained(
        os.fspath(model_dir), local_files_only=True, trust_remote_code=False
    )
    num_added = add_special_tokens(hf_tokenizer)
    return BagelTokenizer(hf_tokenizer, num_added)
