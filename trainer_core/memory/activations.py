"""Activation memory of one micro-batch, from published formulas (see docs/memory.md).

Transformer layers follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022), Sec. 4.1: per layer ``s*b*h*(34 + 5*a*s/h)`` bytes at 16-bit, i.e. attention
``11sbh + 5as^2b``, MLP ``19sbh``, two layer norms ``4sbh``. We keep that accounting term by term so it
also covers what the paper's model does not have (each generalisation reduces to 34 for BERT shapes):

* width ``w`` bytes per stored element: 2 under bf16/fp16 autocast, 4 in fp32 ("fp32 doubles the
  2-byte terms"); dropout masks are 1 byte and exist only when the config's dropout is > 0;
* K and V scale with ``kv_heads / heads`` (grouped-query attention);
* the MLP's two 4h-wide tensors scale with ``intermediate / h``; a gated MLP (gate_proj) stores gate,
  up, act(gate) and their product: four intermediate-wide tensors;
* layer-norm inputs are counted at 4 B whatever ``w``: autocast runs norms in fp32 and the residual
  stream of fp32 master weights stays fp32 (Korthikanti's 16-bit count assumes pure 16-bit training);
  RMSNorm as transformers writes it also keeps its fp32 normalised product: two tensors per norm;
* the ``5as^2b`` score term is dropped when the attention implementation does not store the score
  matrix: SDPA on CUDA dispatches to the flash / memory-efficient kernels. The estimate assumes a CUDA
  device; eager attention (DeBERTa-v2, or SDPA's math fallback on the CPU) stores it.

Packing (causal-LM) keeps a batch as ``b`` rows of ``s`` under eager and SDPA, plus its 4D
block-diagonal mask (trainer_core/data/packing.py): eager adds one fp32 ``b*s^2`` mask. SDPA takes a
bool mask, which each layer's kernel converts to the compute dtype and keeps for backward
(``b*s^2*(1 + L*w)``), and with a mask transformers repeats K/V to every head (``use_gqa_in_sdpa``), so
K and V count at full width. Measured on the CPU against autograd's saved tensors (fp32 and bf16).
Flash attention's flattened batch has no mask and counts as unpacked.

With gradient checkpointing each layer keeps only its input (the paper's ``2*s*b*h``; ``4*s*b*h``
here, the fp32 residual stream) and one layer is recomputed at a time (its full activation).
Sequence length: ``max_length`` for text (the worst case; dynamic padding is usually shorter),
patches + 1 for ViT, frames after the feature encoder for audio.
Conv nets (ResNet, ConvNeXt) and the audio feature encoder are counted as the feature maps their
blocks keep for backward, an approximation stated next to each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer_core.memory.parameters import ModelStructure, config_value
from trainer_core.spec import TEXT_TASKS, JobSpec

if TYPE_CHECKING:
    from trainer_core.memory.adapters import ParameterLayout

DEFAULT_IMAGE_SIZE = 224  # image processors' default crop when the config does not say
DEFAULT_SAMPLING_RATE = 16_000  # wav2vec2/HuBERT feature extractors
LOGIT_BYTES = 4  # logits are upcast to fp32 for the loss
NORM_BYTES = 4  # norms and the residual stream stay fp32 under autocast
# Decoder LMs classify from the last token, but their score head runs on every position.
_CAUSAL_TYPES = frozenset({"gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"})


@dataclass(frozen=True)
class Activations:
    bytes: int
    formula: str


@dataclass(frozen=True)
class LayerShape:
    """The numbers one transformer layer's activation depends on."""

    s: int  # sequence length
    h: int  # hidden size
    a: int  # attention heads
    intermediate: int
    kv_ratio: float  # key/value heads over query heads
    gated: bool
    scores: bool  # the score matrix is stored (eager attention)
    score_span: int  # keys each query attends to: s, or the window area for Swin
    dropout: bool
    rms_norm: bool = False


