"""BAGEL for understanding: ViT -> connector -> + 2-D sin-cos table, scattered into the LM's rows.

`Bagel(config, rngs=...)(pack)` runs one packed forward (docs/bagel_layout.md §5.2):

1. text and image-marker ids are embedded with the LM's table;
2. the ViT encodes every image's patches (attending within each image), the connector
   (Linear, tanh-GELU, Linear) maps them to the LM width, the fixed sin-cos table is added at
   the patches' r*G + c ids (G = the ViT's image_size // patch_size, 70 at 7B), and the result
   replaces the rows' patch slots;
3. the LM runs over the rows with the Pack's positions and key ranges (no [T, T] mask);
4. the final-normed hidden states come back; `logits_at` applies lm_head only where asked.

Image generation (VAE latents, time embedder, flow head) is not ported; `visual_gen=True` is
refused. The MoT gen expert weights can still be built (`llm.build_gen_expert`) and routed with
`Pack.gen_mask`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.configs import BagelConfig
from models.layers import Projection, compute_weight
from models.pack import Pack
from models.qwen2_mot import Qwen2MoT
from models.sharding import ROWS_EMBED, constrain
from models.siglip import SiglipVisionEncoder


class FixedTable(nnx.Variable):
    """A non-trainable table stored in the checkpoint (optimizers only see nnx.Param)."""


def sincos_2d_table(grid_size: int, dim: int) -> np.ndarray:
    """BAGEL's fixed position table [grid^2, dim] (docs/bagel_layout.md §4.7).

    Row r*grid + c = [sin(c*w), cos(c*w), sin(r*w), cos(r*w)] with w_k = 10000^(-k/(dim/4)):
    the first half encodes the column, the second half the row. Computed in float64 as
    upstream, returned as float32.
    """
    if dim % 4:
        raise ValueError(f"the 2-D sin-cos table needs a width divisible by 4, got {dim}")
    omega = 1.0 / 10000.0 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))
    rows, cols = np.meshgrid(np.arange(grid_size), np.arange(grid_size), indexing="ij")
    col_angles = cols.reshape(-1, 1) * omega
    row_angles = rows.reshape(-1, 1) * omega
    table = np.concatenate(
        [np.sin(col_angles), np.cos(col_angles), np.sin(row_angles), np.cos(row_angles)], axis=1
    )
    return table.astype(np.float32)


class Connector(nnx.Module):
    """ViT width -> LM width: fc1, tanh-GELU, fc2 (BAGEL's `connector`)."""

    def __init__(self, vit_dim: int, llm_dim: int, rngs: nnx.Rngs):
        self.fc1 = Projection(
            rngs, "...i,io->...o", (vit_dim, llm_dim), ("vit_embed", "mlp"), (llm_dim,), ("mlp",)
        )
        self.fc2 = Projection(
            rngs, "...i,io->...o", (llm_dim, llm_dim), ("mlp", "embed"), (llm_dim,), ("norm",)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class Bagel(nnx.Module):
    def __init__(self, config: BagelConfig, *, rngs: nnx.Rngs):
        if config.visual_gen:
            raise ValueError(
                "BagelConfig.visual_gen=True: image generation (VAE, time embedder, "
                "flow head) is not ported; use visual_gen=False"
            )
        self.config = config
        llm = config.llm
        self.language_model = Qwen2MoT(llm, rngs=rngs)
        if config.visual_und:
            self.vit_model = SiglipVisionEncoder(
                config.vit,
                compute_dtype=llm.compute_dtype,
                attention_backend=(
                    llm.attention_backend
                    if llm.vit_attention_backend == "auto"
                    else llm.vit_attention_backend
                ),
                remat=llm.remat if llm.vit_remat == "same" else llm.vit_remat,
                image_patches=llm.vit_image_patches,
                rngs=rngs,
            )
            self.connector = Connector(config.vit.hidden_size, llm.hidden_size, rngs)
            table = sincos_2d_table(config.vit_max_num_patch_per_side, llm.hidden_size)
            self.vit_pos_embed = FixedTable(
                jnp.asarray(table), out_sharding=("vit_positions", "embed"), eager_sharding=False
            )
        else:
            self.vit_model = self.connector = self.vit_pos_embed = None

    def image_embeddings(self, patches, position_ids, image_ids) -> jax.Array:
        """ViT -> connector -> + sin-cos table: [R, P, 588] patches -> [R, P, D] (compute dtype)."""
        features = self.connector(self.vit_model(patches, position_ids, image_ids))
        table = compute_weight(self.vit_pos_embed, ("vit_positions", "embed"), features.dtype)
        # Same ids as the ViT's table, clipped there too: never a silent NaN row.
        return constrain(features + jnp.take(table, position_ids, axis=0, mode="clip"), ROWS_EMBED)

    def embed(self, pack: Pack) -> jax.Array:
        """The LM's input rows [R, T, D]: token embeddings with patch slots filled by the ViT."""
        embeddings = self.language_model.embed(pack.tokens)
        if pack.vit_patches is None:
            return embeddings
        if self.vit_model is None:
            raise ValueError("the Pack has images but the model was built with visual_und=False")
        patch_embeddings = self.image_embeddings(
            pack.vit_patches, pack.vit_pos_ids, pack.vit_image_ids
        ).astype(embeddings.dtype)
        length = pack.tokens.shape[1]
        # Padding patches (slot -1) are sent past the row end and dropped by the scatter.
        slots = jnp.where(pack.vit_slots >= 0, pack.vit_slots, length)
        # Per row (vmap): the scatter then has a batch dimension that the SPMD partitioner
        # keeps on each device's own rows.
        fill = jax.vmap(lambda row, at, values: row.at[at].set(values, mode="drop"))
        return constrain(fill(embeddings, slots, patch_embeddings), ROWS_EMBED)

    def __call__(self, pack: Pack, return_kv: bool = False):
        """One packed forward: final-normed hidden states [R, T, D].

        With `return_kv`, also every layer's keys (after k-norm and RoPE, as BAGEL's cache holds
        them) and values, [L, R, T, Hkv, Dh] each: a KV cache prefilled with these rows."""
        return self.language_model(
            self.embed(pack),
            positions=pack.positions,
            segment_ids=pack.segment_ids,
            k_start=pack.k_start,
            k_end=pack.k_end,
            gen_mask=pack.gen_mask,
            return_kv=return_kv,
        )

    def prefill(self, pack: Pack):
        """(hidden, (k, v)) of the packed forward: what the sampler's cache starts from."""
        return self(pack, return_kv=True)

    def decode_step(self, tokens, positions, cache, write_slots, kv_lengths):
        """Feed one text token per row: tokens, positions [B] -> (logits [B, V], cache).

        The token's key/value go to `write_slots` (>= cache length: not written) and it attends
        the cache's first `kv_lengths` slots (which include its own)."""
        lm = self.language_model
        hidden, cache = lm.decode_step(
            lm.embed(tokens[:, None]), positions[:, None], cache, write_slots, kv_lengths
        )
        return lm.logits(hidden[:, 0]), cache

    def logits_at(self, hidden: jax.Array, rows: jax.Array) -> jax.Array:
        """lm_head only at the requested row positions: hidden [R, T, D], rows [R, C] -> [R, C, V]."""
        selected = jnp.take_along_axis(hidden, rows[..., None].astype(jnp.int32), axis=1)
        return self.language_model.logits(selected)
