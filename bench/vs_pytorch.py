"""Our compiled OPSD train step against the PyTorch Visual-OPSD trainer's step, same case.

The case (issue #18): the ~64M BAGEL of the benches (`BagelConfig.small_64m()`), one sample per
step as the PyTorch trainer takes it, a student pack of 410 tokens ([system, problem image
12x16 patches, question, completion]) and a teacher pack of 832 tokens (the same plus the
reference intro, a 16x24-patch VT image and the transition), a 128-token completion (129 loss
entries with the closing EOS). One step = student forward + backward, EMA-teacher forward,
generalized JSD at the paper's settings (beta 0.5, temperature 1, teacher top-k 256, entry
clip 0.05, ce_weight 0), grad-norm clip, AdamW, EMA update.

Our side is `opsd_jax.training.train_step.make_train_step`'s compiled, donated step (what train.py
runs). The PyTorch side imports BAGEL's model (`modeling.bagel`) and the trainer's loss
(`scripts.visual_opsd.opsd_loss`) and checkpoint policy (`train.fsdp_utils`) from a user's
checkout of TiezMind/Visual-OPSD (which carries BAGEL's modeling code) given by
`--pytorch-bagel DIR`, copies our weights into it, and runs the trainer's per-micro-batch
sequence (train_visual_opsd.py) without FSDP: activation checkpointing on every decoder / ViT
layer and the connector (non-reentrant), `torch.amp.autocast('cuda')` is a no-op on a CPU so
it computes in fp32, AdamW(0.9, 0.95, eps 1e-15, no weight decay), the EMA update as
`fsdp_ema_update` does it. Patched in the imported modules, in this process only, so that
code (written for transformers 4.49 and CUDA) runs here: `einops` (imported by the VAE, which
is never built) is stubbed when missing; transformers 5's missing 'default' RoPE initialiser
and `pad_token_id` are supplied; the attention (which casts q/k/v to bf16 and asks for the
CUDA-only memory-efficient SDPA kernel) runs SDPA in fp32 with the default kernel choice.
The model has the trainer's default layer (`Qwen2MoTDecoderLayer`, so it carries the gen
expert's weights, which see no token and get zero gradients but are still updated by AdamW, as
in the trainer).

Both sides start from the same weights, so the first step's JSD must agree (printed on both
sides). Timing alternates (ours, PyTorch, ours, PyTorch, ...) in one process; each line gives
seconds per step as wall time and as this process's CPU time (less sensitive to other load).
tokens/s counts the student + teacher pack tokens (410 + 832).

    python bench/vs_pytorch.py --pytorch-bagel /path/to/Visual-OPSD [--steps 3] [--rounds 2]
    python bench/vs_pytorch.py                      # our figures only (comparison skipped)
    python bench/vs_pytorch.py --compute-dtype bfloat16 --multiple 128   # other settings
    python bench/vs_pytorch.py --layers 2 --steps 1 --rounds 1   # a quick look (2 LM layers)

Our runtime choices default to the CPU default config's (configs/smoke.py: compute dtype,
remat, unrolled layers), except the attention backend: `dense`, the fastest on a CPU for this
case's one sample per row (the toy's multi-sample rows keep `chunked`, which skips the blocks
between samples).
`--multiple` rounds our pack shapes up (row tokens, patches, loss entries) as the config's
derived sizes are (128); the default 8 keeps them within a few tokens of the content.

One script of over 500 lines: both trainers' set-up on the same case and weights, side by side,
so the comparison is read in one place.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import os
import sys
import time
import types

import jax
import numpy as np
from flax import nnx

from configs import smoke
from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax import run_config
from opsd_jax.data.image_transform import VitImageInputs, vit_position_ids
from opsd_jax.data.opsd_packs import build_training_packs
from opsd_jax.data.pack_shapes import PackShape, round_up
from opsd_jax.data.packing import SpecialTokens
from opsd_jax.io import hf_export, hf_layout
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.training import train_step

STUDENT_TOKENS, TEACHER_TOKENS, COMPLETION = 410, 832, 128
OPTIMIZER = types.SimpleNamespace(
    lr=1e-5,
    min_lr=1e-7,
    warmup_steps=0,
    total_steps=1000,
    lr_scheduler="constant",
    beta1=0.9,
    beta2=0.95,
    eps=1e-15,
    max_grad_norm=1.0,
)
EMA_DECAY = 0.995


def build_case(vocab: int, multiple: int):
    """(student Pack, teacher Pack) of one sample: 410 and 832 tokens, rows rounded up to
    `multiple`."""
    rng = np.random.default_rng(0)
    special = SpecialTokens(vocab - 4, vocab - 3, vocab - 2, vocab - 1)

    def encode(text):  # a character per id: only the lengths matter
        return [32 + ord(c) % 900 for c in text]

    def image(h, w):
        patches = rng.uniform(-1, 1, (h * w, 588)).astype(np.float32)
        return VitImageInputs(patches, vit_position_ids(h, w), h, w)

    # Text lengths chosen so the packs hold exactly 410 and 832 tokens.
    sample = types.SimpleNamespace(
        pid="s0",
        question="q" * 62,
        answer="A",
        thoughts=["t"],
        problem_image=image(12, 16),
        vt_images=[image(16, 24)],
    )
    completion = rng.integers(10, 1000, COMPLETION).tolist()
    options = run_config.prompt_options(
        dict(system_prompt="a" * 20, reference_intro="c" * 20, transition_prompt="d" * 12)
    )
    exact = build_training_packs(
        [sample], [completion], encode, options, special, num_rows=1, max_forward_tokens=4096
    )
    sizes = {}
    for name, pack in (("student", exact.student), ("teacher", exact.teacher)):
        content = (
            int((pack.segment_ids > 0).sum()),
            int((pack.vit_slots >= 0).sum()),
            int(pack.loss_mask.sum()),
        )
        sizes[name] = [PackShape(*(round_up(n, multiple) for n in content))]
    packs = build_training_packs(
        [sample],
        [completion],
        encode,
        options,
        special,
        num_rows=1,
        max_forward_tokens=4096,
        shapes=sizes,
    )
    tokens = [int((p.segment_ids > 0).sum()) for p in (packs.student, packs.teacher)]
    assert tokens == [STUDENT_TOKENS, TEACHER_TOKENS], tokens
    return packs.student, packs.teacher


# --------------------------------------------------------------------------------- our side


class Ours:
    def __init__(self, args):
        config = BagelConfig.small_64m().replace(
            llm=dict(
                compute_dtype=args.compute_dtype,
                remat=args.remat,
                attention_backend=args.attention_backend,
                unroll_layers=bool(args.unroll_layers),
                attention_block=args.attention_block,
                num_hidden_layers=args.layers,
            )
        )
        self.config = config
        self.mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
        model = mesh_lib.create_sharded_model(lambda: Bagel(config, rngs=nnx.Rngs(0)), self.mesh)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        # A host copy for the PyTorch side, taken before our step donates the params.
        self.host_params = {k: np.array(v) for k, v in hf_export.flat_params(params).items()}
        self.host_params.update({k: np.array(v) for k, v in hf_export.flat_params(rest).items()})
        student, teacher = build_case(config.llm.vocab_size, args.multiple)
        self.packs = (student, teacher)
        optimizer = train_step.make_optimizer(OPTIMIZER)
        rng = jax.random.key(0)
        abstract = train_step.abstract_state(
            jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
            ),
            optimizer,
            "ema",
            rng,
        )
        self.state = jax.device_put(
            train_step.init_state(params, optimizer, "ema", rng), train_step.shardings_of(abstract)
        )
        step = train_step.make_train_step(
            train_step.make_opsd_loss(
                graphdef, rest, run_config.loss_settings({"samples_per_micro_batch": 1}), "ema"
            ),
            optimizer,
            teacher_mode="ema",
            ema_decay=EMA_DECAY,
            schedule=train_step.learning_rate_schedule(OPTIMIZER),
            state_shardings=train_step.shardings_of(abstract),
        )
        with mesh_lib.use_mesh(self.mesh):
            self.batch = tuple(distributed.put_micro_batches([p], self.mesh) for p in self.packs)
            t0 = time.perf_counter()
            self.compiled = step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0

    def describe(self):
        s, t = self.packs
        llm = self.config.llm
        tile = (
            f" (tile {llm.attention_block})" if llm.attention_backend in ("auto", "chunked") else ""
        )
        return (
            f"ours: m64 ({llm.num_hidden_layers} LM layers), {llm.compute_dtype}, "
            f"remat {llm.remat}, attention "
            f"{llm.attention_backend}{tile}, "
            f"{'un' if llm.unroll_layers else ''}rolled layers, "
            f"student row "
            f"{s.tokens.shape[1]} tokens / {s.vit_patches.shape[1]} patches, teacher row "
            f"{t.tokens.shape[1]} / {t.vit_patches.shape[1]}, {t.loss_mask.shape[1]} loss "
            f"entries; compile {self.compile_s:.1f} s"
        )

    def step(self):
        self.state, metrics = self.compiled(self.state, self.batch)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}


# ----------------------------------------------------------------------------- PyTorch side


def import_pytorch_bagel(directory: str):
    """The BAGEL model classes, the trainer's loss and checkpoint policy from a checkout."""
    # The upstream checkout is not an installable package: its modules import each other as
    # top-level `modeling`, `data`, ... from the checkout's root.
    sys.path.insert(0, os.path.abspath(directory))
    if importlib.util.find_spec("einops") is None:
        # Only modeling/autoencoder.py (the VAE, never built here) needs it.
        stub = types.ModuleType("einops")
        stub.rearrange = lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("einops"))
        sys.modules["einops"] = stub
    import torch
    from modeling.bagel import Bagel as TorchBagel
    from modeling.bagel import BagelConfig as TorchBagelConfig
    from modeling.bagel import Qwen2Config as TorchQwen2Config
    from modeling.bagel import (
        Qwen2ForCausalLM,
        SiglipVisionConfig,
        SiglipVisionModel,
        qwen2_navit,
        siglip_navit,
    )
    from scripts.visual_opsd.opsd_loss import compute_student_kd_loss

    from train.fsdp_utils import grad_checkpoint_check_fn

    # On a CPU: no CUDA-only SDPA kernel, and attention in fp32. Upstream casts q/k/v (and the
    # mask) `.to(torch.bfloat16)` for the GPU kernels and relies on CUDA autocast for the o_proj
    # after them; here those two modules see a `torch` whose bfloat16 is float32, so the whole
    # step is fp32 like ours (and the first step's JSD agrees to fp32 rounding).
    class Fp32Torch(types.ModuleType):
        bfloat16 = torch.float32

        def __getattr__(self, name):
            return getattr(torch, name)

    for module in (qwen2_navit, siglip_navit):
        module.torch = Fp32Torch("torch")
    qwen2_navit.sdpa_kernel = lambda *a, **k: contextlib.nullcontext()

    # transformers 5 dropped the 'default' RoPE initialiser that BAGEL's Qwen2 (written for
    # transformers 4.49) looks up: plain RoPE, 1 / theta^(2i / head_dim), scaling 1.
    def default_rope(config, device=None, **_):
        dim = config.hidden_size // config.num_attention_heads
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim
        return 1.0 / (config.rope_theta**exponent), 1.0

    from modeling.qwen2 import modeling_qwen2

    modeling_qwen2.ROPE_INIT_FUNCTIONS = {
        **modeling_qwen2.ROPE_INIT_FUNCTIONS,
        "default": default_rope,
    }
    return types.SimpleNamespace(
        torch=torch,
        Bagel=TorchBagel,
        BagelConfig=TorchBagelConfig,
        Qwen2Config=TorchQwen2Config,
        Qwen2ForCausalLM=Qwen2ForCausalLM,
        SiglipVisionConfig=SiglipVisionConfig,
        SiglipVisionModel=SiglipVisionModel,
        loss=compute_student_kd_loss,
        check_fn=grad_checkpoint_check_fn,
    )