def layer_bytes(shape: LayerShape, b: int, w: int, norm_w: int | None = None) -> int:
    """One transformer layer's stored activations (Korthikanti et al. 2022, generalised as above).

    ``norm_w`` is the width of the two norms' saved inputs (default ``w``: the paper's pure 16-bit
    or fp32 training; the estimator passes 4, see the module docstring).
    """
    s, h = shape.s, shape.h
    r = shape.intermediate / h
    attention = 3 + 2 * shape.kv_ratio  # QKV input, Q, K, V, output-projection input
    mlp = 1 + (4 * r if shape.gated else 2 * r)
    norms = 2 * (norm_w or w) * (2 if shape.rms_norm else 1)
    masks = 2 if shape.dropout else 0  # attention-output and MLP dropout masks, 1 byte each
    total = s * b * h * (w * (attention + mlp) + norms + masks)
    if shape.scores:  # softmax output and dropout output at w bytes, dropout mask at 1 byte
        total += shape.a * s * shape.score_span * b * (2 * w + (1 if shape.dropout else 0))
    return int(total)


def stack_bytes(shapes: list[LayerShape], b: int, w: int, checkpointing: bool) -> int:
    """All layers, or with checkpointing each layer's input plus the largest layer recomputed.

    The residual stream between layers is fp32 (see the module docstring), so are the kept inputs.
    """
    if not shapes:
        return 0
    if checkpointing:
        kept = sum(x.s * b * x.h * NORM_BYTES for x in shapes)
        return kept + max(layer_bytes(x, b, w, NORM_BYTES) for x in shapes)
    return sum(layer_bytes(x, b, w, NORM_BYTES) for x in shapes)


def _has_dropout(structure: ModelStructure) -> bool:
    value = config_value(
        structure.config, "hidden_dropout_prob", "hidden_dropout", "resid_pdrop", "dropout", default=0.0
    )
    return float(value or 0.0) > 0


def _conv_out(length: int, kernel: int, stride: int) -> int:
    return (length - kernel) // stride + 1


def encoder_shapes(structure: ModelStructure, s: int) -> list[LayerShape]:
    """The transformer layers of a text, ViT or audio encoder (or decoder) at sequence length ``s``."""
    # The layer's dimensions are read from the config once per structure: a config attribute read
    # costs microseconds (transformers' __getattribute__), a dozen of them a warm estimate's tenth.
    layer, layers = structure.memoized("layer_shape", lambda: _layer_shape(structure))
    # DeBERTa's disentangled attention adds a c2p / p2c score matrix per position type (approximation).
    span = s * layer.score_span
    return [dataclasses.replace(layer, s=s, score_span=span)] * layers


def _layer_shape(structure: ModelStructure) -> tuple[LayerShape, int]:
    """One layer at ``s = 1`` (``score_span``: the spans per position) and the number of layers."""
    c = structure.config
    h = int(config_value(c, "hidden_size", "d_model", "n_embd", "dim"))
    layers = int(config_value(c, "num_hidden_layers", "encoder_layers", "n_layer", "n_layers"))
    a = int(config_value(c, "num_attention_heads", "encoder_attention_heads", "n_head", "n_heads"))
    inter = int(config_value(c, "intermediate_size", "encoder_ffn_dim", "n_inner", "hidden_dim", default=4 * h))
    kv = int(config_value(c, "num_key_value_heads", default=a))
    gated = any(".gate_proj." in t.name for t in structure.tensors)
    scores = structure.attn_implementation == "eager"
    spans = 1 + len(getattr(c, "pos_att_type", None) or []) if structure.model_type == "deberta-v2" else 1
    rms = any(t.name.endswith("input_layernorm.weight") for t in structure.tensors)  # Llama-style RMSNorm
    return LayerShape(1, h, a, inter, kv / a, gated, scores, spans, _has_dropout(structure), rms), layers


