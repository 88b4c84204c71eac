"""The run's programs compiled for an H100, on a machine without a GPU (compile-only devices).

What the GPU compiler builds is not what XLA:CPU builds (fusions, copies, buffers, Triton
kernels, collectives), so these compile the tiny config's programs for the H100 target
(opsd_jax/programs/gpu_target.py) and read one fact from each executable: the Pallas kernels
are in the train step and its state is donated; the decode-copy refresh gathers bf16; prefill
and the decode round on the replicated copy move nothing between devices but per-row scalars,
and the HBM counter of the decode step sees at least the weights it must read. jax's CUDA
plugin is in requirements-test.txt: without it these fail (they are not skipped).
"""

import collections
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import topologies
from jax.sharding import PartitionSpec as P

from configs import smoke
from models import attention, decode_attention_pallas
from models.bagel import Bagel
from models.configs import BagelConfig
from models.sharding import logical_spec
from opsd_jax import run_config
from opsd_jax.data import pack_shapes
from opsd_jax.data.opsd_packs import shaped_pack
from opsd_jax.data.packing import SpecialTokens
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.programs import gpu_target, hbm_traffic, hlo_stats, thunk_launches
from opsd_jax.sampling import decode_copy, engine, pool_programs, sampler
from opsd_jax.training import train_step

SPECIAL = SpecialTokens(1020, 1021, 1022, 1023)  # the toy vocabulary's structural ids
SMALL = 64  # elements: per-row scalars (tokens, log-probs, stop flags) may cross devices
TRITON = '"__gpu$xla.gpu.triton"'
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_cuda_plugin_is_installed():
    assert gpu_target.plugin_available(), "pip install -r requirements-test.txt (jax's CUDA plugin)"


def tiny_model_config(backend: str) -> BagelConfig:
    """The tiny config's model as train.py builds it, with the attention `backend`."""
    config = smoke.get_config()
    return BagelConfig.tiny(
        llm=dict(
            compute_dtype=config.compute_dtype,
            remat=config.remat,
            attention_backend=backend,
            unroll_layers=config.unroll_layers,
            attention_block=config.attention_block,
        )
    )


def abstract_split(model_config, mesh):
    graphdef, abstract = mesh_lib.abstract_model(
        lambda: Bagel(model_config, rngs=nnx.Rngs(0)), mesh
    )
    params, rest = nnx.split_state(abstract, nnx.Param, ...)
    return graphdef, params, rest


def host_rest(model_config):
    """The model's non-parameter state (the ViT's sin-cos table) as values on the host CPU: a
    train step closes over it, as train.py's does."""
    return gpu_target.host_rest(lambda: Bagel(model_config, rngs=nnx.Rngs(0)))


def tiny_grad_step_model(remat: str, vit_remat: str) -> BagelConfig:
    """The tiny model in bfloat16 on the Pallas range kernel, its layers a loop, with the LLM's
    and the ViT's remat policies: the model of the grad steps that tests/test_remat.py and
    test_step_compiler_flags.py compile for an H100."""
    return BagelConfig.tiny(
        llm=dict(
            compute_dtype="bfloat16",
            remat=remat,
            vit_remat=vit_remat,
            attention_backend="pallas",
            unroll_layers=False,
        )
    )


# The grad-step programs this process has compiled, by what each was compiled from. A deviceless
# compile is not kept by JAX's persistent cache, and tests/test_remat.py and
# test_step_compiler_flags.py need the same program (conftest.py runs the two files in one
# worker): the second reads it here.
_GRAD_STEP_PROGRAMS: dict[tuple, str] = {}


def grad_step_program(model_config, mesh, rows: int = 1, **options) -> str:
    """The text of the OPSD grad step (smoke's loss settings and pack shapes, `rows` rows per
    pack) of `model_config`'s model, compiled for `mesh`'s GPU target with XLA `options`."""
    key = (repr(model_config), mesh, rows, tuple(sorted(options.items())))
    if key not in _GRAD_STEP_PROGRAMS:
        _GRAD_STEP_PROGRAMS[key] = compile_grad_step(model_config, mesh, rows, options)
    return _GRAD_STEP_PROGRAMS[key]


def compile_grad_step(model_config, mesh, rows: int, options: dict) -> str:
    graphdef, params, _ = abstract_split(model_config, mesh)
    run = smoke.get_config()
    step = train_step.make_grad_step(
        graphdef, host_rest(model_config), run_config.loss_settings(run), "ema"
    )
    shapes = pack_shapes.pack_shapes(run)

    def abstract(name):
        pack = shaped_pack([], shapes[name][0], rows, SPECIAL, [], fixed=True)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=mesh_lib.batch_sharding(mesh, x.ndim)
            ),
            pack,
        )

    with mesh_lib.use_mesh(mesh):
        lowered = step.lower(params, params, abstract("student"), abstract("teacher"))
    return gpu_target.compile(lowered, mesh, **options).as_text()