def hf_state_dict(host_params: dict, config) -> dict:
    """Our params under BAGEL's key names and layouts (the table in opsd_jax/io/hf_layout.py)."""
    out = {}
    for rule in hf_layout.MAPPING:
        if rule.target is None or rule.target not in host_params:
            continue
        value = host_params[rule.target]
        if rule.per_layer:
            for layer in range(value.shape[0]):
                out[rule.key(layer)] = rule.transform.to_hf(value[layer])
        else:
            out[rule.key()] = rule.transform.to_hf(value)
    return out


def torch_batch(pack, torch):
    """Row 0 of a Pack (one sample) as BAGEL's packed-batch dict (nested-mask attention)."""
    length = int((pack.segment_ids[0] > 0).sum())
    slots = pack.vit_slots[0]
    patch = slots >= 0
    vit_index = slots[patch]
    text_index = np.setdiff1d(np.arange(length), vit_index)
    rows = np.arange(length)
    allowed = (rows[None, :] >= pack.k_start[0, :length, None]) & (
        rows[None, :] < pack.k_end[0, :length, None]
    )
    mask = np.where(allowed, 0.0, -np.inf).astype(np.float32)
    image_ids = pack.vit_image_ids[0][patch]
    loss = pack.loss_mask[0]
    long = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.long)  # noqa: E731
    return dict(
        sequence_length=length,
        sample_lens=[length],
        packed_text_ids=long(pack.tokens[0][text_index]),
        packed_text_indexes=long(text_index),
        packed_position_ids=long(pack.positions[0, :length]),
        nested_attention_masks=[torch.as_tensor(mask)],
        packed_vit_tokens=torch.as_tensor(pack.vit_patches[0][patch]),
        packed_vit_token_indexes=long(vit_index),
        packed_vit_position_ids=long(pack.vit_pos_ids[0][patch]),
        vit_token_seqlens=torch.as_tensor(np.bincount(image_ids)[1:], dtype=torch.int),
        ce_loss_indexes=long(pack.loss_rows[0][loss]),
        packed_label_ids=long(pack.loss_targets[0][loss]),
    )