def _swin_shapes(structure: ModelStructure, image: int) -> list[LayerShape]:
    c = structure.config
    side = image // c.patch_size
    shapes: list[LayerShape] = []
    scores = structure.attn_implementation == "eager"
    for stage, (depth, heads) in enumerate(zip(c.depths, c.num_heads, strict=True)):
        res = side // 2**stage
        h = c.embed_dim * 2**stage
        window = min(c.window_size, res) ** 2  # window attention: each query sees one window
        shape = LayerShape(res * res, h, heads, int(c.mlp_ratio * h), 1.0, False, scores, window, True)
        shapes.extend([shape] * depth)
    return shapes


def _conv_net_bytes(structure: ModelStructure, b: int, w: int, image: int) -> tuple[int, str]:
    """Approximation: feature maps each block keeps for backward, per output channel and pixel.

    ResNet bottleneck: conv1/conv2 outputs and their ReLUs (4 x C/4) + conv3 output + ReLU (2C) = 3C;
    basic block: 4C. ConvNeXt block: dwconv out, LN out, pwconv2 out (3C) + two 4C-wide MLP tensors = 12C.
    The stem keeps the input image and one map at the stem's resolution.
    """
    c = structure.config
    per_channel = 12 if structure.model_type == "convnext" else (3 if c.layer_type == "bottleneck" else 4)
    res = image // 4  # both stems bring 224 to 56 before the first stage
    elements = 3 * image * image + 2 * getattr(c, "embedding_size", c.hidden_sizes[0]) * res * res
    for stage, (depth, channels) in enumerate(zip(c.depths, c.hidden_sizes, strict=True)):
        side = res // 2**stage
        elements += depth * per_channel * channels * side * side
    return elements * b * w, f"sum over stages: depth x {per_channel} x C x H x W x b x {w} B (approximation)"


def _audio_frontend(structure: ModelStructure, spec: JobSpec, b: int, w: int) -> tuple[int, int]:
    """(frames after the feature encoder, bytes the encoder keeps) for wav2vec2-style conv stacks."""
    c = structure.config
    rate = spec.preprocessing.sampling_rate or DEFAULT_SAMPLING_RATE
    length = samples = int(spec.preprocessing.max_duration_s * rate)
    elements = samples  # the waveform is the first conv's input
    for dim, kernel, stride in zip(c.conv_dim, c.conv_kernel, c.conv_stride, strict=True):
        length = _conv_out(length, kernel, stride)
        elements += 2 * dim * length  # conv output (norm/GELU input) and GELU output
    h = c.hidden_size
    # feature projection (LN input, projection input) and the positional conv (input, output, GELU).
    elements += (2 * c.conv_dim[-1] + 3 * h) * length
    return length, elements * b * w