def tiny_train_step(mesh, options):
    """(the tiny config's train step lowered for `mesh`, compiled with XLA `options`)."""
    config = smoke.get_config()
    model_config = tiny_model_config("pallas")
    graphdef, params, _ = abstract_split(model_config, mesh)
    rest = host_rest(model_config)
    optimizer = train_step.make_optimizer(config)
    state = train_step.abstract_state(params, optimizer, config.teacher_mode, jax.random.key(0))
    loss_fn = train_step.make_opsd_loss(
        graphdef, rest, run_config.loss_settings(config), config.teacher_mode
    )
    step = run_config.train_step_for(config, loss_fn, optimizer, state)
    shapes = pack_shapes.pack_shapes(config)
    batch = tuple(
        distributed.abstract_micro_batches(
            shaped_pack([], shapes[name][0], config.rows_per_micro_batch, SPECIAL, [], fixed=True),
            config.gradient_accumulation_steps,
            mesh,
        )
        for name in ("student", "teacher")
    )
    with mesh_lib.use_mesh(mesh):
        return step.lower(state, batch).compile(compiler_options=options)


@pytest.fixture(scope="module")
def h100_train_step():
    mesh = gpu_target.make_mesh("h100", 1)  # the tiny config trains on one device
    return tiny_train_step(mesh, gpu_target.compiler_options(mesh))


@pytest.mark.slow
def test_train_step_runs_the_pallas_kernels_and_donates_its_state(h100_train_step):
    text = h100_train_step.as_text()
    # Forward, dQ and dK/dV kernels, compiled for sm90 (ptxas included), not merely lowered.
    assert text.count(TRITON) >= 3, f"{text.count(TRITON)} Triton custom calls"
    memory = h100_train_step.memory_analysis()
    assert memory.temp_size_in_bytes > 0
    # The whole train state (params, EMA, moments) is donated: the output reuses its buffers.
    assert memory.alias_size_in_bytes >= 0.9 * memory.output_size_in_bytes > 0


def test_a_deviceless_compile_needs_the_cub_flag():
    """XLA's own target specs name a CUDA 13 stack (CUB 3.1.2); for such a target the GPU
    compiler rewrites a long sort into a CUB call and asks the CUDA runtime for its scratch
    size, which fails without a device. DEVICELESS_OPTIONS keeps XLA's own sort instead."""
    text = gpu_target.target_config("h100").replace(
        "  ecc_enabled: true\n", '  ecc_enabled: true\n  cub_version: "3.1.2"\n'
    )
    assert "cub_version" in text
    device = topologies.get_topology_desc(
        platform="cuda", target_config=text, topology="1x1x1"
    ).devices[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    keys = jax.ShapeDtypeStruct(
        (1 << 20,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P())
    )
    lowered = jax.jit(jnp.argsort).lower(keys)
    with pytest.raises(Exception, match="cudaErrorInvalidDevice"):
        lowered.compile()
    assert lowered.compile(compiler_options=gpu_target.DEVICELESS_OPTIONS) is not None


def test_the_suites_autotune_flag_changes_only_empty_emitter_configs():
    """tests/conftest.py compiles for the GPU with autotuning off (NO_DEVICELESS_AUTOTUNE): the
    tests read programs that must be XLA's own. A matmul with loop and reduce fusions, compiled
    at XLA's default level and at 0: the same instructions, buffers and sizes, and the default
    differs only in the empty emitter config it assigns each fusion (compile options override
    the environment's flag, so both levels compile here)."""
    mesh = gpu_target.make_mesh("h100", 1)
    replicated = jax.sharding.NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=replicated)
    w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=replicated)
    lowered = jax.jit(lambda x, w: jnp.sum(jax.nn.softmax(jnp.tanh(x @ w), axis=-1) ** 2, 0)).lower(
        x, w
    )
    default, off = (
        gpu_target.compile(lowered, mesh, xla_gpu_autotune_level=level) for level in (4, 0)
    )
    assert default.as_text() != off.as_text()  # the level did take effect
    # The module line carries a fingerprint of the options; every other line, less its
    # backend_config, is the same, and the configs that differ are the empty emitter ones.
    strip = lambda text: re.sub(r", backend_config=\{.*$", "", text, flags=re.M).splitlines()[1:]  # noqa: E731
    assert strip(default.as_text()) == strip(off.as_text())
    for line_default, line_off in zip(
        default.as_text().splitlines()[1:], off.as_text().splitlines()[1:]
    ):
        if line_default != line_off:
            assert (
                '"native_emitter_backend_config":{"type":"NATIVE_EMITTER_TYPE_INVALID"'
                in line_default
            )
    for field in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes"):
        assert getattr(default.memory_analysis(), field) == getattr(off.memory_analysis(), field)


def abstract_state(view, llm, rows, slots, new_tokens):
    """The decode round's abstract state on `view`, laid out as the sampler lays it out."""
    return sampler.abstract_decode_state(
        sampler.cache_shape_for(
            llm.num_hidden_layers, rows, slots, llm.num_key_value_heads, llm.head_dim
        ),
        new_tokens,
        lambda shape, names: jax.sharding.NamedSharding(
            view, logical_spec(shape, names, view, mesh_lib.DECODE_RULES)
        ),
    )


@dataclasses.dataclass
class SamplerPrograms:
    refresh: object
    refresh_text: str
    prefill_text: str
    decode: object
    decode_text: str
    decode_program: hlo_stats.CompiledProgram  # with XLA:GPU's thunk sequence
    decode_weight_bytes: int
    decode_lowered: object
    layer_weight_shapes: set  # one layer's projection matrices (sorted dims, 1s dropped)
    decode_inputs: tuple  # decode_round's arguments after the graphdef (abstract)
    layer_cache_elements: int  # one layer's K (or V) cache on one device
    layers: int
    copy_graphdef: object  # the decode copy's


