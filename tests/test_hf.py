"""HF checkpoint directories <-> our params: round trips, numerics, sharding, errors, 7B keys.

The toy directories come from opsd_jax/toy/model.py (BAGEL's exact layout at tiny size).
The reference model in the numerics test is filled by hand from the official `safetensors`
reader, so it checks the mapping table against an independent spelling of the same layout.
"""

import json
import logging
import math
import os
import re
import shutil
import stat

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.torch import load_file

from models.bagel import Bagel, sincos_2d_table
from models.configs import BagelConfig
from opsd_jax.data.image_transform import patchify, vit_position_ids
from opsd_jax.data.packing import Image, Text, pack_samples
from opsd_jax.io import hf_export, hf_layout, hf_load
from opsd_jax.io.safetensors_io import WeightDirectory, index_name
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.toy import model as toy_model
from scripts import convert_hf

# fp32 compute and the dense reference attention without remat: the quickest compile on CPU.
FP32 = {"llm": {"compute_dtype": "float32", "attention_backend": "reference", "remat": "none"}}


@pytest.fixture(scope="module")
def toy_bf16(tmp_path_factory):
    """BAGEL-like: one bf16 ema.safetensors."""
    return toy_model.write_toy_model(tmp_path_factory.mktemp("toy") / "bf16")


@pytest.fixture(scope="module")
def toy_fp32_sharded(tmp_path_factory):
    """ThinkMorph / trainer-like: fp32 model.safetensors in 3 shards + index json."""
    return toy_model.write_toy_model(
        tmp_path_factory.mktemp("toy") / "fp32",
        dtype="fp32",
        num_shards=3,
        weights_name="model",
        seed=1,
    )


@pytest.fixture(scope="module")
def loaded_bf16(toy_bf16):
    return hf_load.load_hf(toy_bf16, config_changes=FP32)


def test_toy_configs_read_back_as_the_tiny_preset(toy_bf16):
    config = BagelConfig.from_hf_json(toy_bf16 / "llm_config.json", toy_bf16 / "vit_config.json")
    assert config == BagelConfig.tiny()
    assert json.loads((toy_bf16 / "vit_config.json").read_text())["num_hidden_layers"] == 3


