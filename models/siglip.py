"""SigLIP NaViT vision encoder as BAGEL uses it (docs/bagel_layout.md §4.2-4.6).

* Patch embedding is a Linear over 588 = 14*14*3 features in (py, px, c) order (the checkpoint
  stores the conv already flattened that way), plus a learned position table indexed by the
  r*G + c ids of each patch (G = image_size // patch_size, 70 for BAGEL's 980 / 14), so a
  smaller image uses the top-left block of the G x G table.
* Pre-LN encoder layers: h += out_proj(MHA(LN1(h))); h += fc2(gelu_tanh(fc1(LN2(h)))).
* Images are packed along the patch axis without padding between them; attention is
  bidirectional within an image and never across images (block-diagonal, NaNViT varlen).
* The configured number of layers is what BAGEL keeps (json - 1), and `post_layernorm` is
  applied to the last layer's output: that is the ViT output.

Input is a packed [R, P, 588] batch of patches with per-patch position ids and image ids
(1.. per row, 0 = padding patch); images are contiguous runs of equal image id.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention as attention_lib
from models.configs import SiglipConfig
from models.layers import (
    LayerNorm,
    Projection,
    compute_weight,
    normal_param,
    scan_layers,
    stack_layers,
)
from models.sharding import ROWS_EMBED, ROWS_HEADS, ROWS_MLP, constrain


def image_ranges(image_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[k_start, k_end) of each patch's own image, for runs of equal ids along the last axis."""
    length = image_ids.shape[-1]
    index = jnp.arange(length, dtype=jnp.int32)
    starts_run = jnp.concatenate(
        [jnp.ones_like(image_ids[..., :1], bool), image_ids[..., 1:] != image_ids[..., :-1]], -1
    )
    ends_run = jnp.concatenate(
        [image_ids[..., 1:] != image_ids[..., :-1], jnp.ones_like(image_ids[..., :1], bool)], -1
    )
    k_start = jax.lax.cummax(jnp.where(starts_run, index, 0), axis=image_ids.ndim - 1)
    k_end = jax.lax.cummin(
        jnp.where(ends_run, index + 1, length), axis=image_ids.ndim - 1, reverse=True
    )
    return k_start, k_end


class EncoderLayer(nnx.Module):
    def __init__(
        self,
        config: SiglipConfig,
        compute_dtype: str,
        attention_backend: str,
        image_patches: int,
        rngs: nnx.Rngs,
    ):
        d, f = config.hidden_size, config.intermediate_size
        h, dh = config.num_attention_heads, config.head_dim
        eps = config.layer_norm_eps
        self.attention_backend = attention_backend
        self.image_patches = image_patches
        self.layer_norm1 = LayerNorm(d, eps)
        self.q_proj = Projection(
            rngs,
            "btd,dhk->bthk",
            (d, h, dh),
            ("vit_embed", "q_heads", "head_dim"),
            (h, dh),
            ("q_heads", "head_dim"),
        )
        self.k_proj = Projection(
            rngs,
            "btd,dhk->bthk",
            (d, h, dh),
            ("vit_embed", "q_heads", "head_dim"),
            (h, dh),
            ("q_heads", "head_dim"),
        )
        self.v_proj = Projection(
            rngs,
            "btd,dhk->bthk",
            (d, h, dh),
            ("vit_embed", "q_heads", "head_dim"),
            (h, dh),
            ("q_heads", "head_dim"),
        )
        self.out_proj = Projection(
            rngs, "bthk,hkd->btd", (h, dh, d), ("q_heads", "head_dim", "vit_embed"), (d,), ("norm",)
        )
        self.layer_norm2 = LayerNorm(d, eps)
        self.fc1 = Projection(rngs, "btd,df->btf", (d, f), ("vit_embed", "mlp"), (f,), ("mlp",))
        self.fc2 = Projection(rngs, "btf,fd->btd", (f, d), ("mlp", "vit_embed"), (d,), ("norm",))

    def __call__(self, h, image_ids, k_start, k_end):
        h = constrain(h, ROWS_EMBED)  # the layer's carry: rows over the batch axes
        x = self.layer_norm1(h)
        q, k, v = (constrain(p(x), ROWS_HEADS) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = attention_lib.attention(
            q,
            k,
            v,
            q_segment_ids=image_ids,
            kv_segment_ids=image_ids,
            k_start=k_start,
            k_end=k_end,
            backend=self.attention_backend,
            cudnn_segment_length=self.image_patches,  # each image a row of its own (cudnn)
        )
        h = h + self.out_proj(constrain(out, ROWS_HEADS))
        hidden = constrain(jax.nn.gelu(self.fc1(self.layer_norm2(h)), approximate=True), ROWS_MLP)
        return constrain(h + self.fc2(hidden), ROWS_EMBED)


class SiglipVisionEncoder(nnx.Module):
    """Packed patches -> post-layernormed features [R, P, hidden]."""

    def __init__(
        self,
        config: SiglipConfig,
        *,
        compute_dtype: str = "bfloat16",
        attention_backend: str = "chunked",
        remat: str = "full",
        image_patches: int = 0,
        rngs: nnx.Rngs,
    ):
        """`image_patches`: the most patches one image has (0: unknown), the row length of the
        cudnn backend's one-image-a-row layout (models/attention_cudnn.py)."""
        self.config = config
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.remat = remat
        d = config.hidden_size
        self.patch_embedding = Projection(
            rngs, "bpi,id->bpd", (config.patch_dim, d), ("patch", "vit_embed"), (d,), ("norm",)
        )
        self.position_embedding = normal_param(
            rngs, (config.num_patches_per_side**2, d), ("vit_positions", "vit_embed")
        )
        self.layers = stack_layers(
            lambda rngs: EncoderLayer(
                config, compute_dtype, attention_backend, image_patches, rngs
            ),
            config.num_hidden_layers,
            rngs,
        )
        self.post_layernorm = LayerNorm(d, config.layer_norm_eps)

    def __call__(self, patches: jax.Array, position_ids: jax.Array, image_ids: jax.Array):
        """patches [R, P, 588]; position_ids, image_ids [R, P] -> features [R, P, hidden]."""
        if patches.shape[-1] != self.config.patch_dim:
            raise ValueError(
                f"patches have {patches.shape[-1]} features per patch, expected "
                f"{self.config.patch_dim} (patch_size^2 * channels)"
            )
        h = self.patch_embedding(patches.astype(self.compute_dtype))
        table = compute_weight(
            self.position_embedding, ("vit_positions", "vit_embed"), self.compute_dtype
        )
        # Ids are checked on the host against the grid (opsd_jax/data/image_transform.py);
        # "clip" keeps a bad one from gathering NaN rows (jnp.take's default fill) in here.
        h = h + jnp.take(table, position_ids, axis=0, mode="clip")
        k_start, k_end = image_ranges(image_ids)
        h = scan_layers(self.layers, h, image_ids, k_start, k_end, remat=self.remat)
        return self.post_layernorm(h)