@pytest.fixture(scope="module")
def h100_sampler() -> SamplerPrograms:
    """Refresh, prefill and decode round of the tiny model on two H100s, replicated copy."""
    mesh = gpu_target.make_mesh("h100", 2)
    # The decode kernel named: "auto" decodes on the XLA path until the kernel passes on a GPU
    # (models/attention.py DECODE_KERNEL_IN_AUTO); these check the kernel's compiled layout.
    model_config = BagelConfig.tiny(llm=dict(compute_dtype="bfloat16", attention_backend="pallas"))
    llm = model_config.llm
    graphdef, params, rest = abstract_split(model_config, mesh)
    state = nnx.merge_state(params, rest)
    view = mesh_lib.decode_mesh(mesh, "replicated")
    options = gpu_target.compiler_options(view)
    copy_graphdef, copy = decode_copy.abstract_decode_copy(graphdef, state, view, jnp.bfloat16)
    refresh = decode_copy.cast_function(graphdef, state, view, jnp.bfloat16).lower(state)
    refresh_compiled, refresh_text = hlo_stats.compile_and_read(refresh, options)

    rows, prompt_len, patches, new_tokens = 4, 128, 64, 8  # 2 rows per device
    slots = sampler.cache_slots_for(prompt_len, new_tokens)

    def on_view(shape, dtype, names):
        spec = logical_spec(shape, names, view, mesh_lib.DECODE_RULES)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(view, spec))

    def rows_of(dtype, *tail):
        return on_view((rows,) + tail, dtype, ("act_batch",) + (None,) * len(tail))

    prompt = shaped_pack(
        [], pack_shapes.PackShape(prompt_len, patches, 0), rows, SPECIAL, [], fixed=True
    )
    prompt = jax.tree.map(lambda x: rows_of(x.dtype, *x.shape[1:]), prompt)
    rules = mesh_lib.DECODE_RULES
    with mesh_lib.use_mesh(view, rules):
        lowered = sampler.prefill_rows.lower(
            copy_graphdef, copy, prompt, new_tokens, slots, jnp.dtype(jnp.bfloat16), rules
        )
        _, prefill_text = hlo_stats.compile_and_read(lowered, options)
    decode_state = abstract_state(view, llm, rows, slots, new_tokens)
    cache = decode_state.cache
    key = sampler.abstract_key(view)
    settings = sampler.round_settings(SPECIAL, llm.vocab_size, new_tokens, 1.0, True)
    with mesh_lib.use_mesh(view, rules):
        lowered = sampler.decode_round.lower(
            copy_graphdef, copy, decode_state, key, rows_of(jnp.int32), settings, rules
        )
        decode_program = hlo_stats.compile_and_read_all(lowered, options)
    decode, decode_text = decode_program.compiled, decode_program.partitioned
    # The weights one decode step must read: the LM's layers, final norm and lm_head (of the
    # embedding table only the fed rows; the ViT not at all).
    lm = copy["language_model"]
    decode_weights = sum(
        x.size * x.dtype.itemsize
        for name in ("layers", "norm", "lm_head")
        for x in jax.tree.leaves(lm[name])
    )
    layer_shapes = {
        tuple(sorted(d for d in x.shape[1:] if d != 1))  # projections, not biases
        for path, x in jax.tree_util.tree_flatten_with_path(lm["layers"])[0]
        if "kernel" in jax.tree_util.keystr(path)
    }
    inputs = (copy, decode_state, key, rows_of(jnp.int32), settings, rules)
    local_cache = cache.sharding.shard_shape(cache.shape)
    return SamplerPrograms(
        refresh_compiled,
        refresh_text,
        prefill_text,
        decode,
        decode_text,
        decode_program,
        decode_weights,
        lowered,
        layer_shapes,
        inputs,
        int(np.prod(local_cache[1:])) // 2,  # a layer's keys and values side by side
        llm.num_hidden_layers,
        copy_graphdef,
    )


def big(found):
    return [c for c in found if any(np.prod(s.dims) > SMALL for s in c.operands + c.results)]


@pytest.mark.slow
def test_refresh_gathers_bf16_shards(h100_sampler):
    found = big(hlo_stats.collectives(h100_sampler.refresh_text))
    assert found and all(c.kind == "all-gather" and c.dtypes == {"bf16"} for c in found), found


@pytest.mark.slow
def test_prefill_on_the_replicated_copy_moves_nothing_between_devices(h100_sampler):
    found = big(hlo_stats.collectives(h100_sampler.prefill_text))
    assert not found, found


@pytest.mark.slow
def test_decode_round_moves_no_weight_and_reads_every_weight(h100_sampler):
    found = big(hlo_stats.collectives(h100_sampler.decode_text))
    assert not found, found
    kernels = hbm_traffic.loop_traffic(h100_sampler.decode.as_text())
    step_bytes = hbm_traffic.total_bytes(kernels)
    # Every weight on the decode path is read at least once per generated token, and the loop
    # is not hundreds of times the floor either (the counter counts each kernel once per step).
    weights = h100_sampler.decode_weight_bytes
    assert weights <= step_bytes < 100 * weights, (
        f"{step_bytes} bytes per step, weights {weights}:\n" + hbm_traffic.describe(kernels)
    )