def sequence_and_frontend(structure: ModelStructure, spec: JobSpec, b: int, w: int) -> tuple[int, int, str]:
    """(sequence length, bytes before the first layer, how s was derived) per modality."""
    c = structure.config
    h = int(config_value(c, "hidden_size", "d_model", "n_embd", "dim"))
    mt = structure.model_type
    if structure.task in TEXT_TASKS:
        limit = config_value(c, "max_position_embeddings", "n_positions", default=spec.preprocessing.max_length)
        s = min(spec.preprocessing.max_length, int(limit))
        return s, (w + 1) * s * b * h, f"s = max_length = {s}"
    if mt == "audio-spectrogram-transformer":
        f = _conv_out(c.num_mel_bins, c.patch_size, c.frequency_stride)
        t = _conv_out(c.max_length, c.patch_size, c.time_stride)
        s = f * t + 2
        return s, w * s * b * h, f"s = {f} x {t} patches + 2 = {s}"
    if mt == "whisper":
        s = c.max_source_positions  # the feature extractor always pads to 30 s
        return s, 2 * w * b * h * (2 * s + s), f"s = max_source_positions = {s} (30 s padded)"
    if hasattr(c, "conv_kernel"):
        frames, front = _audio_frontend(structure, spec, b, w)
        return frames, front, f"s = {frames} frames after the conv feature encoder"
    image = int(getattr(c, "image_size", DEFAULT_IMAGE_SIZE))
    s = (image // c.patch_size) ** 2 + 1
    return s, w * s * b * h, f"s = ({image}/{c.patch_size})^2 patches + 1 = {s}"


def text_sequence(structure: ModelStructure, spec: JobSpec) -> int:
    """``max_length``, capped by the position table."""
    c = structure.config
    limit = config_value(c, "max_position_embeddings", "n_positions", default=spec.preprocessing.max_length)
    return min(spec.preprocessing.max_length, int(limit))


def forward_rows(spec: JobSpec) -> int:
    """Rows one micro-batch's forward runs: ``per_device_train_batch_size``, doubled for DPO/ORPO, whose
    ``B`` pairs go through one concatenated forward of ``B`` chosen and ``B`` rejected sequences."""
    rows = spec.training.per_device_train_batch_size
    return 2 * rows if spec.is_preference else rows


def holds_no_logits(structure: ModelStructure, spec: JobSpec) -> bool:
    """An SFT causal LM under ``efficiency.chunked_loss`` or ``efficiency.liger``: its loss never holds
    the logits (trainer_core/memory/loss.py counts what it holds instead)."""
    chunked = spec.efficiency.chunked_loss or spec.efficiency.liger
    return structure.task == "causal-lm" and chunked and not spec.is_preference


def logits_fp32_bytes(structure: ModelStructure, spec: JobSpec) -> int:
    """causal-lm: the fp32 ``b x s x vocab`` tensor of the loss (``logits.float()`` under autocast, the
    log-softmax output in fp32), usually an LLM's largest single transient; 0 for other tasks and
    under the chunked loss (:func:`holds_no_logits`).

    DPO/ORPO gather their per-token log-probs over ``2B`` rows with TRL's ``selective_log_softmax``
    (trainer_core/preference.py): from 16-bit logits it saves each row's fp32 log-softmax for backward
    (its loop; on CUDA TRL's Triton kernel keeps none, so there this is an upper bound), from fp32
    logits it takes their logsumexp in place and keeps no copy.
    """
    if structure.task != "causal-lm" or (spec.is_preference and spec.efficiency.mixed_precision == "no"):
        return 0
    if holds_no_logits(structure, spec):
        return 0
    return forward_rows(spec) * text_sequence(structure, spec) * structure.num_labels * 4


def packed_rows_attention(structure: ModelStructure, spec: JobSpec) -> str | None:
    """The attention packed rows run under with their 4D mask: ``eager`` or ``sdpa``; None without
    packing or under flash attention (one flattened sequence, no mask)."""
    from trainer_core.data.packing import packing_layout

    if structure.task != "causal-lm" or not spec.preprocessing.packing:
        return None
    if packing_layout(structure.attn_implementation) != "rows":
        return None
    return structure.attn_implementation


def packing_mask_bytes(attention: str, s: int, b: int, w: int, layers: int) -> int:
    """The packed rows' mask (see the module docstring): one fp32 copy for eager; the bool mask and each
    layer's converted copy for SDPA."""
    return 4 * b * s * s if attention == "eager" else b * s * s * (1 + layers * w)


def lora_path_bytes(layout: ParameterLayout, spec: JobSpec, s: int, b: int, w: int) -> int:
    """What each LoRA branch saves beyond its Linear's input: lora_A's output (s x b x r) and, with
    dropout, the dropped input (w bytes) and its 1-byte mask (s x b x in); without dropout PEFT uses
    Identity and lora_A saves the Linear's own input."""
    adapter = spec.adapter
    if adapter is None:
        return 0
    dropout = adapter.dropout > 0 and not spec.is_preference  # see estimate_activations
    total = 0
    for t in layout.trainable:
        if t.name.endswith(".lora_A.weight"):
            r, n_in = t.shape
            total += s * b * (r * w + (n_in * (w + 1) if dropout else 0))
    return total


def estimate_activations(
    structure: ModelStructure, spec: JobSpec, layout: ParameterLayout | None = None
) -> Activations:
    """Activation bytes of one micro-batch (``per_device_train_batch_size``, ``2B`` rows for DPO/ORPO:
    :func:`forward_rows`) per device.

    ``layout`` (the adapter's tensors) adds the LoRA branches; a causal LM's head output is
    ``b x s x vocab x w`` (its fp32 loss copy is :func:`logits_fp32_bytes`), 0 under the chunked loss.
    """
    b = forward_rows(spec)
    w = 4 if spec.efficiency.mixed_precision == "no" else 2
    ckpt = spec.efficiency.gradient_checkpointing
    mt = structure.model_type
    logits = b * structure.num_labels * LOGIT_BYTES
    how = "checkpointed: L x 4*s*b*h (fp32 layer inputs) + one layer" if ckpt else "L x layer"
    if mt in {"resnet", "convnext"}:
        image = int(getattr(structure.config, "image_size", DEFAULT_IMAGE_SIZE) or DEFAULT_IMAGE_SIZE)
        maps, formula = _conv_net_bytes(structure, b, w, image)  # no checkpointing support in HF
        return Activations(maps + logits, f"{formula}; + logits b x labels x 4 B")
    if mt == "swin":
        image = int(structure.config.image_size)
        shapes = _swin_shapes(structure, image)
        front = w * shapes[0].s * b * shapes[0].h
        desc = f"Swin stages, window {structure.config.window_size}"
    else:
        s, front, desc = sequence_and_frontend(structure, spec, b, w)
        shapes = encoder_shapes(structure, s)
        if structure.task == "causal-lm":
            # lm_head output at the autocast width; none under the chunked loss
            logits = 0 if holds_no_logits(structure, spec) else b * s * structure.num_labels * w
        elif getattr(structure.config, "is_decoder", False) or mt in _CAUSAL_TYPES:
            logits = b * s * structure.num_labels * LOGIT_BYTES  # the score head runs on every position
        if spec.adapter is not None:  # RMSNorm's `weight * x` saves x only when the weight trains
            shapes = [dataclasses.replace(x, rms_norm=False) for x in shapes]
        if spec.is_preference:  # DPO/ORPO runs set every Dropout to p=0 (TRL's default), which saves nothing
            shapes = [dataclasses.replace(x, dropout=False) for x in shapes]
        if (packed := packed_rows_attention(structure, spec)) is not None:
            if packed == "sdpa":  # a mask turns SDPA's GQA off: K and V are repeated to every head
                shapes = [dataclasses.replace(x, kv_ratio=1.0) for x in shapes]
            front += packing_mask_bytes(packed, s, b, w, len(shapes))
            desc += f", packed rows' {b}x{s}x{s} mask ({packed})"
        if layout is not None:
            lora = lora_path_bytes(layout, spec, s, b, w)
            # checkpointing recomputes one layer at a time: its share of the branches (approximation)
            front += lora // len(shapes) if ckpt and shapes else lora
    body = stack_bytes(shapes, b, w, ckpt)
    x = shapes[0]
    per_layer = "s*b*h*(34 + 5*a*s/h)" if x.scores else "s*b*h*34 (no 5as/h: SDPA keeps no scores)"
    rows = f"2x{b // 2} (chosen + rejected)" if spec.is_preference else str(b)
    formula = (
        f"Korthikanti 2022 {per_layer} generalised, w={w} B, b={rows}, {desc}, L={len(shapes)}, "
        f"h={x.h}, a={x.a}; {how}; + inputs/front end + logits"
    )
    if holds_no_logits(structure, spec):
        formula += " (none: the chunked loss holds no logits)"
    return Activations(front + body + logits, formula)
