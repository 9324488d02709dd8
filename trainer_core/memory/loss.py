"""What a causal LM's SFT loss holds under ``efficiency.chunked_loss`` (and ``efficiency.liger``).

The chunked loss (:mod:`trainer_core.chunked_loss`) never holds the ``[b, s, vocab]`` logits nor
their fp32 copy. Instead, with ``N = b x s`` tokens, ``H`` the hidden size, ``V`` the vocabulary:

* **held from the forward to the backward** (:func:`chunked_loss_gradients`): the gradient w.r.t.
  the hidden states, ``N x H`` at the hidden states' dtype (fp32 for a full fine-tune, whose residual
  stream is fp32; the frozen base's dtype under an adapter), and, when the head trains (no adapter),
  the fp32 gradient of its weight, ``V x H x 4 B``;
* **during the forward only** (:func:`chunked_loss_chunk`): one chunk of ``c = min(1024, N)`` rows at
  a time (each chunk's tensors are freed before the next one's are made, so the first, fullest chunk is
  the largest), with ``L = c x V``, ``a`` the matmul width (2 under autocast, else ``hd``) and
  ``k = min(64, c)`` the rows of one softmax block. One fp32 ``[c, V]`` buffer holds the logits,
  their softmax and then the gradient, in place; its largest moment is the largest of:

  - the logits: the head's output ``a L`` (when ``a`` is not 4) + its fp32 upcast ``4 L``;
  - logsumexp and softmax, a block of rows at a time: ``4 L + 4 k V``;
  - the gradient's cast to the matmul dtype (``a`` = 2): ``(4 + a) L``, then the fp32 buffer is freed;
  - ``grad @ weight``: ``a L + c x H x a``;
  - when the head trains (no adapter), ``grad_weight.addmm_`` in place in fp32, its 16-bit operands
    upcast (``a`` = 2): ``a L + 4 L + c x H x (a + 4)`` (the hidden chunk's 16-bit cast and its upcast;
    nothing when ``a`` is 4).

  Measured with a dispatch-mode allocation tracker (tests/trainer_core/memory/test_chunked_loss_estimate.py).
  The one-byte masks, the ``c``-long vectors and the ``N``-long padded targets are left out (< 1 %).

``efficiency.liger`` (CUDA only) is estimated the same way: Liger's fused linear cross-entropy also
computes the gradients chunk by chunk in the forward and keeps the same two gradients (its chunk
size and 16-bit logits differ: the chunk part is approximate for it). Its RMSNorm, SwiGLU and RoPE
kernels keep fewer tensors than transformers' modules, but the activations are estimated as the
plain model's (an upper bound for those parts); weights, gradients and optimizer state are exact.

Preference (DPO/ORPO) runs compute full logits whatever the setting (their ``policy_logps``; Liger's
loss only runs when labels are passed), so neither applies to them.
"""

from __future__ import annotations

from trainer_core.chunked_loss import CHUNK_TOKENS, SOFTMAX_ROWS
from trainer_core.memory.activations import forward_rows, holds_no_logits, text_sequence
from trainer_core.memory.adapters import frozen_base_itemsize
from trainer_core.memory.parameters import ModelStructure, config_value
from trainer_core.spec import JobSpec

FP32 = 4
GRADIENTS_FORMULA = "b x s x hidden x hd (d loss/d hidden) + vocab x hidden x 4 B (d loss/d head, full fine-tune)"
CHUNK_FORMULA = (
    "largest moment of one chunk of c = min(1024, b x s) rows, L = c x vocab: the logits (a + 4) L"
    " (4 L in fp32), the softmax of 64 rows at a time 4 L + 4 x 64 x vocab, grad @ weight a L + c x hidden x a,"
    " and, when the head trains under autocast, its in-place fp32 gradient 6 L + 6 c x hidden"
)


def _hidden_itemsize(spec: JobSpec) -> int:
    """Bytes per element of the last hidden states: the fp32 residual stream of fp32 master weights,
    the frozen base's dtype under an adapter."""
    return FP32 if spec.adapter is None else frozen_base_itemsize(spec)


def _shape(structure: ModelStructure, spec: JobSpec) -> tuple[int, int, int]:
    """(tokens N, hidden H, vocabulary V) of one micro-batch."""
    hidden = int(config_value(structure.config, "hidden_size", "d_model", "n_embd", "dim"))
    return forward_rows(spec) * text_sequence(structure, spec), hidden, structure.num_labels


def chunked_loss_gradients(structure: ModelStructure, spec: JobSpec) -> int:
    """Bytes the chunked loss saves for backward: ``N x H x hd`` + (no adapter) ``V x H x 4``; 0 when
    the spec's loss holds logits (see the module docstring)."""
    if not holds_no_logits(structure, spec):
        return 0
    n, h, v = _shape(structure, spec)
    head = v * h * FP32 if spec.adapter is None else 0  # the head is frozen under an adapter
    return n * h * _hidden_itemsize(spec) + head


def chunked_loss_chunk(structure: ModelStructure, spec: JobSpec) -> int:
    """The largest transient of the chunked loss's forward (see the module docstring); 0 when the
    spec's loss holds logits."""
    if not holds_no_logits(structure, spec):
        return 0
    n, h, v = _shape(structure, spec)
    c = min(CHUNK_TOKENS, n)
    hd = _hidden_itemsize(spec)
    a = 2 if spec.efficiency.mixed_precision != "no" else hd
    big = c * v  # L: one chunk's logits
    upcast = FP32 * big if a != FP32 else 0  # a 16-bit [c, V] tensor's fp32 copy
    moments = [
        a * big + upcast,  # the logits and their fp32 upcast (then the gradient and its cast to a)
        FP32 * big + FP32 * min(SOFTMAX_ROWS, c) * v,  # logsumexp and softmax of a block of rows
        a * big + c * h * a,  # grad @ weight
    ]
    if spec.adapter is None and a != FP32:  # the head trains: addmm_ with its operands upcast
        moments.append(a * big + upcast + c * h * ((a if hd != a else 0) + FP32))
    return max(moments)