class PyTorch:
    def __init__(self, directory, ours: Ours):
        tb = import_pytorch_bagel(directory)
        self.tb, torch = tb, tb.torch
        llm, vit = ours.config.llm, ours.config.vit
        llm_config = tb.Qwen2Config(
            vocab_size=llm.vocab_size,
            hidden_size=llm.hidden_size,
            intermediate_size=llm.intermediate_size,
            num_hidden_layers=llm.num_hidden_layers,
            num_attention_heads=llm.num_attention_heads,
            num_key_value_heads=llm.num_key_value_heads,
            rms_norm_eps=llm.rms_norm_eps,
            rope_theta=llm.rope_theta,
            max_position_embeddings=llm.max_position_embeddings,
            tie_word_embeddings=False,
        )
        # What build_bagel_model sets in code.
        llm_config.layer_module, llm_config.qk_norm = "Qwen2MoTDecoderLayer", True
        llm_config.freeze_und = False
        llm_config.pad_token_id = None  # transformers 5 no longer defaults it; BAGEL reads it
        vit_config = tb.SiglipVisionConfig(
            hidden_size=vit.hidden_size,
            intermediate_size=vit.intermediate_size,
            num_attention_heads=vit.num_attention_heads,
            num_hidden_layers=vit.num_hidden_layers,
            patch_size=vit.patch_size,
            image_size=vit.image_size,
            num_channels=vit.num_channels,
            hidden_act=vit.hidden_act,
            layer_norm_eps=vit.layer_norm_eps,
        )
        vit_config.rope = False
        language_model = tb.Qwen2ForCausalLM(llm_config)
        language_model.init_moe()
        config = tb.BagelConfig(
            visual_gen=False,
            visual_und=True,
            llm_config=llm_config,
            vit_config=vit_config,
            vae_config=None,
            vit_max_num_patch_per_side=ours.config.vit_max_num_patch_per_side,
            connector_act="gelu_pytorch_tanh",
            interpolate_pos=False,
        )
        model = tb.Bagel(language_model, tb.SiglipVisionModel(vit_config), config)
        model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
        state = {
            k: torch.as_tensor(np.ascontiguousarray(v, np.float32))
            for k, v in hf_state_dict(ours.host_params, ours.config).items()
        }
        missing, unexpected = model.load_state_dict(state, strict=False)
        # Left at init: the gen expert (copied from und by init_moe before the load; it sees
        # no token) and any buffer BAGEL recomputes.
        missing = [k for k in missing if "moe_gen" not in k and "rotary_emb" not in k]
        if missing or unexpected:
            raise RuntimeError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
        model = model.float()
        self.ema = copy.deepcopy(model)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
            check_fn=tb.check_fn,
        )
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=OPTIMIZER.lr,
            betas=(OPTIMIZER.beta1, OPTIMIZER.beta2),
            eps=OPTIMIZER.eps,
            weight_decay=0,
        )
        self.batches = [torch_batch(p, torch) for p in ours.packs]

    def describe(self):
        return (
            f"PyTorch: BAGEL from the checkout, torch {self.tb.torch.__version__}, "
            f"{self.tb.torch.get_num_threads()} threads, fp32, activation checkpointing"
        )

    def step(self):
        torch, tb = self.tb.torch, self.tb
        model, ema = self.model, self.ema
        student_batch, teacher_batch = self.batches
        self.optimizer.zero_grad(set_to_none=True)
        model.train()
        student_logits = model(**student_batch, return_logits=True)["logits"]
        ema.train()
        with torch.no_grad():
            teacher_logits = ema(**teacher_batch, return_logits=True)["logits"]
        jsd = tb.loss(
            student_logits,
            teacher_logits,
            loss_kind="jsd",
            beta=0.5,
            temperature=1.0,
            top_k=256,
            token_clip=0.05,
        )
        jsd.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER.max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():  # fsdp_ema_update: ema = decay * ema + (1 - decay) * new
            ema_params, new_params = list(ema.parameters()), list(model.parameters())
            torch._foreach_mul_(ema_params, EMA_DECAY)
            torch._foreach_add_(ema_params, new_params, alpha=1 - EMA_DECAY)
        return {"jsd": float(jsd.detach()), "grad_norm": float(grad_norm)}


