"""Training FLOPs of a spec, counted from the model description the memory estimator uses (issue 29).

The time model (:mod:`trainer_core.time_estimate`) divides this work by a device's rate; the count is
exact for the rule below, which is the standard one (Kaplan et al. 2020, "Scaling Laws for Neural
Language Models", Sec. 2.1; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters", Sec. 5.1), extended to what adapters and checkpointing change:

* **Linear layers** (every ``nn.Linear`` / GPT-2 ``Conv1D`` of :attr:`ModelStructure.linears`, the heads
  included): ``2*in*out`` per token forward. Backward computes the input's gradient (``2*in*out``)
  through every layer, trainable or frozen, since LoRA and QLoRA train adapters inside every layer;
  and the weight's gradient (``2*in*out``) only where the weight trains. A full fine-tune is thus
  ``6*in*out`` a token, LoRA/QLoRA ``4*in*out`` for the frozen base (4-bit weights are dequantised and
  multiplied at full size: the same count).
* **LoRA branches**: ``lora_A`` (``in x r``) and ``lora_B`` (``r x out``) per targeted Linear, both
  trained: ``6*r*(in + out)`` a token.
* **Attention**: the scores ``QK^T`` and their product with ``V`` are ``2*s*h`` each per token and
  layer forward (``h`` = heads x head size, also under grouped-query attention: K/V heads are
  repeated), twice that backward: ``12*s*h`` a token and layer. The full square is counted, causal or
  not: eager and SDPA's math kernel (the CPU) compute it all.
* **Packing** (causal-LM) changes nothing here: under eager and SDPA a batch stays ``B`` rows of
  ``s`` with a block-diagonal mask, whose masked scores are computed all the same (``12*s*h``); flash
  attention's varlen kernels, fed one flattened sequence, attend within each example only, which the
  full square bounds (trainer_core/data/packing.py).
* **Gradient checkpointing** runs each layer's forward a second time during backward: one more
  forward of the layers (the all-linear Linears and attention; not the heads).
* **Heads that read one position**: an encoder's pooler and classifier (BERT, ViT) run once per
  sample, not per token; a decoder's ``score`` head and an LM head run on every position, as they do
  in transformers.
* Embedding lookups, norms, activations, softmax and the optimizer step are memory-bound and small
  next to the matrix products: not counted (the learned efficiency absorbs them).
* **DPO / ORPO**: a sample is a pair, its chosen and rejected sequences of ``s`` positions each (one
  concatenated forward, padded to the batch's longest; ``2s`` positions a pair), forward and backward:
  twice a sequence's count. DPO scoring its reference every step (``reference: base``) adds a
  forward of both without backward (the frozen copy, or the base with the adapter disabled: no LoRA
  branches) to every training and evaluation sample; ``reference: precomputed`` adds that forward
  once per row before training (:attr:`SampleFlops.precompute`). ORPO has no reference.

Sequence length ``s``: the tokens a sample really has after padding or packing where the caller
knows them (preflight's length histogram), else ``max_length``, as the memory estimate assumes.
Models whose work is mostly convolutions (ResNet, ConvNeXt, the audio feature encoder) are not
modelled: :func:`training_flops` raises :class:`NotModelled` and the time estimate says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer_core.memory.activations import text_sequence
from trainer_core.memory.adapters import target_linears
from trainer_core.memory.linears import CLASSIFIER_HEADS
from trainer_core.memory.parameters import ModelStructure, config_value
from trainer_core.spec import JobSpec

# Decoders whose classification head runs on every position (the last one is picked afterwards).
_DECODER_TYPES = frozenset({"gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"})
_NOT_MODELLED = frozenset({"resnet", "convnext", "wav2vec2", "hubert", "wavlm", "swin"})


class NotModelled(ValueError):
    """The model's work is not a transformer's matrix products (conv nets, audio front ends)."""


@dataclass(frozen=True)
class SampleFlops:
    """FLOPs of one sample of ``tokens`` positions (a DPO/ORPO pair: both sequences)."""

    tokens: int
    forward: int  # one forward pass (what an evaluation pass costs)
    train: int  # forward + backward (+ the checkpointing recompute, + DPO's reference forward)
    formula: str
    precompute: int = 0  # DPO `reference: precomputed`: the reference forward, once per row before training


def _per_sample(name: str, decoder: bool) -> bool:
    if decoder:
        return False
    parts = name.split(".")
    return parts[0] in CLASSIFIER_HEADS or "pooler" in parts


def sample_flops(structure: ModelStructure, spec: JobSpec, tokens: int | None = None) -> SampleFlops:
    """The FLOPs of one training sample and one evaluation sample of ``tokens`` positions (default:
    the spec's ``max_length`` capped by the position table, or ViT's patches + 1). A DPO/ORPO sample
    is a pair: ``tokens`` are both sequences' positions, as trainer_core/token_lengths.py measures them
    (default: twice ``max_length``), each sequence half of them."""
    if structure.model_type in _NOT_MODELLED:
        raise NotModelled(f"{structure.model_type} models are not modelled by the FLOP count (convolutions)")
    s = tokens if tokens is not None else _default_tokens(structure, spec)
    if tokens is not None and spec.is_preference:
        s = max(1, round(tokens / 2))  # the batch pads chosen and rejected rows alike
    adapter = spec.adapter
    targets = {info.name for info in target_linears(structure, adapter)} if adapter is not None else set()
    trained_weights = {t.name for t in structure.tensors} if adapter is None else set()
    if adapter is not None and structure.task != "causal-lm":  # PEFT trains the head (modules_to_save)
        trained_weights = {t.name for t in structure.tensors if t.name.startswith(CLASSIFIER_HEADS)}
    forward = backward = layers_forward = lora_forward = 0
    # Read once: a transformers config attribute read goes through its __getattribute__ (slow, per Linear).
    decoder = structure.model_type in _DECODER_TYPES or bool(getattr(structure.config, "is_decoder", False))
    for info in structure.linears:
        positions = 1 if _per_sample(info.name, decoder) else s
        mac = info.in_features * info.out_features * positions
        forward += 2 * mac
        backward += 2 * mac + (2 * mac if info.weight in trained_weights else 0)
        if info.all_linear and positions == s:
            layers_forward += 2 * mac
        if info.name in targets:
            assert adapter is not None
            lora = 2 * adapter.r * (info.in_features + info.out_features) * positions
            forward, backward, layers_forward = forward + lora, backward + 2 * lora, layers_forward + lora
            lora_forward += lora
    c = structure.config
    h = int(config_value(c, "hidden_size", "d_model", "n_embd", "dim"))
    layers = int(config_value(c, "num_hidden_layers", "n_layer", "n_layers"))
    attention = 4 * s * s * h * layers  # QK^T and AV, forward
    forward += attention
    backward += 2 * attention
    layers_forward += attention
    recompute = layers_forward if spec.efficiency.gradient_checkpointing else 0
    formula = (
        f"s={s}: Linear 2*in*out a token forward, backward 2*in*out (+ 2*in*out where the weight trains)"
        + (f", LoRA r={adapter.r} on {len(targets)} Linears 6*r*(in+out)" if adapter is not None else "")
        + f", attention 12*s*h a token x {layers} layers"
        + (", + one forward of the layers (gradient checkpointing)" if recompute else "")
    )
    sequence = SampleFlops(tokens=s, forward=forward, train=forward + backward + recompute, formula=formula)
    return _pair(sequence, spec, forward - lora_forward) if spec.is_preference else sequence


def _pair(sequence: SampleFlops, spec: JobSpec, reference_forward: int) -> SampleFlops:
    """A DPO/ORPO sample: ``sequence`` twice (chosen and rejected) and DPO's reference forward of both
    (``reference_forward`` a sequence: the adapter, when there is one, is disabled), each step or once."""
    scored = 2 * reference_forward if spec.method == "dpo" else 0
    each_step = spec.preference_settings.reference == "base"
    formula = f"{spec.method} pair, chosen + rejected: 2 x ({sequence.formula})"
    if scored:
        formula += " + the reference forward of both" + (" every step" if each_step else " once, before training")
    return SampleFlops(
        tokens=2 * sequence.tokens,
        forward=2 * sequence.forward + (scored if each_step else 0),
        train=2 * sequence.train + (scored if each_step else 0),
        formula=formula,
        precompute=0 if each_step else scored,
    )


def _default_tokens(structure: ModelStructure, spec: JobSpec) -> int:
    c = structure.config
    if structure.model_type == "vit":
        image = int(getattr(c, "image_size", 224))
        return (image // int(c.patch_size)) ** 2 + 1
    return text_sequence(structure, spec)


@dataclass(frozen=True)
class TrainingFlops:
    """The work of a whole run: its training steps and its evaluation passes."""

    sample: SampleFlops
    train_samples: int
    eval_samples: int
    # Rows scored once before training (DPO's precomputed reference): the training and evaluation
    # splits, as the run scores every split it prepared (trainer_core/backends/reference.py).
    train_rows: int = 0
    eval_rows: int = 0

    @property
    def train(self) -> int:
        return self.sample.train * self.train_samples + self.sample.precompute * self.train_rows

    @property
    def eval(self) -> int:
        return self.sample.forward * self.eval_samples + self.sample.precompute * self.eval_rows

    @property
    def total(self) -> int:
        return self.train + self.eval


def run_samples(spec: JobSpec, train_rows: int, eval_rows: int, devices: int = 1) -> tuple[int, int, int]:
    """Optimizer steps, training samples and evaluation samples of a run on ``train_rows`` rows.

    The Trainer's rule (transformers 5 ``Trainer.set_initial_training_values``): an epoch is
    ``ceil(batches / accumulation)`` steps, the last batch and the last accumulation group partial;
    ``max_steps`` when set, else ``ceil(epochs x steps an epoch)``. Evaluations: one at the end of
    every epoch begun (``epoch``), one every ``eval_steps`` (``steps``; default ``logging_steps``),
    none (``no``) or none without eval rows.
    """
    t, accumulation = spec.training, spec.efficiency.gradient_accumulation_steps
    batch = t.per_device_train_batch_size * devices
    batches = max(-(-train_rows // batch), 1)
    per_epoch = max(-(-batches // accumulation), 1)
    steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * per_epoch)
    whole, rest = divmod(steps, per_epoch)
    samples = whole * train_rows + min(rest * accumulation * batch, train_rows)
    epochs = whole + (rest > 0)
    if eval_rows <= 0 or t.eval_strategy == "no":
        evaluations = 0
    elif t.eval_strategy == "steps":
        evaluations = steps // (t.eval_steps or t.logging_steps)
    else:
        evaluations = epochs
    return steps, samples, evaluations * eval_rows


def training_flops(
    structure: ModelStructure, spec: JobSpec, train_rows: int, eval_rows: int, tokens: int | None = None
) -> TrainingFlops:
    """The FLOPs of the run ``spec`` describes on ``train_rows`` / ``eval_rows`` rows."""
    _, samples, eval_samples = run_samples(spec, train_rows, eval_rows, spec.world_size)
    return TrainingFlops(sample_flops(structure, spec, tokens), samples, eval_samples, train_rows, eval_rows)
