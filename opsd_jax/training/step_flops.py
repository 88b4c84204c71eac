"""The FLOPs of one OPSD grad step, counted as MaxText counts them, and the MFU they make.

MFU (model FLOPs utilisation) is analytic model FLOPs per step over the step's time and the
devices' dense bf16 peak. Model FLOPs are the matmuls the model needs, not what the program
happens to execute: no remat recompute (a lighter remat makes the step faster and the MFU
higher, never lower), attention only over the query-key pairs the masks allow. HFU (hardware
FLOPs utilisation) counts what runs: the model FLOPs plus the remat re-forward.

Per step, for a pack of R rows of T positions (every position, padding included, as MaxText
counts a packed sequence: the step computes them all), with N the matmul weights a token or a
patch passes through (2 FLOPs per weight per token forward):

  LLM      forward 2·N·T per row; backward 2·N·T for the activations' gradient where a weight
           below or inside trains, and 2·N·T for the weights' own gradient where they train
           (full fine-tuning: 6·N per student token; LoRA's frozen base: 4·N; teacher: 2·N).
  attention  4·Hq·D per allowed pair and layer forward (QK^T and PV), 8·Hq·D backward; a
           pair is key j of query t with k_start[t] <= j < k_end[t] (causal text, whole
           image blocks both ways), summed from the pack's own ranges.
  lm_head  2·H·V per loss entry forward (logits only at the loss rows), as the LLM backward.
  ViT      every patch slot through the encoder's layers (patch embedding: no input gradient),
           its attention 4·Hv·Dv per pair within each image (every patch sees its image), the
           connector to the LLM's width.

The adapters' own matmuls (rank r) are not counted; embedding lookups, norms, RoPE and the loss
are not matmuls. tests/test_step_flops.py checks the count against the matmul FLOPs of the
compiled grad step (remat off, the dense attention backend, counted `dense`) on the tiny model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.configs import BagelConfig
from models.pack import Pack

# Dense bf16 FLOP/s by GPU (datasheets; SXM parts): the MFU's denominator, per device.
DENSE_BF16_PEAK = {"h100": 989e12, "h200": 989e12, "h800": 989e12}


def dense_peak(device_kind: str) -> float | None:
    """The dense bf16 peak of a jax device kind ('NVIDIA H100 80GB HBM3'), None if unknown."""
    kind = device_kind.lower()
    return next((peak for name, peak in DENSE_BF16_PEAK.items() if name in kind), None)


@dataclasses.dataclass(frozen=True)
class Trained:
    """Which matmul weights get a gradient (`weights`) and which groups hold anything trained
    (`any`): 'vit' (with the patch embedding), 'connector', 'llm' (the layers), 'lm_head'."""

    weights: frozenset = frozenset({"vit", "connector", "llm", "lm_head"})
    any: frozenset = frozenset({"vit", "connector", "llm", "lm_head"})

    @classmethod
    def of_split(cls, split) -> Trained:
        """From a run's TrainedSplit (run_config/trained_split.py): LoRA's adapters (on their
        targets), or the groups the freeze flags leave."""
        if split.adapters:
            held = {"vit": "vit_model", "connector": "connector", "llm": "layers"}
            targets = str(split.adapters.targets)
            adapted = {g for g, name in held.items() if name in targets}
            return cls(weights=frozenset(), any=frozenset(adapted))
        if "freeze_und" in split.frozen_flags:
            return cls(weights=frozenset({"lm_head"}), any=frozenset({"lm_head"}))
        groups = {"vit", "connector", "llm", "lm_head"}
        if "freeze_vit" in split.frozen_flags:
            groups.discard("vit")
        if "freeze_llm" in split.frozen_flags:
            groups -= {"llm", "lm_head"}
        return cls(weights=frozenset(groups), any=frozenset(groups))


# What lies below each group (nearer the input), whose training needs the group's input gradient;
# the LLM's own group counts for itself (its embedding and lower layers lie below each layer).
_BELOW = {
    "vit": {"vit"},  # the layers above the patch embedding (which never needs one)
    "connector": {"vit"},  # its first linear; the second has the first below it
    "connector_fc2": {"vit", "connector"},
    "llm": {"vit", "connector", "llm"},
    "lm_head": {"vit", "connector", "llm"},
}


def _passes(trained: Trained | None, group: str) -> int:
    """Multiples of a forward pass a group's matmuls run in the step: 1 (forward), + 1 for the
    input gradient, + 1 for the weights' gradient. `trained` None: a forward alone."""
    if trained is None:
        return 1
    weights = group.split("_fc")[0] in trained.weights
    return 1 + bool(trained.any & _BELOW[group]) + weights


