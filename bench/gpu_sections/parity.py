"""bench/gpu_check.py's `parity` section: the GPU kernels against references, on the GPU.

The range kernel (models/attention_pallas.py) against the dense `reference` backend, forward
and dq / dk / dv, at BAGEL's LLM shapes (28 query / 4 kv heads, head dim 128) and SigLIP's
(16 / 16 heads, head dim 72), bf16 inputs, on packed BAGEL-style rows; cuDNN's fused attention
as the ViT's backend the same way, in each of its three branches (`_cudnn_vit_parity`); the
sampler's decode kernel (models/decode_attention_pallas.py) against XLA's decode attention, run
twice and the two outputs compared bit for bit. Fails on an error above PARITY_MAX_ERROR or two runs that
differ.
"""

from __future__ import annotations

from gpu_sections.common import emit, setup_jax

# Largest error (relative to max(1, |reference|); the decode kernel's outputs are averages of V
# rows, of order 1); bf16 inputs with fp32 accumulation round the output to 2^-8, so an error
# past 2e-2 is a wrong kernel, not rounding.
PARITY_MAX_ERROR = 2e-2


def run(args):
    """Pallas vs reference, forward and gradients, LLM and SigLIP head layouts; the decode
    kernel against XLA's, twice, the two outputs compared bit for bit."""
    jax = setup_jax(args.dry_run)
    import jax.numpy as jnp
    import numpy as np

    from models.attention import attention
    from models.attention_pallas import range_attention

    rng = np.random.default_rng(0)
    cases = [
        ("LLM 28q/4kv/128", 28, 4, 128, 256 if args.dry_run else 4096),
        ("SigLIP 16/16/72", 16, 16, 72, 128 if args.dry_run else 4900),
    ]
    if args.dry_run:  # fewer heads (the interpreter is slow), the same head dims and grouping
        cases = [(cases[0][0], 4, 1, 128, cases[0][4]), (cases[1][0], 2, 2, 72, cases[1][4])]
    for name, hq, hkv, d, length in cases:
        # Packed rows: samples of 1024 tokens opening with a 256-token image block (LLM), or
        # whole images attending within themselves (SigLIP: one segment per image).
        seg = np.zeros(length, np.int32)
        k_start = np.zeros(length, np.int32)
        k_end = np.arange(1, length + 1, dtype=np.int32)
        sample = 1024 if "LLM" in name else 1225
        for i, start in enumerate(range(0, length, sample)):
            end = min(start + sample, length)
            seg[start:end], k_start[start:end] = i + 1, start
            k_end[start : end if "SigLIP" in name else min(start + 256, end)] = (
                end if "SigLIP" in name else min(start + 256, end)
            )
        ids = [jnp.asarray(x[None]) for x in (seg, seg, k_start, k_end)]
        q = jnp.asarray(rng.normal(size=(1, length, hq, d)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.normal(size=(1, length, hkv, d)), jnp.bfloat16) for _ in "kv")
        cot = jnp.asarray(rng.normal(size=(1, length, hq, d)), jnp.float32)

        def pallas(q, k, v):
            return range_attention(
                q,
                k,
                v,
                q_segment_ids=ids[0],
                kv_segment_ids=ids[1],
                k_start=ids[2],
                k_end=ids[3],
                interpret=args.dry_run,
            )

        def reference(q, k, v):
            return attention(
                q.astype(jnp.float32),
                k.astype(jnp.float32),
                v.astype(jnp.float32),
                q_segment_ids=ids[0],
                kv_segment_ids=ids[1],
                k_start=ids[2],
                k_end=ids[3],
                backend="reference",
            )

        got, want = (_out_and_grads(fn, q, k, v, cot) for fn in (pallas, reference))
        _emit_gradient_parity(f"{name}, T={length}", got, want, "vs reference")

    _cudnn_vit_parity(args, rng)

    # The sampler's decode attention kernel on the stacked cache against XLA's on the layer's
    # slice, rows of lengths from 1 to the whole cache.
    from models.attention import decode_attention
    from models.decode_attention_pallas import filled_cache_attention

    layers, rows, slots, hq, hkv = (2, 4, 256, 7, 1) if args.dry_run else (2, 8, 4160, 28, 4)
    q = jnp.asarray(rng.normal(size=(rows, hq, 128)), jnp.bfloat16)
    cache = jnp.asarray(rng.normal(size=(layers, rows, slots, 2, hkv, 128)), jnp.bfloat16)
    lengths = jnp.asarray(np.linspace(1, slots, rows).astype(np.int32))
    decode = jax.jit(lambda *a: filled_cache_attention(*a, interpret=args.dry_run))
    got = decode(q, cache, jnp.int32(1), lengths)
    # A kernel that reads or writes past its blocks reads whatever lies there: the same inputs
    # twice in one process give different outputs (jax 0.11's Triton lowering, the old kernel).
    again = decode(q, cache, jnp.int32(1), lengths)
    same = bool(np.array_equal(np.asarray(got), np.asarray(again)))
    k, v = (cache[1, :, :, i].astype(jnp.float32) for i in (0, 1))
    want = decode_attention(q.astype(jnp.float32), k, v, lengths)
    error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
    ok = error <= PARITY_MAX_ERROR
    emit(
        section="parity",
        case=f"decode {hq}q/{hkv}kv/128, {slots} slots",
        value=f"{error:.1e}",
        unit=f"max error out (vs XLA decode attention, fp32), "
        f"{'at most' if ok else 'above'} {PARITY_MAX_ERROR:.0e}",
        ok=bool(ok),
        kind="check",
    )
    emit(
        section="parity",
        case=f"decode {hq}q/{hkv}kv/128, {slots} slots, run twice",
        value="bit-identical" if same else "DIFFERENT",
        unit="the second run's output against the first's, bit for bit",
        ok=same,
        kind="check",
    )


