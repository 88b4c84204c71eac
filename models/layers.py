"""Building blocks shared by the language model and the vision encoder.

Parameters carry logical axis names (`out_sharding` metadata) and are created unsharded
(`eager_sharding=False`): a model can be built anywhere, and placement on a mesh is the job of a
jitted init with out_shardings (opsd_jax/parallel/mesh.py maps the logical names to mesh axes).

Layer stacks are built once with `nnx.vmap` (a leading 'layers' axis on every weight) and run
with `nnx.scan`, so compile time does not grow with depth; each layer can be rematerialised
under a `jax.checkpoint` policy.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.sharding import constrain, in_use_names

INIT_STD = 0.02  # HF's initializer_range; only matters for training from scratch.

# The Pallas range kernel's forward (models/attention_pallas.py names its pallas_call so; it is
# not imported here: a CPU never imports the kernel). Its outputs, the attention output and one
# logsumexp per query row, are all its backward needs besides q, k and v.
ATTENTION_FORWARD_KERNEL = "range_attention_forward"


def _attention_kernel_saveable(prim, *_, **params) -> bool:
    return prim.name == "pallas_call" and params.get("name") == ATTENTION_FORWARD_KERNEL


# Per-layer rematerialisation policies by config name ("none" = keep every activation).
# 'minimal_flash' is MaxText's policy of that name: the matmul outputs without batch dims and
# the flash attention's output are kept, so the backward reruns neither the projections nor
# the attention kernel, only the cheap elementwise work between them (norms, RoPE, gates).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal_flash": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _attention_kernel_saveable
    ),
}


def param(value: jax.Array, names: tuple[str, ...]) -> nnx.Param:
    """A parameter with logical axis names, placed later by the mesh rules (not eagerly)."""
    if len(names) != value.ndim:
        raise ValueError(f"logical names {names} do not match parameter shape {value.shape}")
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    return param(INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32), names)


def compute_weight(weight: nnx.Param, names: tuple[str, ...], dtype) -> jax.Array:
    """The fp32 master weight, cast to the compute dtype and gathered for use (FSDP).

    Two constraints say where each step happens: the cast copy keeps the parameter's own
    layout, so every device casts its shard; then it takes its in-use layout (hidden dimension
    whole), so the all-gather moves the compute-dtype copy (bf16: half the bytes of gathering
    fp32 and casting after). In the backward the weight gradient is reduce-scattered in that
    dtype and cast to fp32 on the shard. Explicit gathering also keeps XLA from splitting a
    table lookup over the hidden dimension (which would gather the indices instead).
    """
    shard = constrain(weight[...].astype(dtype), names)
    return constrain(shard, in_use_names(names))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def weight_einsum(equation: str, x: jax.Array, weight: jax.Array) -> jax.Array:
    """`jnp.einsum(equation, x, weight)` whose backward writes both gradients as einsums with
    the activations first: d_weight = einsum(x, d_out), d_x = einsum(d_out, weight).

    Same values as autodiff's transpose of the einsum, in a form XLA:CPU runs without
    transposing copies: autodiff's weight gradient comes out as (d_out^T x)^T, and XLA:CPU
    materialises d_out^T (a [features, tokens] copy of every MLP activation gradient) for it.
    bench/vs_pytorch.py: the m64 train step took 1.200 s against 1.248 s. GPU layouts are unchanged
    (both forms are one dot_general each).
    """
    return jnp.einsum(equation, x, weight)


def _weight_einsum_fwd(equation, x, weight):
    return jnp.einsum(equation, x, weight), (x, weight)


def _weight_einsum_bwd(equation, residuals, d_out):
    x, weight = residuals
    inputs, out = equation.split("->")
    x_spec, weight_spec = inputs.split(",")
    d_x = jnp.einsum(f"{out},{weight_spec}->{x_spec}", d_out, weight)
    d_weight = jnp.einsum(f"{x_spec},{out}->{weight_spec}", x, d_out)
    return d_x.astype(x.dtype), d_weight.astype(weight.dtype)


weight_einsum.defvjp(_weight_einsum_fwd, _weight_einsum_bwd)


class Projection(nnx.Module):
    """A linear map written as an einsum; the kernel is stored [in..., out...] (PyTorch W^T)."""

    # A LoRA adapter, when models/lora.py attaches one: an nnx.LoRA over the flattened input and
    # output features, its scale alpha / rank, and how many kernel axes the einsum contracts.
    # Class defaults, so that a projection without one has the graph it always had.
    lora = None
    lora_scale = 0.0
    lora_in_dims = 0

    def __init__(
        self,
        rngs: nnx.Rngs | None,
        equation: str,
        kernel_shape: tuple[int, ...],
        kernel_names: tuple[str, ...],
        bias_shape: tuple[int, ...] | None = None,
        bias_names: tuple[str, ...] | None = None,
        *,
        kernel: nnx.Param | None = None,
        bias: nnx.Param | None = None,
    ):
        """A new projection (`kernel_shape`, initialised from `rngs`), or one holding the given
        `kernel` and `bias` parameters (rngs None; the shapes are theirs)."""
        self.equation = equation
        self.kernel_names = kernel_names
        self.kernel = normal_param(rngs, kernel_shape, kernel_names) if kernel is None else kernel
        if bias is None and bias_shape is not None:
            bias = param(jnp.zeros(bias_shape, jnp.float32), bias_names)
        self.bias = bias

    def __call__(self, x: jax.Array, *, bias_apart: bool = False) -> jax.Array:
        """x times the kernel, plus the bias. `bias_apart`: the bias added as an op of its own
        (an optimization barrier between), so that it fuses into what reads the result. For the
        decode step's layers on a GPU: XLA otherwise folds it into the cuBLAS call, which then
        cannot read its weight in place from the stacked layers (a layer's k / v weight is
        copied out every token) or needs the q bias broadcast by another kernel: 5 kernels a
        layer per token. The result is what this code says: the product rounded to x's dtype,
        then the bias added (cuBLAS adds it before rounding: within one rounding of x's dtype)."""
        y = weight_einsum(self.equation, x, compute_weight(self.kernel, self.kernel_names, x.dtype))
        if self.lora is not None:  # + (alpha / rank) (x A) B, x flattened to [..., in]
            batch = x.shape[: x.ndim - self.lora_in_dims]
            update = self.lora(x.reshape(batch + (-1,))) * self.lora_scale
            y = y + update.reshape(y.shape).astype(y.dtype)
        if self.bias is not None:
            y = (jax.lax.optimization_barrier(y) if bias_apart else y) + self.bias[...].astype(
                x.dtype
            )
        return y


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) in fp32, cast back to x's dtype, then times `scale`."""

    def __init__(self, dim: int, eps: float, names: tuple[str, ...] = ("norm",)):
        self.eps = eps
        self.scale = param(jnp.ones((dim,), jnp.float32), names)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype) * self.scale[...].astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias; statistics in fp32, result in x's dtype."""

    def __init__(self, dim: int, eps: float, names: tuple[str, ...] = ("norm",)):
        self.eps = eps
        self.scale = param(jnp.ones((dim,), jnp.float32), names)
        self.bias = param(jnp.zeros((dim,), jnp.float32), names)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.scale[...] + self.bias[...]).astype(x.dtype)


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs):
    """`num_layers` independently initialised layers stacked on a leading 'layers' axis."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return make_layer(rngs)

    return make(rngs)


def scan_layers(
    layers,
    carry: jax.Array,
    *broadcast,
    remat: str = "none",
    collect: bool = False,
    unroll: bool = False,
    **static,
):
    """carry <- layer(carry, *broadcast) for each layer of a stack, in order.

    `unroll` writes the layers out one after the other instead of a loop over the stack: on a
    CPU the loop's stacked residuals are read back for the backward through dynamic slices that
    XLA:CPU fuses into slow transposing copies (bench/vs_pytorch.py: the m64 grad step takes
    about 7% less CPU time unrolled, compile time unchanged at 8 layers); elsewhere a loop
    keeps compile time flat in depth.

    `broadcast` arguments (positions, masks, ...) are the same for every layer; None is allowed.
    With `collect`, each layer returns (carry, output) and the outputs come back stacked on a
    leading layer axis: returns (carry, stacked outputs). `static` keyword arguments are passed
    to every layer call as Python values (not traced).
    """

    def body(layer, carry, *broadcast):
        return layer(carry, *broadcast, **static)

    if remat != "none":
        body = nnx.remat(body, policy=REMAT_POLICIES[remat])
    in_axes = (0, nnx.Carry) + (None,) * len(broadcast)
    out_axes = (nnx.Carry, 0) if collect else nnx.Carry
    return nnx.scan(body, in_axes=in_axes, out_axes=out_axes, unroll=bool(unroll))(
        layers, carry, *broadcast
    )