def _attention_passes(trained: Trained | None, group: str) -> int:
    """The attention has no weights: forward, and a backward of twice its FLOPs (dQ, dK, dV,
    dP) whenever a gradient flows through it."""
    return 1 if trained is None or not trained.any & _BELOW[group] else 3


# What a remat policy (models/layers.REMAT_POLICIES) reruns of a layer's forward in the
# backward: (its matmuls, its attention). 'dots' and 'dots_no_batch' keep the projections'
# outputs but not the attention's (a kernel, or batched dots); 'minimal_flash' keeps both.
RERUN = {
    "none": (False, False),
    "full": (True, True),
    "dots": (False, True),
    "dots_no_batch": (False, True),
    "minimal_flash": (False, False),
}


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """A step's FLOPs by part (model FLOPs, no remat) and the remat re-forward on top."""

    parts: dict  # name -> FLOPs
    remat: float  # re-forward FLOPs the program runs on top (HFU's extra)

    @property
    def model(self) -> float:
        return float(sum(self.parts.values()))

    @property
    def executed(self) -> float:
        return self.model + self.remat

    def __add__(self, other: StepFlops) -> StepFlops:
        keys = self.parts.keys() | other.parts.keys()
        parts = {k: self.parts.get(k, 0.0) + other.parts.get(k, 0.0) for k in keys}
        return StepFlops(parts=parts, remat=self.remat + other.remat)


def utilisation(flops: float, seconds: float, peak: float, devices: int = 1) -> float:
    """MFU (model FLOPs) or HFU (executed FLOPs): FLOP/s over the devices' dense peak."""
    return flops / seconds / (peak * devices)


@dataclasses.dataclass(frozen=True)
class PackCounts:
    """What a pack's FLOPs depend on: its positions (rows x row length: every one computed), the
    LLM's query-key pairs, the ViT's patch slots and patch pairs, the loss entries."""

    tokens: int
    llm_pairs: int
    patches: int = 0
    vit_pairs: int = 0
    loss_entries: int = 0


def counts_of(pack: Pack, dense: bool = False) -> PackCounts:
    """A pack's counts (any leading axes: micro-batches stacked are counted together). The pairs
    are those its ranges allow (each real query's [k_start, k_end); each image's patches with
    each other), or with `dense` every [query, key] pair of a row and every patch pair of a
    row's patch slots (what the dense `reference` backend computes)."""
    segment = np.asarray(pack.segment_ids)
    segment = segment.reshape(-1, segment.shape[-1])
    rows, length = segment.shape
    if dense:
        llm_pairs = rows * length * length
    else:
        span = np.asarray(pack.k_end, np.int64) - np.asarray(pack.k_start, np.int64)
        span = span.reshape(segment.shape)
        llm_pairs = int(np.sum(np.where(segment > 0, np.maximum(span, 0), 0)))
    patches = vit_pairs = 0
    if pack.has_images:
        ids = np.asarray(pack.vit_image_ids)
        ids = ids.reshape(-1, ids.shape[-1])
        patches = ids.size
        if dense:
            vit_pairs = ids.shape[0] * ids.shape[1] ** 2
        else:
            for row in ids:
                _, sizes = np.unique(row[row > 0], return_counts=True)
                vit_pairs += int(np.sum(sizes.astype(np.int64) ** 2))
    entries = 0 if pack.loss_rows is None else int(np.asarray(pack.loss_rows).size)
    return PackCounts(rows * length, int(llm_pairs), int(patches), int(vit_pairs), entries)


