"""transformers' Qwen3 as the PyTorch reference for BAGEL's LM, with our weights copied in.

Qwen3 has BAGEL's layer structure (per-head QK-RMSNorm before rotate-half RoPE, SwiGLU, untied
lm_head); with `attention_bias=True` it also has q/k/v biases, plus an o_proj bias that BAGEL
lacks, which we zero. The copy goes torch -> ours, so our model must reproduce torch's numbers.
"""

import numpy as np
import torch
import transformers

from models.configs import Qwen2Config


def make_torch_qwen3(config: Qwen2Config, seed: int = 0) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(seed)
    hf_config = transformers.Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings,
        attention_bias=True,
        tie_word_embeddings=False,
        use_sliding_window=False,
        attn_implementation="eager",
    )
    model = transformers.Qwen3ForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.bias.zero_()
            # Random norms and biases, so a missing or misplaced one shows up in the logits.
            for norm in (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer.self_attn.q_norm,
                layer.self_attn.k_norm,
            ):
                norm.weight.uniform_(0.5, 1.5)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.1)
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def copy_into(lm, torch_model: transformers.Qwen3ForCausalLM, expert: str = "und") -> None:
    """Set `lm` (models.qwen2_mot.Qwen2MoT) weights of `expert` from the torch model."""
    config = lm.config
    d, h, kv, dh = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    layers = torch_model.model.layers

    def stack(fn):
        return np.stack([fn(layer) for layer in layers])

    target = getattr(lm.layers, expert)
    attn = lambda name: lambda layer: getattr(layer.self_attn, name)  # noqa: E731
    target.q_proj.kernel[...] = stack(lambda l: _np(l.self_attn.q_proj.weight).T.reshape(d, h, dh))
    target.q_proj.bias[...] = stack(lambda l: _np(l.self_attn.q_proj.bias).reshape(h, dh))
    target.k_proj.kernel[...] = stack(lambda l: _np(l.self_attn.k_proj.weight).T.reshape(d, kv, dh))
    target.k_proj.bias[...] = stack(lambda l: _np(l.self_attn.k_proj.bias).reshape(kv, dh))
    target.v_proj.kernel[...] = stack(lambda l: _np(l.self_attn.v_proj.weight).T.reshape(d, kv, dh))
    target.v_proj.bias[...] = stack(lambda l: _np(l.self_attn.v_proj.bias).reshape(kv, dh))
    target.o_proj.kernel[...] = stack(lambda l: _np(l.self_attn.o_proj.weight).T.reshape(h, dh, d))
    target.q_norm.scale[...] = stack(lambda l: _np(attn("q_norm")(l).weight))
    target.k_norm.scale[...] = stack(lambda l: _np(attn("k_norm")(l).weight))
    target.input_layernorm.scale[...] = stack(lambda l: _np(l.input_layernorm.weight))
    target.post_attention_layernorm.scale[...] = stack(
        lambda l: _np(l.post_attention_layernorm.weight)
    )
    target.gate_proj.kernel[...] = stack(lambda l: _np(l.mlp.gate_proj.weight).T)
    target.up_proj.kernel[...] = stack(lambda l: _np(l.mlp.up_proj.weight).T)
    target.down_proj.kernel[...] = stack(lambda l: _np(l.mlp.down_proj.weight).T)
    final_norm = lm.norm if expert == "und" else lm.norm_moe_gen
    final_norm.scale[...] = _np(torch_model.model.norm.weight)
    if expert == "und":
        lm.embed_tokens[...] = _np(torch_model.model.embed_tokens.weight)
        lm.lm_head[...] = _np(torch_model.lm_head.weight).T
    # Guard the layout itself: undoing our head-major reshape must give torch's weights back
    # (a transposed or tiled head order would otherwise only show up as a parity mismatch).
    last = layers[-1].self_attn
    q_back = np.asarray(target.q_proj.kernel[...])[-1].reshape(d, h * dh).T
    o_back = np.asarray(target.o_proj.kernel[...])[-1].reshape(h * dh, d).T
    assert np.array_equal(q_back, _np(last.q_proj.weight)), "q_proj layout"
    assert np.array_equal(o_back, _np(last.o_proj.weight)), "o_proj layout"


def torch_logits(torch_model, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = torch_model(
            input_ids=torch.from_numpy(tokens).long(),
            position_ids=torch.from_numpy(positions).long(),
        )
    return _np(out.logits)