@pytest.mark.parametrize(
    "toy, gen_expert, dtype",
    [
        ("toy_bf16", False, jnp.float32),
        ("toy_fp32_sharded", True, jnp.float32),
        ("toy_bf16", True, jnp.bfloat16),
    ],
)
def test_hf_to_ours_to_hf_is_bit_identical(toy, gen_expert, dtype, request, tmp_path):
    source = request.getfixturevalue(toy)
    model, config, _ = hf_load.load_hf(source, dtype=dtype, build_gen_expert=gen_expert)
    assert config.llm.build_gen_expert == gen_expert
    assert (model.language_model.layers.gen is not None) == gen_expert
    assert model.language_model.embed_tokens[...].dtype == dtype  # fp32 master copy by default
    out = hf_export.save_hf(model, tmp_path / "exported", source)

    before, after = WeightDirectory(source), WeightDirectory(out)
    assert after.keys() == before.keys() and len(before.keys()) == 111
    for key in before.keys():
        assert after.info(key).dtype == before.info(key).dtype, key
        assert after.info(key).shape == before.info(key).shape, key
        np.testing.assert_array_equal(after.raw(key), before.raw(key), err_msg=key)
        assert after.file_of[key].path.name == before.file_of[key].path.name
    if before.index is not None:
        written = json.loads((out / index_name(before.stem)).read_text())
        assert written["weight_map"] == before.index["weight_map"]
        assert written["metadata"]["total_size"] == sum(
            before.info(k).nbytes for k in before.keys()
        )
    others = sorted(p.name for p in source.iterdir() if not p.name.startswith(before.stem))
    assert others == sorted(p.name for p in out.iterdir() if not p.name.startswith(before.stem))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def _reference_model(config: BagelConfig, tensors: dict) -> Bagel:
    """Our model filled by hand from HF tensors (layouts as in tests/torch_qwen3.py).

    Built abstractly and filled leaf by leaf: an eager random init would only be overwritten.
    """
    model = nnx.eval_shape(lambda: Bagel(config, rngs=nnx.Rngs(7)))
    llm, vit = config.llm, config.vit
    d, h, kv, dh = llm.hidden_size, llm.num_attention_heads, llm.num_key_value_heads, llm.head_dim
    vd, vh, vdh = vit.hidden_size, vit.num_attention_heads, vit.head_dim

    def put(variable, value):
        assert variable.get_value().shape == value.shape
        variable.set_value(jnp.asarray(value))

    def stacked(template, count, fn=lambda w: w):
        return np.stack([fn(tensors[template.format(i)]) for i in range(count)])

    lm = model.language_model
    und, n = lm.layers.und, llm.num_hidden_layers
    p = "language_model.model.layers.{}."
    put(und.input_layernorm.scale, stacked(p + "input_layernorm.weight", n))
    put(und.post_attention_layernorm.scale, stacked(p + "post_attention_layernorm.weight", n))
    for name, heads in (("q", h), ("k", kv), ("v", kv)):
        proj = getattr(und, f"{name}_proj")
        put(
            proj.kernel,
            stacked(
                p + f"self_attn.{name}_proj.weight",
                n,
                lambda w, heads=heads: w.T.reshape(d, heads, dh),
            ),
        )
        put(
            proj.bias,
            stacked(
                p + f"self_attn.{name}_proj.bias", n, lambda b, heads=heads: b.reshape(heads, dh)
            ),
        )
    put(
        und.o_proj.kernel,
        stacked(p + "self_attn.o_proj.weight", n, lambda w: w.T.reshape(h, dh, d)),
    )
    put(und.q_norm.scale, stacked(p + "self_attn.q_norm.weight", n))
    put(und.k_norm.scale, stacked(p + "self_attn.k_norm.weight", n))
    for name in ("gate_proj", "up_proj", "down_proj"):
        put(getattr(und, name).kernel, stacked(p + f"mlp.{name}.weight", n, lambda w: w.T))
    put(lm.embed_tokens, tensors["language_model.model.embed_tokens.weight"])
    put(lm.norm.scale, tensors["language_model.model.norm.weight"])
    put(lm.lm_head, tensors["language_model.lm_head.weight"].T)

    enc, m = model.vit_model, vit.num_hidden_layers
    p = "vit_model.vision_model.encoder.layers.{}."
    for name in ("q_proj", "k_proj", "v_proj"):
        put(
            getattr(enc.layers, name).kernel,
            stacked(p + f"self_attn.{name}.weight", m, lambda w: w.T.reshape(vd, vh, vdh)),
        )
        put(
            getattr(enc.layers, name).bias,
            stacked(p + f"self_attn.{name}.bias", m, lambda b: b.reshape(vh, vdh)),
        )
    put(
        enc.layers.out_proj.kernel,
        stacked(p + "self_attn.out_proj.weight", m, lambda w: w.T.reshape(vh, vdh, vd)),
    )
    put(enc.layers.out_proj.bias, stacked(p + "self_attn.out_proj.bias", m))
    for name in ("layer_norm1", "layer_norm2"):
        put(getattr(enc.layers, name).scale, stacked(p + f"{name}.weight", m))
        put(getattr(enc.layers, name).bias, stacked(p + f"{name}.bias", m))
    for name in ("fc1", "fc2"):
        put(getattr(enc.layers, name).kernel, stacked(p + f"mlp.{name}.weight", m, lambda w: w.T))
        put(getattr(enc.layers, name).bias, stacked(p + f"mlp.{name}.bias", m))
    p = "vit_model.vision_model."
    put(enc.patch_embedding.kernel, tensors[p + "embeddings.patch_embedding.weight"].T)
    put(enc.patch_embedding.bias, tensors[p + "embeddings.patch_embedding.bias"])
    put(enc.position_embedding, tensors[p + "embeddings.position_embedding.weight"])
    put(enc.post_layernorm.scale, tensors[p + "post_layernorm.weight"])
    put(enc.post_layernorm.bias, tensors[p + "post_layernorm.bias"])
    for name in ("fc1", "fc2"):
        put(getattr(model.connector, name).kernel, tensors[f"connector.{name}.weight"].T)
        put(getattr(model.connector, name).bias, tensors[f"connector.{name}.bias"])
    put(model.vit_pos_embed, tensors["vit_pos_embed.pos_embed"])
    unset = [
        p for p, v in hf_export.flat_params(model).items() if isinstance(v, jax.ShapeDtypeStruct)
    ]
    assert not unset, unset
    return model