def test_importing_opsd_jax_keeps_the_plugin_quiet_without_a_driver():
    """With the CUDA plugin installed and no NVIDIA driver, a bare jax start prints a cuInit
    traceback before falling back to the CPU; importing opsd_jax chooses the CPU up front."""
    import subprocess
    import sys

    import opsd_jax

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}

    def run(code):
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )

    guarded = run("import jax, opsd_jax; print(jax.devices()[0].platform)")
    if opsd_jax._no_nvidia_driver():
        assert "cuInit" in run("import jax; jax.devices()").stderr  # what the import avoids
        assert guarded.stdout.strip() == "cpu" and "cuInit" not in guarded.stderr, guarded.stderr
    else:  # a GPU machine: nothing is forced
        assert guarded.stdout.strip() == "gpu", guarded.stderr


def layer_weight_copies(compiled_text: str, layer_shapes: set) -> list:
    """Kernels of the decode loop that only copy data into a buffer shaped like one layer's
    weight matrix (a slice of the stacked weights, or q/k/v concatenated): per-token copies."""
    kernels = hbm_traffic.data_movement(hbm_traffic.loop_traffic(compiled_text))
    found = []
    for kernel in kernels:
        shapes = hlo_stats.shapes_in(kernel.result)
        dims = tuple(sorted(d for d in shapes[0].dims if d != 1)) if shapes else ()
        if dims in layer_shapes:
            found.append(kernel)
    return found


@pytest.mark.slow
def test_decode_loop_reads_the_weights_in_place(h100_sampler):
    """The sampler's XLA:GPU options (sampler.SAMPLER_COMPILER_OPTIONS): no kernel of the token
    loop copies a layer's weights. With XLA's defaults (Triton GEMMs, the dot merger) every token
    copies every layer's matrices (shown here, so the check can fail)."""
    copies = layer_weight_copies(h100_sampler.decode.as_text(), h100_sampler.layer_weight_shapes)
    assert not copies, hbm_traffic.describe(copies)
    defaults = {
        **gpu_target.DEVICELESS_OPTIONS,
        "xla_gpu_enable_triton_gemm": True,
        "xla_gpu_dot_merger_threshold_mb": 32,
    }
    with mesh_lib.use_mesh(
        mesh_lib.decode_mesh(gpu_target.make_mesh("h100", 2), "replicated"), mesh_lib.DECODE_RULES
    ):
        before = h100_sampler.decode_lowered.compile(compiler_options=defaults)
    copied = layer_weight_copies(before.as_text(), h100_sampler.layer_weight_shapes)
    assert len({k.result for k in copied}) >= 3, hbm_traffic.describe(copied)


def layer_cache_copies(compiled_text: str, layer_cache_elements: int) -> list:
    """Kernels of the decode loop that write a buffer the size of one layer's K or V cache (up
    to 2x: both, or one padded): a copy of the layer's slice of the stacked cache, made every
    token."""
    found = []
    for kernel in hbm_traffic.loop_traffic(compiled_text):
        if kernel.opcode == "custom-call":
            continue  # reads its operands; a library call's results are small here
        shapes = hlo_stats.shapes_in(kernel.result)
        if shapes and layer_cache_elements <= np.prod(shapes[0].dims) <= 2 * layer_cache_elements:
            found.append(kernel)
    return found


@pytest.mark.slow
def test_decode_attention_reads_the_cache_in_place(h100_sampler, monkeypatch):
    """On the GPU the decode step's attention reads the stacked cache in place, and nothing
    copies a layer's cache: the Pallas kernel (once per layer per token, up to each row's
    length) and, on the path 'auto' takes (models/attention.py DECODE_KERNEL_IN_AUTO), XLA's
    reduce fusions (DECODE_IN_PLACE_ON_GPU). XLA's einsums, as before, copy every layer's K and
    V slice each token: shown here, so the check can fail."""
    text = h100_sampler.decode.as_text()
    kernels = hbm_traffic.loop_traffic(text)
    calls = sum(k.count for k in kernels if k.kernel_name == decode_attention_pallas.KERNEL_NAME)
    assert calls == h100_sampler.layers, hbm_traffic.describe(kernels)
    copies = layer_cache_copies(text, h100_sampler.layer_cache_elements)
    assert not copies, hbm_traffic.describe(copies)

    graphdef, params, rest = abstract_split(
        BagelConfig.tiny(llm=dict(compute_dtype="bfloat16", attention_backend="auto")),
        gpu_target.make_mesh("h100", 2),
    )
    view = mesh_lib.decode_mesh(gpu_target.make_mesh("h100", 2), "replicated")
    graphdef, _ = decode_copy.abstract_decode_copy(
        graphdef, nnx.merge_state(params, rest), view, jnp.bfloat16
    )

    def xla_decode_copies():
        with mesh_lib.use_mesh(view, mesh_lib.DECODE_RULES):
            lowered = sampler.decode_round.lower(graphdef, *h100_sampler.decode_inputs)
            compiled, _ = hlo_stats.compile_and_read(lowered, gpu_target.compiler_options(view))
        text = compiled.as_text()
        assert decode_attention_pallas.KERNEL_NAME not in text  # 'auto': XLA's attention
        return layer_cache_copies(text, h100_sampler.layer_cache_elements), text

    copied, text = xla_decode_copies()
    assert not copied, hbm_traffic.describe(copied)
    with monkeypatch.context() as patch:
        patch.setattr(attention, "DECODE_IN_PLACE_ON_GPU", False)  # the einsums
        jax.clear_caches()  # the switch is read when tracing: trace the round again
        copied, text = xla_decode_copies()
    jax.clear_caches()  # no later trace reuses the einsums
    assert len(copied) >= 2, hbm_traffic.describe(hbm_traffic.loop_traffic(text))