# ------------------------------------------------------------------------------------- main


def timed(side, steps):
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        side.step()
    return (time.perf_counter() - wall0) / steps, (time.process_time() - cpu0) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--pytorch-bagel",
        default=None,
        help="a checkout of TiezMind/Visual-OPSD (BAGEL's torch model + trainer)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    # Defaults: the CPU default config's runtime choices (configs/smoke.py).
    cpu = smoke.get_config()
    parser.add_argument("--compute-dtype", default=cpu.compute_dtype)
    parser.add_argument("--remat", default=cpu.remat)
    # Except the attention: this case has one sample per row (as the PyTorch trainer takes it),
    # where `dense` is the fastest CPU backend; the toy config's rows pack several samples and
    # keep `chunked` (models/attention.py). `--attention-backend auto` gives the toy default's.
    parser.add_argument("--attention-backend", default="dense")
    parser.add_argument("--unroll-layers", type=int, default=int(cpu.unroll_layers))
    parser.add_argument("--attention-block", type=int, default=cpu.attention_block)
    parser.add_argument("--multiple", type=int, default=8)
    parser.add_argument(
        "--layers",
        type=int,
        default=BagelConfig.small_64m().llm.num_hidden_layers,
        help="LM layers of both sides (default: the 64M model's; fewer for a quick look)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch.set_num_threads (0: torch's default, one per core)",
    )
    args = parser.parse_args()

    tokens = STUDENT_TOKENS + TEACHER_TOKENS
    ours = Ours(args)
    sides = {"ours": ours}
    if args.pytorch_bagel:
        sides["pytorch"] = PyTorch(args.pytorch_bagel, ours)
        if args.torch_threads:
            sides["pytorch"].tb.torch.set_num_threads(args.torch_threads)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs; case: "
        f"student {STUDENT_TOKENS} + teacher {TEACHER_TOKENS} tokens, {COMPLETION}-token "
        f"completion"
    )
    for side in sides.values():
        print("  " + side.describe())
    # First step from the shared initial weights: the same case gives the same JSD.
    for name, side in sides.items():
        first = side.step()
        print(f"  {name} step 1: jsd {first['jsd']:.6f}, grad_norm {first['grad_norm']:.6f}")
    results = {name: [] for name in sides}
    for round_ in range(args.rounds):
        for name, side in sides.items():
            wall, cpu = timed(side, args.steps)
            results[name].append((wall, cpu))
            print(
                f"  round {round_ + 1} {name:>7}: {wall:.3f} s per step ({cpu:.3f} CPU s), "
                f"{tokens / wall:.0f} tokens/s"
            )
    best = {name: min(r) for name, r in results.items()}
    wall, cpu = best["ours"]
    print(
        f"ours (best round): {wall:.3f} s per step ({cpu:.3f} CPU s), {tokens / wall:.0f} tokens/s"
    )
    if "pytorch" not in best:
        print("PyTorch comparison skipped (no --pytorch-bagel DIR)")
        return
    torch_wall, torch_cpu = best["pytorch"]
    print(
        f"PyTorch (best round): {torch_wall:.3f} s per step ({torch_cpu:.3f} CPU s), "
        f"{tokens / torch_wall:.0f} tokens/s"
    )
    print(f"speed-up ours / PyTorch: {torch_wall / wall:.2f}x wall, {torch_cpu / cpu:.2f}x CPU")


if __name__ == "__main__":
    main()