@jax.jit
def _logits(graphdef, state, pack):
    model = nnx.merge(graphdef, state)
    return model.logits_at(model(pack), pack.loss_rows)


def _logits_of(model, pack):
    return np.asarray(_logits(*nnx.split(model), jax.tree.map(jnp.asarray, pack)))


def test_converted_model_logits_equal_a_model_built_from_the_same_arrays(toy_bf16, loaded_bf16):
    model, config, tokenizer = loaded_bf16
    tensors = {k: v.float().numpy() for k, v in load_file(toy_bf16 / "ema.safetensors").items()}
    reference = _reference_model(config, tensors)

    rng = np.random.default_rng(0)
    pixels = rng.uniform(-1, 1, (14 * 2, 14 * 3, 3)).astype(np.float32)
    sample = [
        Image(patchify(pixels), vit_position_ids(2, 3)),
        Text(tokenizer.encode("How many red circles?")),
        Text(tokenizer.encode("<think> count </think><answer> 3 </answer>"), loss=True),
    ]
    pack = pack_samples([sample], row_length=48, special=tokenizer.special_tokens())
    logits = _logits_of(model, pack)
    assert logits.shape[-1] == config.llm.vocab_size and np.isfinite(logits).all()
    np.testing.assert_array_equal(logits, _logits_of(reference, pack))