def tensor_decode_round(model_config, devices, tensor, rows, slots, new_tokens):
    """The decode round of `model_config` in the 'tensor' layout, compiled for `devices` H100s
    with a tensor axis of `tensor`: (its program, the decode copy)."""
    llm = model_config.llm
    mesh = gpu_target.make_mesh("h100", devices)
    graphdef, params, rest = abstract_split(model_config, mesh)
    view = mesh_lib.decode_mesh(mesh, "tensor", tensor)
    graphdef, copy = decode_copy.abstract_decode_copy(
        graphdef, nnx.merge_state(params, rest), view, jnp.bfloat16
    )
    spec = logical_spec((rows,), ("act_batch",), view, mesh_lib.DECODE_RULES)
    tokens = jax.ShapeDtypeStruct(
        (rows,), jnp.int32, sharding=jax.sharding.NamedSharding(view, spec)
    )
    state = abstract_state(view, llm, rows, slots, new_tokens)
    key = sampler.abstract_key(view)
    settings = sampler.round_settings(SPECIAL, llm.vocab_size, new_tokens, 1.0, True)
    with mesh_lib.use_mesh(view, mesh_lib.DECODE_RULES):
        lowered = sampler.decode_round.lower(
            graphdef, copy, state, key, tokens, settings, mesh_lib.DECODE_RULES
        )
        program = hlo_stats.compile_and_read_all(lowered, gpu_target.compiler_options(view))
    return program, copy


