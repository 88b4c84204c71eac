"""Model config presets, the HF json reader and its loader overrides, and config validation."""

import json

import pytest
from flax import nnx

from models.configs import MOT_LAYER, BagelConfig
from models.qwen2_mot import Qwen2MoT

# Values of the released llm_config.json / vit_config.json as docs/bagel_layout.md §1 lists them,
# including the fields every upstream loader overrides in code.
LLM_JSON = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
}
VIT_JSON = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "patch_size": 14,
    "image_size": 980,
    "num_channels": 3,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "rope": True,
}


def write_configs(tmp_path, llm=LLM_JSON, vit=VIT_JSON):
    llm_path, vit_path = tmp_path / "llm_config.json", tmp_path / "vit_config.json"
    llm_path.write_text(json.dumps(llm))
    vit_path.write_text(json.dumps(vit))
    return llm_path, vit_path


def test_from_hf_json_applies_loader_overrides_and_matches_preset(tmp_path):
    config = BagelConfig.from_hf_json(*write_configs(tmp_path))
    assert config.llm.qk_norm is True
    assert config.llm.tie_word_embeddings is False  # json says True; loaders force False
    assert config.llm.layer_module == MOT_LAYER
    assert config.vit.num_hidden_layers == 26  # json 27 - 1
    assert config.vit.rope is False  # json says True; loaders force False
    assert config.llm.head_dim == 128 and config.llm.kv_group_size == 7
    assert config.vit.head_dim == 72 and config.vit.patch_dim == 588
    assert config == BagelConfig.bagel_7b()


def test_from_hf_json_errors_name_file_and_key(tmp_path):
    llm = dict(LLM_JSON)
    del llm["hidden_size"]
    with pytest.raises(KeyError, match=r"llm_config.json: missing required key 'hidden_size'"):
        BagelConfig.from_hf_json(*write_configs(tmp_path, llm=llm))
    # Keys whose defaults in BAGEL's own config classes are not the release's values: required.
    for name, key in [("llm", "num_key_value_heads"), ("llm", "rope_theta")] + [
        ("vit", "patch_size"),
        ("vit", "image_size"),
    ]:
        files = {"llm": dict(LLM_JSON), "vit": dict(VIT_JSON)}
        del files[name][key]
        with pytest.raises(KeyError, match=rf"{name}_config.json: missing required key '{key}'"):
            BagelConfig.from_hf_json(*write_configs(tmp_path, **files))
    with pytest.raises(ValueError, match="rope_scaling"):
        BagelConfig.from_hf_json(
            *write_configs(tmp_path, llm={**LLM_JSON, "rope_scaling": {"type": "yarn"}})
        )
    with pytest.raises(FileNotFoundError, match="nope.json"):
        BagelConfig.from_hf_json(tmp_path / "nope.json", tmp_path / "vit_config.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        BagelConfig.from_hf_json(tmp_path / "bad.json", tmp_path / "vit_config.json")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(llm=dict(num_key_value_heads=3)), "not divisible by num_key_value_heads"),
        (dict(llm=dict(compute_dtype="fp8")), r"compute_dtype='fp8'; allowed values"),
        (dict(llm=dict(attention_backend="flash")), "attention_backend='flash'"),
        (dict(llm=dict(remat="some")), "remat='some'"),
        (dict(llm=dict(tie_word_embeddings=True)), "untied"),
        (dict(llm=dict(hidden_size=0)), "hidden_size must be a positive integer"),
        (dict(vit=dict(rope=True)), "rope=True is not supported"),
        (dict(interpolate_pos=True), r"interpolate_pos=True; allowed values: False"),
        (
            dict(llm=dict(layer_module="Qwen2DecoderLayer", build_gen_expert=True)),
            "build_gen_expert",
        ),
    ],
)
def test_bad_model_configs_fail_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        BagelConfig.tiny(**changes)


def _param_count(config):
    abstract = nnx.eval_shape(lambda: Qwen2MoT(config, rngs=nnx.Rngs(0)))
    return sum(x.size for x in __import__("jax").tree.leaves(nnx.state(abstract)))


def test_7b_language_model_parameter_counts():
    base = BagelConfig.bagel_7b().llm
    und_only = _param_count(base)
    with_gen = _param_count(base.__class__(**{**base.__dict__, "build_gen_expert": True}))
    # Qwen2.5-7B with an untied lm_head has 7,615,616,512 parameters; BAGEL adds per-head QK-norm
    # weights (2 x 128 per layer).
    assert und_only == 7_615_616_512 + 28 * 2 * 128
    # The gen expert duplicates every per-layer weight and the final norm, not embed / lm_head.
    # (docs/bagel_layout.md §8.2's derived totals are 1,024 per layer per expert higher than its own key
    # list's shapes add up to; the shapes are what we build and load.)
    embed_and_head = 2 * 152064 * 3584
    assert with_gen - und_only == und_only - embed_and_head


def _leaf_keys(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaf_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_config_key_is_one_setting_and_is_read_by_the_code():
    """One key per setting (no two keys of configs/common.py share a name, as the two
    max_reference_rounds did) and no key that nothing reads: each name must be read somewhere
    in the code as an attribute (`config.name`, `data_config.name`), a `get("name")` / `["name"]`
    lookup, or the key argument of a call (`size("pack_row_tokens", ...)`); a name that is only
    listed (a validation table's `("name", check)`) does not count."""
    import collections
    import pathlib
    import re

    from configs import common

    keys = list(_leaf_keys(common.base_config().to_dict()))
    names = collections.Counter(key.split(".")[-1] for key in keys)
    assert not [n for n, count in names.items() if count > 1], names.most_common(3)
    root = pathlib.Path(__file__).resolve().parents[1]
    sources = [root / "train.py"] + [
        p
        for folder in ("opsd_jax", "models", "scripts", "bench")
        for p in (root / folder).rglob("*.py")
    ]
    code = "\n".join(p.read_text() for p in sources)
    unread = []
    for key in keys:
        name = re.escape(key.split(".")[-1])
        if not re.search(rf"\.{name}\b|\w\(\s*[\"']{name}[\"']|\[[\"']{name}[\"']\]", code):
            unread.append(key)
    assert not unread, f"config keys nothing reads: {unread}"


def test_the_offline_cache_follows_results_dir_unless_set(tmp_path):
    from configs import offline_tiny, smoke
    from opsd_jax import run_config

    config = offline_tiny.get_config()
    with config.unlocked():
        config.results_dir = str(tmp_path / "run_a")
    run_config.resolve_paths(config)
    assert config.offline_cache_dir == str(tmp_path / "run_a" / "teacher_cache")
    with config.unlocked():
        config.offline_cache_dir = str(tmp_path / "shared_cache")
    run_config.resolve_paths(config)
    assert config.offline_cache_dir == str(tmp_path / "shared_cache")  # a set value is kept
    opsd = smoke.get_config()
    run_config.resolve_paths(opsd)
    assert opsd.offline_cache_dir == ""  # an on-policy run has no cache
