"""BAGEL's language model: Qwen2 with per-head QK-norm and Mixture-of-Transformers experts.

Exactly docs/bagel_layout.md §2-3:

* q/k/v projections with bias, o_proj and the SwiGLU MLP without;
* RMSNorm over each head's features on q and k (one weight shared by all heads), *before* RoPE;
* rotate-half RoPE from explicit position ids (an image block shares one id), cos/sin computed
  in fp32 and cast to the activation dtype as upstream does;
* GQA: query head h reads kv head h // group (repeat-interleave);
* RMSNorm statistics in fp32, cast back to the input dtype *before* the weight multiplies;
* untied lm_head, final norm.

MoT: each layer holds the und expert and, when `build_gen_expert`, a gen expert with the same
shapes (BAGEL's `*_moe_gen` weights). A token with `gen_mask=True` goes through the gen
expert's layer norms, q/k/v/o projections, q/k norms and MLP, and through `norm_moe_gen` at the
end; attention itself is shared by all tokens. Routing is decided by static facts first: a
`gen_mask` of None (the packer's for every understanding pack: OPSD, SFT, sampler prompts) runs
the und expert alone, so a model built with the gen expert does exactly an und-only model's
work. With a gen_mask, each row's gen tokens are gathered into `gen_token_capacity` slots (a
static size; 0 = the whole row), the gen expert runs on those slots only and its outputs are
scattered back over the und expert's (which runs on every token: the und tokens are not
gathered, as they are most of a row). A row with more gen tokens than the capacity fails the
forward with an error naming the capacity, never silently drops tokens.

The sampler's decode copy fuses each expert's q/k/v and gate/up projections into one each
(`fuse_projections`, opsd_jax/sampling/decode_copy.py): the same weights laid out per tensor
shard, so a decode step runs 4 GEMMs a layer instead of 7. Checkpoints and training keep them
separate, as BAGEL does.

Layers are stacked on a leading 'layers' axis and run with `nnx.scan`, each under a
`jax.checkpoint` policy chosen by `Qwen2Config.remat`. Every parameter carries logical axis names
(`out_sharding` metadata); opsd_jax/parallel/mesh.py maps them to mesh axes. Parameters are created
unsharded (`eager_sharding=False`) so the model can be built anywhere; placement on a mesh is
the job of a jitted init with out_shardings.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention as attention_lib
from models.configs import Qwen2Config
from models.layers import (
    Projection,
    RMSNorm,
    compute_weight,
    normal_param,
    param,
    scan_layers,
    stack_layers,
)
from models.sharding import ROWS_EMBED, ROWS_HEADS, ROWS_KV_HEADS, ROWS_MLP, constrain, vocab_names


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, H, Dh]; positions: [B, T] integer ids."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # broadcast over heads
    # Upstream computes cos/sin in fp32 and casts them to the activation dtype before use.
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = head_dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Expert(nnx.Module):
    """One MoT expert's per-token weights for a decoder layer (BAGEL's und or `*_moe_gen` set)."""

    def __init__(self, config: Qwen2Config, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        h, kv, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.q_proj = Projection(
            rngs,
            "btd,dhk->bthk",
            (d, h, dh),
            ("embed", "q_heads", "head_dim"),
            (h, dh),
            ("q_heads", "head_dim"),
        )
        self.k_proj = Projection(
            rngs,
            "btd,dhk->bthk",
            (d, kv, dh),
            ("embed", "kv_heads", "head_dim"),
            (kv, dh),
            ("kv_heads", "head_dim"),
        )
        self.v_proj = Projection(
            rngs,
            "btd,dhk->bthk",
            (d, kv, dh),
            ("embed", "kv_heads", "head_dim"),
            (kv, dh),
            ("kv_heads", "head_dim"),
        )
        self.o_proj = Projection(
            rngs, "bthk,hkd->btd", (h, dh, d), ("q_heads", "head_dim", "embed")
        )
        self.q_norm = RMSNorm(dh, eps, names=("head_dim",)) if config.qk_norm else None
        self.k_norm = RMSNorm(dh, eps, names=("head_dim",)) if config.qk_norm else None
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.gate_proj = Projection(rngs, "btd,df->btf", (d, f), ("embed", "mlp"))
        self.up_proj = Projection(rngs, "btd,df->btf", (d, f), ("embed", "mlp"))
        self.down_proj = Projection(rngs, "btf,fd->btd", (f, d), ("mlp", "embed"))
        # 0: q/k/v and gate/up are separate projections (checkpoints, training); t > 0: one
        # each, their weights laid out in t shards (`fuse_projections`, the decode copy).
        self.fused_shards = 0

    def _fused_sizes(self) -> tuple[int, int, int]:
        """(query heads, kv heads, MLP columns): what the fused layouts split into shards."""
        return (
            self.q_proj.kernel.shape[-2],
            self.k_proj.kernel.shape[-2],
            self.gate_proj.kernel.shape[-1],
        )

    def can_fuse(self, shards: int) -> bool:
        """Whether `shards` divides the heads and MLP columns (`fuse_projections` needs it)."""
        return all(n % shards == 0 for n in self._fused_sizes())

    def fuse_projections(self, shards: int) -> None:
        """Replace q/k/v with one projection and gate/up with another, built from their weights
        (stacked layers or one). Why: a decode step feeds one token per row, so each projection
        is a small GEMM kernel of its own; fused, a layer runs 3 fewer (on an H100: 3 of the 21
        kernels a layer a token, bench/scale.py). The output axis is laid out in `shards`
        groups, each holding its own heads / MLP columns side by side:
        qkv [D, t, Hq/t + 2 Hkv/t, Dh], gate/up [D, t, 2, F/t]; with t the decode layout's
        tensor axis ('q_heads' / 'mlp' names on the t axis), every device's shard holds exactly
        the heads and columns the separate projections gave it, so splitting q, k and v (or
        gate and up) again is local. Head h of q is (h // (Hq/t), h % (Hq/t)), as the
        separate projection's heads split over t devices."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        heads, kv_heads, width = self._fused_sizes()
        if not self.can_fuse(shards):
            raise ValueError(
                f"fuse_projections: {shards} shards do not divide {heads} / {kv_heads} heads "
                f"and {width} MLP columns"
            )
        stacked = q.kernel.get_metadata()["out_sharding"][:-3]  # ('layers',) for a stack

        def grouped(x, count):  # [..., count, Dh] -> [..., t, count / t, Dh]
            return x.reshape(*x.shape[:-2], shards, count // shards, x.shape[-1])

        def fused(params, counts, axis_names):
            values = [grouped(p[...], n) for p, n in zip(params, counts)]
            return param(jnp.concatenate(values, axis=-2), stacked + axis_names)

        counts = (heads, kv_heads, kv_heads)
        names = ("embed", "q_heads", None, "head_dim")
        self.qkv_proj = Projection(
            None,
            "btd,dsjk->btsjk",
            (),
            names,
            kernel=fused([q.kernel, k.kernel, v.kernel], counts, names),
            bias=None
            if q.bias is None
            else fused([q.bias, k.bias, v.bias], counts, ("q_heads", None, "head_dim")),
        )
        gate, up = (p.kernel[...] for p in (self.gate_proj, self.up_proj))
        columns = lambda x: x.reshape(*x.shape[:-1], shards, 1, width // shards)  # noqa: E731
        names = ("embed", "mlp", None, None)
        self.gate_up_proj = Projection(
            None,
            "btd,dsjf->btsjf",
            (),
            names,
            kernel=param(jnp.concatenate([columns(gate), columns(up)], axis=-2), stacked + names),
        )
        self.query_heads, self.kv_heads = heads, kv_heads
        del self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj
        self.fused_shards = shards

    def qkv(self, x: jax.Array, bias_apart: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Projections of the input-normed x, with QK-norm applied (RoPE comes after);
        `bias_apart`: Projection's (the decode step's)."""
        if self.fused_shards:
            y = self.qkv_proj(x, bias_apart=bias_apart)  # [B, T, t, Hq/t + 2 Hkv/t, Dh]
            y = constrain(y, ("act_batch", "act_length", "act_heads", None, None))
            per_q, per_kv = self.query_heads // y.shape[2], self.kv_heads // y.shape[2]
            parts = (y[:, :, :, :per_q], y[:, :, :, per_q : per_q + per_kv])
            q, k = (p.reshape(*p.shape[:2], -1, p.shape[-1]) for p in parts)
            v = y[:, :, :, per_q + per_kv :].reshape(k.shape)
        else:
            projections = (self.q_proj, self.k_proj, self.v_proj)
            q, k, v = (p(x, bias_apart=bias_apart) for p in projections)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def mlp(self, x: jax.Array) -> jax.Array:
        if self.fused_shards:
            y = self.gate_up_proj(x)  # [B, T, t, 2, F/t]
            y = constrain(y, ("act_batch", "act_length", "act_mlp", None, None))
            gate, up = (y[:, :, :, i].reshape(*y.shape[:2], -1) for i in (0, 1))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = constrain(jax.nn.silu(gate) * up, ROWS_MLP)
        return self.down_proj(hidden)


def fuse_projections(model: nnx.Module, tensor_size: int) -> int:
    """Fuse every Expert's projections in `model` (Expert.fuse_projections) in `tensor_size`
    shards, or in 1 where that does not divide the heads and MLP columns (the decode layout
    then keeps those whole too); returns the shards used."""
    experts = [module for _, module in nnx.iter_modules(model) if isinstance(module, Expert)]
    if not experts:
        return 0
    shards = tensor_size if experts[0].can_fuse(tensor_size) else 1
    for expert in experts:
        expert.fuse_projections(shards)
    return shards


def gen_token_index(gen_mask: jax.Array, capacity: int) -> jax.Array:
    """[B, T] bool -> [B, G] int32: each row's gen-token positions, padded with T (no token).

    G = `capacity` (0: T). A row with more than G gen tokens raises at run time (a host
    callback): cutting tokens off would silently run them through the wrong expert."""
    length = gen_mask.shape[1]
    slots = capacity or length
    counts = jnp.sum(gen_mask, axis=1, dtype=jnp.int32)

    def check(counts):
        if counts.max(initial=0) > slots:
            raise ValueError(
                f"a row has {int(counts.max())} gen-expert tokens, more than "
                f"Qwen2Config.gen_token_capacity={slots}; raise the capacity"
            )

    if slots < length:  # a capacity of the whole row always fits: no check in the program
        jax.debug.callback(check, counts)
    index = jax.vmap(lambda row: jnp.nonzero(row, size=slots, fill_value=length)[0])(gen_mask)
    return index.astype(jnp.int32)


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...] at index [B, G] -> [B, G, ...] (padding slots read the last row position)."""
    return jax.vmap(lambda row, at: jnp.take(row, at, axis=0, mode="clip"))(x, index)


def scatter_rows(x: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """x [B, T, ...] with values [B, G, ...] written at index [B, G] (padding slots dropped)."""
    return jax.vmap(lambda row, at, v: row.at[at].set(v.astype(row.dtype), mode="drop"))(
        x, index, values
    )


def route(gen_index: jax.Array | None, fn, und, gen, *inputs):
    """fn(und, *inputs), with the rows at `gen_index` replaced by fn(gen, *those rows).

    `inputs` are [B, T, ...] arrays; fn returns a pytree of [B, T, ...] (or [B, G, ...] on
    gathered rows). No gen expert or no gen index: the und expert alone."""
    und_out = fn(und, *inputs)
    if gen is None or gen_index is None:
        return und_out
    gen_out = fn(gen, *(gather_rows(x, gen_index) for x in inputs))
    return jax.tree.map(lambda u, g: scatter_rows(u, gen_index, g), und_out, gen_out)


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer with shared attention and per-token expert routing."""

    def __init__(self, config: Qwen2Config, rngs: nnx.Rngs):
        self.config = config
        self.und = Expert(config, rngs)
        self.gen = Expert(config, rngs) if config.build_gen_expert else None

    def _routed(self, gen_index, fn, *inputs):
        return route(gen_index, fn, self.und, self.gen, *inputs)

    def _qkv(self, h, positions, gen_index, bias_apart=False):
        """Input norm, q/k/v projections, QK-norm, then RoPE (keys are cached in this form)."""
        q, k, v = self._routed(gen_index, lambda e, h: e.qkv(e.input_layernorm(h), bias_apart), h)
        theta = self.config.rope_theta
        q, k = apply_rope(q, positions, theta), apply_rope(k, positions, theta)
        return constrain(q, ROWS_HEADS), constrain(k, ROWS_KV_HEADS), constrain(v, ROWS_KV_HEADS)

    def _finish(self, h, attention_out, gen_index):
        """o_proj + residual, post-attention norm, MLP + residual."""
        h = h + self._routed(gen_index, lambda e, a: e.o_proj(a), attention_out)
        mlp = self._routed(gen_index, lambda e, h: e.mlp(e.post_attention_layernorm(h)), h)
        return constrain(h + mlp, ROWS_EMBED)

    def __call__(self, h, positions, segment_ids, k_start, k_end, gen_index, return_kv=False):
        h = constrain(h, ROWS_EMBED)  # the layer's carry: rows over the batch axes
        q, k, v = self._qkv(h, positions, gen_index)
        out = attention_lib.attention(
            q,
            k,
            v,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            k_start=k_start,
            k_end=k_end,
            backend=self.config.attention_backend,
            q_block=self.config.attention_block,
            kv_block=self.config.attention_block,
        )
        h = self._finish(h, constrain(out, ROWS_HEADS), gen_index)
        return (h, (k, v)) if return_kv else h

    def decode(self, h, positions, cache, layer_index, write_slots, kv_lengths):
        """One new token per row against this layer's slice of the stacked KV cache.

        h: [B, 1, D]; cache: [L, B, S, 2, Hkv, Dh] (keys at 0, values at 1 of axis 3). The new
        key and value are written together (one scatter) at `write_slots[b]` of layer
        `layer_index` in place (a slot >= S drops the write, for rows that are done), then the
        query attends the first `kv_lengths[b]` slots of that layer (attention.cache_attention:
        on a GPU a kernel that reads only those slots, in place).
        """
        q, k, v = self._qkv(h, positions, None, bias_apart=True)

        # Per row (vmap over the cache's row axis): the scatter then has a batch dimension, which
        # the SPMD partitioner keeps on each device's own rows; indexed by a row-id array instead,
        # it all-gathers every row's new key and value to every device.
        @functools.partial(jax.vmap, in_axes=(1, 0, 0), out_axes=1)
        def write(cache_rows, slot, new):  # [L, S, 2, Hkv, Dh], [], [2, Hkv, Dh]
            return cache_rows.at[layer_index, slot].set(new.astype(cache_rows.dtype), mode="drop")

        cache = write(cache, write_slots, jnp.stack([k[:, 0], v[:, 0]], axis=1))
        out = attention_lib.cache_attention(
            q[:, 0], cache, layer_index, kv_lengths, backend=self.config.attention_backend
        )
        h = self._finish(h, out[:, None].astype(h.dtype), None)
        return h, cache


class Qwen2MoT(nnx.Module):
    """Token embedding, the stacked MoT decoder layers, final norm(s) and the untied lm_head."""

    def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = normal_param(
            rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed")
        )

        self.layers = stack_layers(
            lambda rngs: DecoderLayer(config, rngs), config.num_hidden_layers, rngs
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_moe_gen = (
            RMSNorm(config.hidden_size, config.rms_norm_eps) if config.build_gen_expert else None
        )
        self.lm_head = normal_param(
            rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab")
        )

    @property
    def compute_dtype(self):
        return jnp.dtype(self.config.compute_dtype)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """[B, T] ids -> [B, T, D] embeddings in the compute dtype."""
        table = compute_weight(self.embed_tokens, ("vocab", "embed"), self.compute_dtype)
        return constrain(jnp.take(table, tokens, axis=0), ROWS_EMBED)

    def __call__(
        self,
        embeddings: jax.Array,
        *,
        positions: jax.Array,
        segment_ids: jax.Array,
        k_start: jax.Array,
        k_end: jax.Array,
        gen_mask: jax.Array | None = None,
        return_kv: bool = False,
    ):
        """Run the decoder over packed rows; returns final-normed hidden states [B, T, D].

        With `return_kv`, also every layer's keys (after k-norm and RoPE) and values, each
        [L, B, T, Hkv, Dh]: what a KV cache holds after prefilling these rows.
        """
        gen_index = None  # no gen weights, or no gen tokens: every token is und
        if self.config.build_gen_expert and gen_mask is not None:
            gen_index = gen_token_index(gen_mask, self.config.gen_token_capacity)

        h = embeddings.astype(self.compute_dtype)
        broadcast = (positions, segment_ids, k_start, k_end, gen_index)
        loop = dict(remat=self.config.remat, unroll=self.config.unroll_layers)
        if return_kv:
            h, kv = scan_layers(self.layers, h, *broadcast, collect=True, return_kv=True, **loop)
        else:
            h = scan_layers(self.layers, h, *broadcast, **loop)
        hidden = route(gen_index, lambda norm, h: norm(h), self.norm, self.norm_moe_gen, h)
        return (hidden, kv) if return_kv else hidden

    def decode_step(self, embeddings, positions, cache, write_slots, kv_lengths):
        """One token per row through every layer with the KV cache (understanding tokens only).

        embeddings [B, 1, D], positions [B, 1]; cache [L, B, S, 2, Hkv, Dh], updated in
        place at `write_slots` (slot >= S = no write); attention covers slots < kv_lengths.
        Returns the final-normed hidden states [B, 1, D] and the cache.
        """

        def body(layer, carry):
            h, cache, index = carry
            h, cache = layer.decode(h, positions, cache, index, write_slots, kv_lengths)
            return h, cache, index + 1

        scan = nnx.scan(
            body,
            in_axes=(0, nnx.Carry),
            out_axes=nnx.Carry,
            unroll=bool(self.config.unroll_decode_layers),
        )
        h, cache, _ = scan(
            self.layers, (embeddings.astype(self.compute_dtype), cache, jnp.zeros((), jnp.int32))
        )
        return self.norm(h), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """lm_head over the last axis: [..., D] -> [..., V] in the hidden states' dtype."""
        weight = compute_weight(self.lm_head, ("embed", "vocab"), hidden.dtype)
        return constrain(jnp.einsum("...d,dv->...v", hidden, weight), vocab_names(hidden.ndim))

    def init_moe(self) -> None:
        """Copy every und weight into its gen counterpart (BAGEL's `init_moe`)."""
        if self.norm_moe_gen is None:
            raise ValueError("init_moe needs a model built with build_gen_expert=True")
        und_state = nnx.state(self.layers.und)
        nnx.update(self.layers.gen, jax.tree.map(jnp.copy, und_state))
        nnx.update(self.norm_moe_gen, jax.tree.map(jnp.copy, nnx.state(self.norm)))