def tensor_layout_attention_copies(slots: int, layers: int = 8) -> list:
    """The paper recipe's decode round in its 'tensor' layout, compiled for 8 H100s: tensor 4
    (one kv head and 8 of the 16 rows per device), `layers` of BAGEL-7B's layers, `slots` cache
    slots. The round's kernels that write a buffer the size of a layer's keys or values on a
    device: a copy of them out of the cache, every token. (8 layers by default: XLA's choice
    depends on the size of the cache it slices, and at 2 or 4 the one-sum scores were read in
    place; the values' copy at 7170 slots shows at 2 as at 8.)"""
    rows = 16
    config = BagelConfig.bagel_7b(
        llm=dict(compute_dtype="bfloat16", attention_backend="auto", num_hidden_layers=layers)
    )
    jax.clear_caches()  # the attention's form is chosen when the round is traced
    program, _ = tensor_decode_round(config, 8, 4, rows, slots, new_tokens=8)
    per_device = (rows // 2) * slots * config.llm.head_dim  # a layer's keys (or values)
    return layer_cache_copies(program.compiled.as_text(), per_device)


@pytest.mark.slow
def test_the_tensor_layouts_decode_attention_reads_the_cache_in_place(monkeypatch):
    """In the paper recipe's 'tensor' decode layout no kernel copies a layer's keys or values
    out of the cache, token after token. Two choices make it so (compiled for H100s, 2026-12-06),
    and each is shown to matter: with the scores in one sum (models/attention.py
    PER_QUERY_HEAD_SCORES_BELOW) each layer's keys were copied, and at the slot count before
    rounding (7170; sampler.cache_slots_for) each layer's values."""
    slots = sampler.cache_slots_for(6144, 1024, 1)  # the recipe's prompts, completions, skips
    assert slots == 7296
    copies = tensor_layout_attention_copies(slots)
    assert not copies, hbm_traffic.describe(copies)

    # The values' copy shows at 2 layers as at 8 (one a layer), and compiles in half the time.
    copies = tensor_layout_attention_copies(7170, layers=2)
    assert len(copies) >= 2, hbm_traffic.describe(copies)  # a layer's values, each layer

    with monkeypatch.context() as patch:
        patch.setattr(attention, "PER_QUERY_HEAD_SCORES_BELOW", 0)  # the scores in one sum
        copies = tensor_layout_attention_copies(slots)
    jax.clear_caches()  # no later trace reuses the one-sum form
    assert len(copies) >= 8, hbm_traffic.describe(copies)  # a layer's keys, each layer


def one_gpu_decode_traffic(layers: int) -> tuple[int, list]:
    """The one-GPU LoRA recipe's decode round (16 rows, 7296 slots: 4 kv heads and all the rows
    on one H100) with `layers` of BAGEL-7B's layers: (HBM bytes per token, the kernels that
    copy a layer's keys or values out of the cache)."""
    rows, slots = 16, sampler.cache_slots_for(6144, 1024, 1)
    config = BagelConfig.bagel_7b(
        llm=dict(compute_dtype="bfloat16", attention_backend="auto", num_hidden_layers=layers)
    )
    jax.clear_caches()  # the attention's form is chosen when the round is traced
    program, _ = tensor_decode_round(config, 1, 1, rows, slots, new_tokens=8)
    text = program.compiled.as_text()
    per_device = rows * slots * config.llm.num_key_value_heads * config.llm.head_dim
    return hbm_traffic.total_bytes(hbm_traffic.loop_traffic(text)), layer_cache_copies(
        text, per_device
    )


def test_one_gpus_decode_sums_the_values_in_chunks_of_slots(monkeypatch):
    """With 4 kv heads and 16 rows on one H100, the decode attention's output sums the slots in
    chunks (models/attention.py CHUNKED_VALUE_SUM_MIN_ROWS): XLA then writes no tree of partial
    sums and no f32 exp of the scores, about 50 MiB a layer and token (2026-12-06: 28 layers
    22.098 -> 20.743 GiB a token). Compiled both ways at 2 layers (49.4 MiB a layer saved;
    the 28 layers' figure is 49.6 a layer); neither copies the cache."""
    layers = 2
    chunked, copies = one_gpu_decode_traffic(layers)
    assert not copies, hbm_traffic.describe(copies)
    with monkeypatch.context() as patch:
        patch.setattr(attention, "CHUNKED_VALUE_SUM_MIN_ROWS", 10**9)  # one sum of the slots
        whole, copies = one_gpu_decode_traffic(layers)
    jax.clear_caches()  # no later trace reuses the one-sum form
    assert not copies, hbm_traffic.describe(copies)
    saved = (whole - chunked) / layers / 2**20
    assert saved > 40, f"{saved:.1f} MiB a layer and token ({whole} -> {chunked} bytes)"


@pytest.mark.slow
def test_the_tensor_layout_decode_reads_its_weights_in_place(h100_tensor_decode):
    """No kernel of the 'tensor' layout's decode loop copies a layer's weight shard out of the
    stacked layers. With the q/k/v bias folded into the cuBLAS call (a BIAS epilogue, which
    XLA's in-place dynamic-slice GEMM cannot take) the k and v weights were copied every token,
    every layer; Projection's `bias_apart` keeps the bias out of the call."""
    program, _, _, shard_shapes = h100_tensor_decode
    copies = layer_weight_copies(program.compiled.as_text(), shard_shapes)
    assert not copies, hbm_traffic.describe(copies)


@pytest.mark.slow
def test_a_decode_layer_runs_four_gemms(h100_tensor_decode):
    """The decode copy holds q/k/v as one projection and gate/up as another
    (qwen2_mot.fuse_projections): a layer's token runs 4 GEMMs (q/k/v, o, gate/up, down), plus
    the lm_head's one a token. With the projections apart it ran 7 a layer."""
    program = h100_tensor_decode[0]
    loop, _ = thunk_launches.main_loop(thunk_launches.parse(program.thunk_sequence))

    def gemms(thunks):
        return sum(
            (t.kind in ("kCublasLtMatmul", "kGemm")) + gemms(t.condition + t.children)
            for t in thunks
        )

    layers = BagelConfig.tiny().llm.num_hidden_layers
    assert gemms(loop.condition + loop.children) == 4 * layers + 1


@pytest.mark.slow
def test_decode_attention_is_two_kernels_a_layer(h100_tensor_decode):
    """A layer's decode attention is the split-K kernel, then the Pallas combine of its splits,
    one after the other: no pad of q before it (the kernel pads the query heads as it loads
    them) and no XLA fusions after it (the combine was an exp, a reduce and a convert)."""
    program = h100_tensor_decode[0]
    loop, _ = thunk_launches.main_loop(thunk_launches.parse(program.thunk_sequence))
    body = [t for t in loop.children if t.kind == "kCustomKernel"]
    names = [t.kernel_name for t in body]
    layers = BagelConfig.tiny().llm.num_hidden_layers
    attention = decode_attention_pallas.KERNEL_NAME
    combine = decode_attention_pallas.COMBINE_KERNEL_NAME
    at = [i for i, name in enumerate(names) if name == attention]
    assert len(at) == layers and names.count(combine) == layers, names
    for i in at:
        assert names[i + 1] == combine, names[i - 2 : i + 3]
        assert "pad" not in names[i - 1], names[i - 2 : i + 3]


@pytest.mark.slow
def test_a_decode_layer_writes_its_key_and_value_in_one_scatter(h100_tensor_decode):
    """The cache holds a slot's key and value side by side ([L, B, S, 2, Hkv, Dh]), so a layer
    writes the new token's pair with one scatter (two with separate K and V caches); the round's
    other two write each row's sampled token and its log-prob."""
    program = h100_tensor_decode[0]
    loop, _ = thunk_launches.main_loop(thunk_launches.parse(program.thunk_sequence))
    names = [t.kernel_name for t in loop.children if t.kind == "kCustomKernel"]
    layers = BagelConfig.tiny().llm.num_hidden_layers
    assert sum("scatter" in name for name in names) == layers + 2, names


def test_no_jax_plugin_at_all_means_no_cuda_plugin(monkeypatch):
    """With only requirements.txt (no jax plugin) the `jax_plugins` namespace is missing and
    find_spec raises: that is 'not installed', not an import error of opsd_jax."""
    import importlib.util

    import opsd_jax

    def missing(name, *args):
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(importlib.util, "find_spec", missing)
    assert opsd_jax.cuda_plugin_installed() is False
    assert gpu_target.plugin_available() is False


def launches_per_token(program) -> thunk_launches.Launches:
    return thunk_launches.per_iteration(
        program.thunk_sequence, program.thunk_metadata, program.compiled.as_text()
    )


def round_launches(h100_sampler, **overrides) -> thunk_launches.Launches:
    """Launches per token of h100_sampler's decode round compiled again with `overrides` on top
    of the target's options."""
    view = mesh_lib.decode_mesh(gpu_target.make_mesh("h100", 2), "replicated")
    with mesh_lib.use_mesh(view, mesh_lib.DECODE_RULES):
        program = hlo_stats.compile_and_read_all(
            h100_sampler.decode_lowered, {**gpu_target.compiler_options(view), **overrides}
        )
    return launches_per_token(program)


@pytest.mark.slow
def test_decode_round_is_one_graph_launch(h100_sampler):
    """With the sampler's XLA options (sampler.COMMAND_BUFFER_OPTIONS) and the decode step's
    layers unrolled (unroll_decode_layers), the whole token loop, stop test included, is one
    CUDA graph: nothing is launched and nothing waits on the host per token. Without command
    buffers every kernel of every layer is its own launch, and the data-dependent loop reads its
    predicate on the host every token (shown, so the check can fail)."""
    launches = launches_per_token(h100_sampler.decode_program)
    assert launches.launches == 0 and launches.host_syncs == 0, launches
    assert launches.graph_kernels >= 20 * h100_sampler.layers, launches
    unbuffered = round_launches(h100_sampler, xla_gpu_enable_command_buffer="")
    assert unbuffered.graph_launches == 0 and unbuffered.host_syncs == 1, unbuffered
    assert unbuffered.launches >= 20 * h100_sampler.layers, unbuffered


@pytest.mark.slow
def test_with_jax_0_11s_command_types_nccl_all_reduces_keep_the_round_one_graph(h100_sampler):
    """jax 0.11's XLA has no COLLECTIVES_KERNEL command type. Compiled with its types only, the
    stop test's all-reduce as a collective kernel (XLA's default) takes the token loop out of the
    graph: 4 launches and a host sync every token, as the GPU image's jax 0.11.2 compiled the
    sampler's round. With the all-reduces NCCL's (sampler.NCCL_ALL_REDUCES, the sampler's
    options on a jax before 0.12) the loop is one graph again."""
    types = sampler.COMMAND_BUFFER_KINDS_0_11
    split = round_launches(
        h100_sampler,
        xla_gpu_enable_command_buffer=types,
        xla_gpu_experimental_use_collective_kernels="COLLECTIVE_KERNEL_ALL_REDUCE",
    )
    assert split.launches > 0 and split.host_syncs == 1, split
    one_graph = round_launches(
        h100_sampler, xla_gpu_enable_command_buffer=types, **sampler.NCCL_ALL_REDUCES
    )
    assert one_graph.launches == 0 and one_graph.host_syncs == 0, one_graph
    assert one_graph.graph_kernels >= 20 * h100_sampler.layers, one_graph


@pytest.mark.slow
def test_the_engine_decode_chunk_is_one_graph_launch_and_moves_no_weight(h100_sampler):
    """The engine's decode chunk (opsd_jax/sampling/engine.py: the sampler's step over a pool of
    slots, each drawing from its own row's key) compiled for two H100s as the sampler's round
    is: one CUDA graph per token, nothing launched and no host sync per token, no weight moved
    between devices, and the pool's state written in place (donated)."""
    copy, decode_state, _, feed, settings, rules = h100_sampler.decode_inputs
    view = feed.sharding.mesh

    def sharding_for(shape, names):
        return jax.sharding.NamedSharding(view, logical_spec(shape, names, view, rules))

    pool = pool_programs.abstract_pool(decode_state, sharding_for)  # as the preflight makes it
    watched = jax.ShapeDtypeStruct(feed.shape, jnp.bool_, sharding=feed.sharding)
    with mesh_lib.use_mesh(view, rules):
        lowered = pool_programs.decode_chunk.lower(
            h100_sampler.copy_graphdef,
            copy,
            pool,
            "threefry2x32",
            settings,
            engine.CHUNK_STEPS,
            watched,
            rules,
        )
        program = hlo_stats.compile_and_read_all(lowered, gpu_target.compiler_options(view))
    launches = launches_per_token(program)
    assert launches.launches == 0 and launches.host_syncs == 0, launches
    assert launches.graph_kernels >= 20 * h100_sampler.layers, launches
    assert not big(hlo_stats.collectives(program.partitioned))
    assert "input_output_alias" in program.compiled.as_text()  # the pool, donated


@pytest.fixture(scope="module")
def h100_tensor_decode():
    """The tiny model's decode round on two H100s in the 'tensor' layout (tensor 2: one kv head
    per device, as the 7B recipe's tensor 4): (its program, rows, cache slots, the shapes of
    a layer's weight shards: each device's part of one layer's projections)."""
    # The decode kernel named: "auto" decodes on the XLA path until the kernel passes on a GPU
    # (models/attention.py DECODE_KERNEL_IN_AUTO); these check the kernel's compiled layout.
    model_config = BagelConfig.tiny(llm=dict(compute_dtype="bfloat16", attention_backend="pallas"))
    rows, new_tokens = 2, 8
    slots = sampler.cache_slots_for(128, new_tokens)
    program, copy = tensor_decode_round(model_config, 2, 2, rows, slots, new_tokens)
    shard_shapes = {
        tuple(sorted(d for d in x.sharding.shard_shape(x.shape)[1:] if d != 1))
        for path, x in jax.tree_util.tree_flatten_with_path(copy["language_model"]["layers"])[0]
        if "kernel" in jax.tree_util.keystr(path)
    }
    return program, rows, slots, shard_shapes


@pytest.mark.slow
def test_decode_round_on_the_tensor_layout_keeps_its_all_reduces_in_the_graph(h100_tensor_decode):
    """The 'tensor' layout all-reduces each layer's attention and MLP outputs (XLA's collective
    kernels): with COLLECTIVES_KERNEL among the command types they stay inside the round's one
    graph instead of splitting it around every all-reduce. The split-K decode attention runs
    rows x kv heads x splits programs (here 2 x 1 x 4)."""
    program, rows, slots, _ = h100_tensor_decode
    llm = BagelConfig.tiny().llm
    all_reduces = [c for c in hlo_stats.collectives(program.partitioned) if c.kind == "all-reduce"]
    assert all_reduces, "the tensor layout all-reduces per layer"
    launches = launches_per_token(program)
    assert launches.launches == 0 and launches.host_syncs == 0, launches
    thunks = thunk_launches.parse(program.thunk_sequence)
    grids = {k.grid for k in thunk_launches.kernels(thunks, decode_attention_pallas.KERNEL_NAME)}
    local_kv_heads = llm.num_key_value_heads // 2
    assert grids == {decode_attention_pallas.grid(rows, local_kv_heads, slots)}, grids


# The ViT's cuDNN calls compiled for an H100 (test below): {(custom call, [rows, patches] of
# its q operand, takes the [1, 1, 512, 512] mask): count}.
CUDNN_CALLS = {
    ("fmhaSoftmax", "1,512", False): 1,  # rows of one image: lengths, no mask
    ("fmhaSoftmaxBackward", "1,512", False): 1,
    ("fmhaSoftmax", "4,128", False): 1,  # each image a row of its own: lengths, no mask
    ("fmhaSoftmaxBackward", "4,128", False): 1,
    ("fmhaScaleBiasSoftmax", "1,512", True): 1,  # anything else: the dense mask
    ("fmhaScaleBiasSoftmaxBackward", "1,512", True): 1,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, kernels, padded",
    [
        ("pallas", {TRITON.strip('"')}, True),
        ("cudnn", {f"__cudnn${name}" for name, _, _ in CUDNN_CALLS}, False),
    ],
)
def test_the_vits_attention_on_its_own_backend_compiled_for_an_h100(backend, kernels, padded):
    """SigLIP's head dim 72 (one layer, two heads, forward and backward) on the ViT's backend
    (vit_attention_backend): the Pallas range kernel pads it to 128; cuDNN's fused attention
    takes it as it is, in three branches (models/attention_cudnn.py): rows of one image with
    their lengths and no mask array (fmhaSoftmax on [1, 512] rows), rows of images of up to
    128 patches each in a row of its own, with their lengths (fmhaSoftmax on [4, 128] rows),
    other rows with the dense mask as a bias (fmhaScaleBiasSoftmax, a [1, 1, 512, 512]
    operand)."""
    import re

    from models.configs import SiglipConfig
    from models.siglip import SiglipVisionEncoder

    mesh = gpu_target.make_mesh("h100", 1)
    config = SiglipConfig(
        hidden_size=144, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1
    )

    def make():
        return SiglipVisionEncoder(
            config,
            compute_dtype="bfloat16",
            attention_backend=backend,
            remat="none",
            image_patches=128,
            rngs=nnx.Rngs(0),
        )

    graphdef, abstract = mesh_lib.abstract_model(make, mesh)
    params = nnx.split_state(abstract, nnx.Param, ...)[0]
    rest = gpu_target.host_rest(make)
    replicated = jax.sharding.NamedSharding(mesh, P())
    patches = jax.ShapeDtypeStruct((1, 512, config.patch_dim), jnp.float32, sharding=replicated)
    ids = jax.ShapeDtypeStruct((1, 512), jnp.int32, sharding=replicated)

    def loss(params, patches, position_ids, image_ids):
        features = nnx.merge(graphdef, params, rest)(patches, position_ids, image_ids)
        return features.astype(jnp.float32).sum()

    with mesh_lib.use_mesh(mesh):
        lowered = jax.jit(jax.grad(loss)).lower(params, patches, ids, ids)
    text = gpu_target.compile(lowered, mesh).as_text()
    assert set(re.findall(r'custom_call_target="([^"]+)"', text)) == kernels
    assert bool(re.search(r"bf16\[1,512,2,128\]", text)) == padded
    operands = collections.Counter()
    for call in re.findall(r'.*custom_call_target="__cudnn\$fmha.*', text):
        name = re.search(r'custom_call_target="__cudnn\$(\w+)"', call).group(1)
        rows = re.search(r"operand_layout_constraints=\{bf16\[(\d+,\d+),2,72\]", call).group(1)
        operands[name, rows, "bf16[1,1,512,512]" in call] += 1
    if backend == "cudnn":
        assert operands == CUDNN_CALLS, operands