def _out_and_grads(fn, q, k, v, cot):
    """fn(q, k, v) and the gradients of sum(out * cot) in q, k, v, as float32 numpy arrays."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * cot)

    out = jax.jit(fn)(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def _emit_gradient_parity(case, got, want, against):
    """The parity row of an output and its three gradients: each one's largest error relative
    to max(1, |reference|), checked against PARITY_MAX_ERROR (a NaN fails it)."""
    import numpy as np

    errors = [
        float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b)))) for a, b in zip(got, want)
    ]
    ok = max(errors) <= PARITY_MAX_ERROR
    emit(
        section="parity",
        case=case,
        value=" / ".join(f"{e:.1e}" for e in errors),
        unit=f"max error out / dq / dk / dv ({against}), "
        f"{'at most' if ok else 'above'} {PARITY_MAX_ERROR:.0e}",
        ok=bool(ok),
        kind="check",
    )


def _cudnn_vit_parity(args, rng):
    """cuDNN's fused attention as the ViT's backend (vit_attention_backend='cudnn') against the
    reference, forward and gradients, at SigLIP's 16 heads of 72, each of its three branches
    (models/attention_cudnn.py): rows of one image (their lengths, no mask array), rows of
    images each gathered into a row of its own (lengths, no mask), and rows of more images than
    that layout holds (the dense mask). The dry run runs the same selection with jax's XLA
    implementation in place of cuDNN."""
    import functools

    import jax.numpy as jnp
    import numpy as np

    from models.attention import attention
    from models.attention_cudnn import PATHS, cudnn_attention, path_taken
    from models.siglip import image_ranges

    row = 128 if args.dry_run else 4992
    heads = 2 if args.dry_run else 16
    implementation = "xla" if args.dry_run else "cudnn"
    half = row // 2  # the segment rows' length: two a row
    for name, images, segment_length in (
        ("one image a row", [[row - 92], [half]], 0),
        ("images in rows of their own", [[half, row // 3], [half]], half),
        ("three images, two rows", [[row // 4] * 3, [half]], half),
    ):
        fused = functools.partial(
            cudnn_attention, implementation=implementation, segment_length=segment_length
        )
        seg = np.zeros((len(images), row), np.int32)
        for b, sizes in enumerate(images):
            ends = np.cumsum(sizes)
            for i, (start, end) in enumerate(zip(ends - sizes, ends), 1):
                seg[b, start:end] = i
        seg = jnp.asarray(seg)
        ids = (seg, seg, *image_ranges(seg))
        path = PATHS[int(path_taken(*ids, segment_length))]
        q, k, v = (
            jnp.asarray(rng.normal(size=(len(images), row, heads, 72)), jnp.bfloat16) for _ in "qkv"
        )
        cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

        def reference(q, k, v):
            ranges = dict(zip(("q_segment_ids", "kv_segment_ids", "k_start", "k_end"), ids))
            as_f32 = (x.astype(jnp.float32) for x in (q, k, v))
            return attention(*as_f32, **ranges, backend="reference")

        got = _out_and_grads(lambda q, k, v: fused(q, k, v, *ids), q, k, v, cot)
        want = _out_and_grads(reference, q, k, v, cot)
        case = f"SigLIP {heads}/{heads}/72 cuDNN ({implementation}), {name}, T={row}"
        _emit_gradient_parity(case, got, want, f"vs reference; {path}")