def test_loading_under_an_8_device_mesh_gives_sharded_params(toy_fp32_sharded, loaded_bf16):
    mesh = mesh_lib.make_mesh(num_replicate=2)  # data 2 x fsdp 4
    model, config, _ = hf_load.load_hf(toy_fp32_sharded, mesh=mesh, build_gen_expert=True)
    _, abstract = mesh_lib.abstract_model(lambda: Bagel(config, rngs=nnx.Rngs(0)), mesh)
    targets = hf_export.flat_params(abstract)
    params = hf_export.flat_params(model)
    assert params.keys() == targets.keys()
    for path, value in params.items():
        assert value.sharding == targets[path].sharding, path
        assert len(value.addressable_shards) == 8
    q = params["language_model.layers.gen.q_proj.kernel"]  # [layers, embed, heads, head_dim]
    assert q.sharding.shard_shape(q.shape) == (2, 64 // 4, 4, 16)
    embed = params["language_model.embed_tokens"]
    assert embed.sharding.shard_shape(embed.shape) == (1024, 64 // 4)
    # Same values as a single-device load of the same directory.
    single, _, _ = hf_load.load_hf(toy_fp32_sharded, build_gen_expert=True)
    for path, value in hf_export.flat_params(single).items():
        np.testing.assert_array_equal(np.asarray(params[path]), np.asarray(value), err_msg=path)


def test_read_params_false_leaves_the_params_abstract_and_reads_the_fixed_table(
    toy_fp32_sharded,
):
    """What a resumed run loads: the params stay ShapeDtypeStructs in their target shardings
    (no memory, the checkpoint restores them); the non-trained table is read as usual."""
    mesh = mesh_lib.make_mesh(num_replicate=2)
    model, _, _ = hf_load.load_hf(toy_fp32_sharded, mesh=mesh, read_params=False)
    params, rest = nnx.split_state(nnx.state(model), nnx.Param, ...)
    full, _, _ = hf_load.load_hf(toy_fp32_sharded, mesh=mesh)
    full_params, full_rest = nnx.split_state(nnx.state(full), nnx.Param, ...)
    for value, loaded in zip(jax.tree.leaves(params), jax.tree.leaves(full_params)):
        assert isinstance(value, jax.ShapeDtypeStruct) and value.shape == loaded.shape
        assert value.sharding == loaded.sharding and value.dtype == loaded.dtype
    for value, loaded in zip(jax.tree.leaves(rest), jax.tree.leaves(full_rest)):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(loaded))
    assert jax.tree.leaves(rest)


def _break(directory, kind):
    """Damage a copy of a toy directory in one way; returns the expected error text."""
    weights = directory / "ema.safetensors"
    if kind == "missing config":
        (directory / "vit_config.json").unlink()
        return "missing model config file.*vit_config.json"
    if kind == "corrupt safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return "ema.safetensors: not a valid safetensors file.*truncated"
    if kind == "garbage header":
        data = bytearray(weights.read_bytes())
        data[8:16] = b"\xff" * 8
        weights.write_bytes(bytes(data))
        return "not a valid safetensors file: the header is not JSON"
    tensors = {k: v.float().numpy() for k, v in load_file(weights).items()}
    if kind in ("missing key", "all at once"):
        del tensors["language_model.model.layers.1.mlp.up_proj.weight"]
    if kind in ("unexpected key", "all at once"):
        tensors["language_model.model.layers.1.mlp.extra_proj.weight"] = np.zeros((2, 2))
    if kind in ("wrong shape", "all at once"):
        tensors["connector.fc1.weight"] = np.zeros((64, 31))
    toy_model.write_weights(directory, tensors, "bf16", "ema", 1)
    return {
        "missing key": r"missing keys \(1\):\n.*layers\.1\.mlp\.up_proj\.weight "
        r"expected \[128, 64\]",
        "unexpected key": r"unexpected keys \(1\):\n.*mlp\.extra_proj\.weight \[2, 2\]",
        "wrong shape": r"wrong shapes \(1\):\n.*connector\.fc1\.weight is \[64, 31\], "
        r"expected \[64, 32\]",
        "all at once": r"(?s)missing keys \(1\).*up_proj.*unexpected keys \(1\).*extra_proj"
        r".*wrong shapes \(1\).*connector\.fc1",
    }[kind]


@pytest.mark.parametrize(
    "kind",
    [
        "missing key",
        "unexpected key",
        "wrong shape",
        "all at once",
        "missing config",
        "corrupt safetensors",
        "garbage header",
    ],
)
def test_broken_checkpoints_raise_one_clear_error_and_write_nothing(kind, toy_bf16, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(toy_bf16, broken)
    message = _break(broken, kind)
    with pytest.raises(hf_layout.HFCheckpointError, match=message):
        hf_load.load_hf(broken, tokenizer=False)
    out = tmp_path / "converted"
    with pytest.raises(SystemExit) as exited:  # the script: the same message as one line
        convert_hf.main(["hf-to-jax", "--hf_dir", str(broken), "--out", str(out)])
    assert str(exited.value.code).startswith("error: ")
    assert re.search(message, str(exited.value.code)), exited.value.code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_export_against_a_mismatched_source_writes_nothing(loaded_bf16, toy_bf16, tmp_path):
    model = loaded_bf16[0]
    source = tmp_path / "source"
    shutil.copytree(toy_bf16, source)
    _break(source, "wrong shape")
    with pytest.raises(
        hf_layout.HFCheckpointError, match=r"connector\.fc1\.weight: ours gives \[64, 32\]"
    ):
        hf_export.save_hf(model, tmp_path / "out", source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
    with pytest.raises(FileExistsError):
        hf_export.save_hf(model, source, toy_bf16)


def test_export_into_shards_of_any_name_keeps_our_params(toy_fp32_sharded, tmp_path):
    """An index may name its shards anything; the export writes ours into them, and the copy of
    the source directory's other files must not put the source's shards back over them."""
    source = tmp_path / "odd_names"
    shutil.copytree(toy_fp32_sharded, source)
    index_path = source / index_name("model")
    index = json.loads(index_path.read_text())
    renamed = {
        name: f"part_{i}.safetensors"
        for i, name in enumerate(sorted(set(index["weight_map"].values())))
    }
    for old, new in renamed.items():
        (source / old).rename(source / new)
    index["weight_map"] = {key: renamed[name] for key, name in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    model, _, _ = hf_load.load_hf(source, tokenizer=False)
    model.language_model.embed_tokens[...] += 1.0  # "trained"

    out = hf_export.save_hf(model, tmp_path / "out", source)
    key = "language_model.model.embed_tokens.weight"
    exported = WeightDirectory(out)
    assert exported.file_of[key].path.name in renamed.values()
    np.testing.assert_array_equal(
        exported.array(key), np.asarray(model.language_model.embed_tokens[...])
    )
    assert not np.array_equal(exported.array(key), WeightDirectory(source).array(key))


def test_export_against_a_source_with_fewer_layers_is_refused(loaded_bf16, tmp_path):
    """Against a shallower source the export would write only the source's layers of ours."""
    shallow = toy_model.write_toy_model(
        tmp_path / "shallow", config=BagelConfig.tiny(llm=dict(num_hidden_layers=1))
    )
    with pytest.raises(
        hf_layout.HFCheckpointError,
        match=r"stacked parameters: we hold 2 layers, the source has keys for 1",
    ):
        hf_export.save_hf(loaded_bf16[0], tmp_path / "out", shallow)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shallow"]


def test_a_checkpoint_without_the_fixed_table_gets_the_computed_one(toy_bf16, tmp_path):
    source = tmp_path / "no_table"
    shutil.copytree(toy_bf16, source)
    tensors = {k: v.float().numpy() for k, v in load_file(source / "ema.safetensors").items()}
    del tensors["vit_pos_embed.pos_embed"]  # upstream's training loader drops it
    toy_model.write_weights(source, tensors, "bf16", "ema", 1)
    model, config, _ = hf_load.load_hf(source, tokenizer=False)
    np.testing.assert_array_equal(np.asarray(model.vit_pos_embed[...]), sincos_2d_table(70, 64))
    out = hf_export.save_hf(
        model, tmp_path / "out", source
    )  # exported without the key, like the source
    assert "vit_pos_embed.pos_embed" not in WeightDirectory(out).keys()


def test_convert_script_round_trip(toy_fp32_sharded, tmp_path, capsys):
    ckpt, back = tmp_path / "jax", tmp_path / "back"
    convert_hf.main(["hf-to-jax", "--hf_dir", str(toy_fp32_sharded), "--out", str(ckpt)])
    convert_hf.main(
        ["jax-to-hf", "--ckpt", str(ckpt), "--source", str(toy_fp32_sharded), "--out", str(back)]
    )
    printed = capsys.readouterr().out
    # 72 trained parameters; the fixed ViT position table is not one, so it is copied like the
    # generation-only keys.
    assert "111 tensors (72 from our params, 39 copied" in printed
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(back.stat().st_mode) == 0o777 & ~umask  # as mkdir makes it, not 0700
    before, after = WeightDirectory(toy_fp32_sharded), WeightDirectory(back)
    assert len(after.files) == 3
    for key in before.keys():
        np.testing.assert_array_equal(after.raw(key), before.raw(key), err_msg=key)


def test_added_special_tokens_grow_the_table_and_export_keeps_it(tmp_path):
    # A 300-row model whose tokenizer fills all 300 ids and lacks the two vision markers.
    config = BagelConfig.tiny(llm=dict(vocab_size=300))
    source = toy_model.write_toy_model(
        tmp_path / "small",
        config=config,
        tokenizer_vocab_size=300,
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    )
    model, grown, tokenizer = hf_load.load_hf(source)
    assert tokenizer.num_added == 2 and tokenizer.vocab_length == 302
    assert (tokenizer.start_of_image, tokenizer.end_of_image) == (300, 301)
    assert grown.llm.vocab_size == 384  # rounded up to a multiple of 128
    embed = np.asarray(model.language_model.embed_tokens[...])
    stored = WeightDirectory(source).array("language_model.model.embed_tokens.weight")
    np.testing.assert_array_equal(embed[:300], stored.astype(np.float32))
    np.testing.assert_allclose(
        embed[300:], np.broadcast_to(embed[:300].mean(0), (84, 64)), atol=1e-6
    )
    assert np.asarray(model.language_model.lm_head[...]).shape == (64, 384)

    out = hf_export.save_hf(model, tmp_path / "out", source)
    assert json.loads((out / "llm_config.json").read_text())["vocab_size"] == 384
    after = WeightDirectory(out)
    assert after.info("language_model.lm_head.weight").shape == (384, 64)
    reloaded, config, _ = hf_load.load_hf(out)
    assert config.llm.vocab_size == 384
    np.testing.assert_array_equal(
        np.asarray(reloaded.language_model.embed_tokens[...]),
        embed.astype(jnp.bfloat16).astype(np.float32),
    )


def _spec_7b_keys() -> dict[str, tuple[int, ...]]:
    """docs/bagel_layout.md §8.2, written out independently of opsd_jax/io/hf_layout.py's table."""
    d, kv, f, vocab, head = 3584, 512, 18944, 152064, 128
    vd, vf = 1152, 4304
    keys = {}
    for i in range(28):
        p = f"language_model.model.layers.{i}."
        for gen in ("", "_moe_gen"):
            keys[f"{p}input_layernorm{gen}.weight"] = (d,)
            keys[f"{p}post_attention_layernorm{gen}.weight"] = (d,)
            for name, out in (("q", d), ("k", kv), ("v", kv)):
                keys[f"{p}self_attn.{name}_proj{gen}.weight"] = (out, d)
                keys[f"{p}self_attn.{name}_proj{gen}.bias"] = (out,)
            keys[f"{p}self_attn.o_proj{gen}.weight"] = (d, d)
            keys[f"{p}self_attn.q_norm{gen}.weight"] = (head,)
            keys[f"{p}self_attn.k_norm{gen}.weight"] = (head,)
            keys[f"{p}mlp{gen}.gate_proj.weight"] = (f, d)
            keys[f"{p}mlp{gen}.up_proj.weight"] = (f, d)
            keys[f"{p}mlp{gen}.down_proj.weight"] = (d, f)
    keys["language_model.model.embed_tokens.weight"] = (vocab, d)
    keys["language_model.model.norm.weight"] = (d,)
    keys["language_model.model.norm_moe_gen.weight"] = (d,)
    keys["language_model.lm_head.weight"] = (vocab, d)
    for j in range(26):
        p = f"vit_model.vision_model.encoder.layers.{j}."
        for norm in ("layer_norm1", "layer_norm2"):
            keys[f"{p}{norm}.weight"] = keys[f"{p}{norm}.bias"] = (vd,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            keys[f"{p}self_attn.{proj}.weight"] = (vd, vd)
            keys[f"{p}self_attn.{proj}.bias"] = (vd,)
        keys[f"{p}mlp.fc1.weight"], keys[f"{p}mlp.fc1.bias"] = (vf, vd), (vf,)
        keys[f"{p}mlp.fc2.weight"], keys[f"{p}mlp.fc2.bias"] = (vd, vf), (vd,)
    p = "vit_model.vision_model."
    keys[p + "embeddings.patch_embedding.weight"] = (vd, 588)
    keys[p + "embeddings.patch_embedding.bias"] = (vd,)
    keys[p + "embeddings.position_embedding.weight"] = (4900, vd)
    keys[p + "post_layernorm.weight"] = keys[p + "post_layernorm.bias"] = (vd,)
    keys["connector.fc1.weight"], keys["connector.fc1.bias"] = (d, vd), (d,)
    keys["connector.fc2.weight"], keys["connector.fc2.bias"] = (d, d), (d,)
    keys["vit_pos_embed.pos_embed"] = (4900, d)
    keys["latent_pos_embed.pos_embed"] = (4096, d)
    keys["vae2llm.weight"], keys["vae2llm.bias"] = (d, 64), (d,)
    keys["llm2vae.weight"], keys["llm2vae.bias"] = (64, d), (64,)
    keys["time_embedder.mlp.0.weight"], keys["time_embedder.mlp.0.bias"] = (d, 256), (d,)
    keys["time_embedder.mlp.2.weight"], keys["time_embedder.mlp.2.bias"] = (d, d), (d,)
    return keys


def test_mapping_table_reproduces_the_7b_key_list():
    spec = _spec_7b_keys()
    assert len(spec) == 1223
    # docs/bagel_layout.md §8.1 quotes 14,607,317,472 = this + 57,344: its LM subtotals carry 1024
    # extra values per expert layer that its own key list does not have. The key list wins.
    assert sum(math.prod(s) for s in spec.values()) == 14_607_260_128
    derived = hf_layout.hf_key_shapes(BagelConfig.bagel_7b())
    assert sorted(derived) == sorted(spec)
    assert {k: v for k, v in derived.items() if spec[k] != v} == {}

    # The loader accepts exactly that header; und-only skips the gen expert and gen-only keys.
    header = {key: (shape, "BF16") for key, shape in spec.items()}
    for gen_expert, loaded, skipped in ((True, 1223 - 9, 9), (False, 1223 - 393 - 9, 393 + 9)):
        config = BagelConfig.bagel_7b(llm=dict(build_gen_expert=gen_expert))
        targets = {path: s.shape for path, s in hf_layout.abstract_params(config).items()}
        plan = hf_load.plan_load(header, targets, config)
        assert sum(len(layers) for layers in plan.sources.values()) == loaded
        assert len(plan.skipped) == skipped and plan.defaulted == ()
    # A 27-layer ViT (the json count) would be caught: its last layer is unexpected.
    header["vit_model.vision_model.encoder.layers.26.mlp.fc2.bias"] = ((1152,), "BF16")
    with pytest.raises(hf_layout.HFCheckpointError, match=r"layers\.26\.mlp\.fc2\.bias \(layer 26"):
        hf_load.plan_load(header, targets, config)


def test_export_from_a_training_checkpoint(loaded_bf16, toy_bf16, tmp_path, caplog):
    from opsd_jax.io.checkpoint import Checkpointer
    from opsd_jax.training.train_step import TrainState

    # The trainer's own checkpoint: a step directory under <dir>/<step>/ with the teacher copy.
    params = nnx.state(loaded_bf16[0], nnx.Param)
    state = TrainState(
        step=jnp.int32(7),
        params=params,
        opt_state={"count": jnp.int32(7)},
        teacher_params=params,
        rng=None,
        bad_steps=jnp.int32(0),
    )
    with Checkpointer(tmp_path / "checkpoints", save_every=1, async_save=False) as checkpointer:
        checkpointer.save(7, state, data_state=None, config={"teacher_mode": "ema"})
    mesh = mesh_lib.make_mesh()
    with caplog.at_level(logging.INFO):
        params = hf_export.restore_for_export(
            tmp_path / "checkpoints", toy_bf16, mesh, which="ema_params"
        )
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    embed = params["language_model.embed_tokens"]
    assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    out = hf_export.save_hf(params, tmp_path / "exported", toy_bf16)
    assert (out / "ema.safetensors").read_bytes() == (toy_bf16 / "ema.safetensors").read_bytes()


@pytest.fixture
def no_conversion_load(monkeypatch):
    """Every load of scripts/convert_hf.py fails: a check that must come first is reached."""

    lora = [
        (convert_hf.lora_export, name)
        for name in ("lora_checkpoint", "restore_merged", "save_adapters")
    ]
    builders.refuse_loads(
        monkeypatch,
        "--out / --item",
        (hf_load, "load_hf"),
        (hf_export, "restore_for_export"),
        *lora,
    )


def test_convert_script_refuses_an_existing_out_before_any_load(tmp_path, no_conversion_load):
    """hf-to-jax found an existing params/ only after the whole HF load (orbax's traceback);
    jax-to-hf refused an existing --out only after restoring the params, naming the Python
    keyword `overwrite=True` instead of the script's --overwrite."""
    (tmp_path / "jax" / "params").mkdir(parents=True)
    (tmp_path / "hf_out").mkdir()
    source = str(tmp_path / "source")
    with pytest.raises(SystemExit, match=r"^error: --out .*jax already holds params/: remove it"):
        convert_hf.main(["hf-to-jax", "--hf_dir", source, "--out", str(tmp_path / "jax")])
    to_hf = ["jax-to-hf", "--ckpt", str(tmp_path / "jax"), "--source", source]
    with pytest.raises(SystemExit, match=r"^error: --out .*hf_out exists: pass --overwrite to"):
        convert_hf.main([*to_hf, "--out", str(tmp_path / "hf_out")])
    with pytest.raises(SystemExit, match="--adapters_only writes a new directory; remove it"):
        convert_hf.main([*to_hf, "--out", str(tmp_path / "hf_out"), "--adapters_only"])
    with pytest.raises(AssertionError, match="loaded before"):  # --overwrite: on to the load
        convert_hf.main([*to_hf, "--out", str(tmp_path / "hf_out"), "--overwrite"])
    (tmp_path / "source").mkdir()
    with pytest.raises(SystemExit, match="--out .*source is the --source directory"):
        convert_hf.main([*to_hf, "--out", source, "--overwrite"])


def test_convert_script_item_is_params_or_ema_params(tmp_path, no_conversion_load, capsys):
    """A wrong --item ended in saved_items' traceback after the LoRA check read the checkpoint."""
    to_hf = ["jax-to-hf", "--ckpt", str(tmp_path), "--source", str(tmp_path), "--out"]
    with pytest.raises(SystemExit) as stopped:
        convert_hf.main([*to_hf, str(tmp_path / "hf"), "--item", "ema"])
    assert stopped.value.code == 2
    assert "argument --item: invalid choice: 'ema'" in capsys.readouterr().err