def forward_flops(
    config: BagelConfig,
    counts: PackCounts,
    trained: Trained | None = None,
    *,
    remat: str = "none",
    vit_remat: str = "same",
) -> StepFlops:
    """One pack's FLOPs through the model: a forward alone (`trained` None: the teacher) or a
    forward and the backward that `trained` asks for (the student). `remat`: the LLM's policy,
    `vit_remat` the ViT's ('same': the LLM's); what each reruns in the backward is counted
    apart (`RERUN`)."""
    llm, vit = config.llm, config.vit
    tokens, llm_pairs, vit_pairs = counts.tokens, counts.llm_pairs, counts.vit_pairs
    heads_dim = llm.num_attention_heads * llm.head_dim
    layer_weights = llm.hidden_size * (heads_dim * 2 + 2 * llm.num_key_value_heads * llm.head_dim)
    layer_weights += 3 * llm.hidden_size * llm.intermediate_size
    parts = {
        "llm_matmul": 2.0
        * layer_weights
        * llm.num_hidden_layers
        * tokens
        * _passes(trained, "llm"),
        "llm_attention": 4.0
        * heads_dim
        * llm.num_hidden_layers
        * llm_pairs
        * _attention_passes(trained, "llm"),
    }
    # Remat reruns part of each layer's forward in the backward, wherever a backward runs
    # through the layers.
    llm_rerun = RERUN[remat] if trained is not None else (False, False)
    vit_rerun = RERUN[remat if vit_remat == "same" else vit_remat] if trained is not None else None
    remat_flops = 0.0
    if _passes(trained, "llm") > 1:
        remat_flops += llm_rerun[0] * parts["llm_matmul"] / _passes(trained, "llm")
        remat_flops += llm_rerun[1] * parts["llm_attention"] / _attention_passes(trained, "llm")
    if counts.loss_entries:
        parts["lm_head"] = (
            2.0
            * llm.hidden_size
            * llm.vocab_size
            * counts.loss_entries
            * _passes(trained, "lm_head")
        )
    if counts.patches:
        patches = counts.patches
        vit_width = vit.hidden_size
        vit_layer = 4 * vit_width * vit_width + 2 * vit_width * vit.intermediate_size
        embed = 3 * vit.patch_size**2 * vit_width
        embed_passes = 1 if trained is None else 1 + ("vit" in trained.weights)
        parts["vit_matmul"] = (
            2.0
            * patches
            * (vit_layer * vit.num_hidden_layers * _passes(trained, "vit") + embed * embed_passes)
        )
        parts["vit_attention"] = (
            4.0 * vit_width * vit.num_hidden_layers * vit_pairs * _attention_passes(trained, "vit")
        )
        parts["connector"] = (
            2.0
            * patches
            * llm.hidden_size
            * (
                vit_width * _passes(trained, "connector")
                + llm.hidden_size * _passes(trained, "connector_fc2")
            )
        )
        if vit_rerun is not None and _passes(trained, "vit") > 1:
            remat_flops += vit_rerun[0] * 2.0 * patches * vit_layer * vit.num_hidden_layers
            remat_flops += vit_rerun[1] * parts["vit_attention"] / _attention_passes(trained, "vit")
    return StepFlops(parts=parts, remat=remat_flops)


def opsd_step_flops(
    config: BagelConfig,
    student: Pack | PackCounts,
    teacher: Pack | PackCounts | None,
    trained: Trained = Trained(),
    *,
    remat: str = "none",
    vit_remat: str = "same",
    dense: bool = False,
    teacher_config: BagelConfig | None = None,
) -> StepFlops:
    """One OPSD step's packs (micro-batches stacked or not): the student's forward and backward,
    the teacher's forward (None: a teacher that needs no forward, e.g. an offline cache) at
    `teacher_config`'s shapes (a checkpoint teacher's; default: the student's)."""
    count = lambda p: p if isinstance(p, PackCounts) else counts_of(p, dense)  # noqa: E731
    flops = forward_flops(config, count(student), trained, remat=remat, vit_remat=vit_remat)
    if teacher is not None:
        flops = flops + forward_flops(teacher_config or config, count(teacher), None)
    return flops


def step_model_flops(
    mode: str,
    config: BagelConfig,
    counts: tuple,
    trained: Trained,
    *,
    remat: str = "none",
    vit_remat: str = "same",
    teacher_config: BagelConfig | None = None,
) -> StepFlops:
    """A training step's FLOPs from its packs' counts (`StepBatches.pack`'s, in its packs'
    order): OPSD's student and teacher (at `teacher_config`'s shapes, a checkpoint teacher's),
    SFT's one pack, offline's text-only pack (its teacher is the cache: no forward)."""
    if mode == "opsd":
        return opsd_step_flops(
            config,
            counts[0],
            counts[1],
            trained,
            remat=remat,
            vit_remat=vit_remat,
            teacher_config=teacher_config,
        )
    return forward_flops(config, counts[0], trained, remat=remat, vit_remat=vit_remat)
