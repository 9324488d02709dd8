"""The causal-LM loss in chunks of tokens: the full ``[tokens, vocab]`` logits are never held.

A causal LM's plain loss materialises the logits of every position (and their fp32 upcast and
softmax gradient): at a 128k vocabulary that is the largest tensor of a step, bigger than all
activations of a small model. This is the idea of Liger's fused linear cross-entropy in plain
PyTorch, so it runs on the CPU and on any GPU:

* the forward walks the tokens in chunks; for each it computes the chunk's logits from the last hidden
  states and the output head, its loss terms, and at once its gradients with respect to the hidden
  states and the head's weight (``softmax - one_hot``, scaled as the loss is), in one fp32 buffer that
  holds the logits, then their softmax, then that gradient (in place), and frees it before the next
  chunk; the head's gradient is accumulated in place (``addmm_``), never a vocab x hidden temporary;
* the backward only scales those stored gradients by the incoming one.

Memory per step is one chunk's fp32 logits (and, under autocast, their 16-bit original or cast) plus
a gradient the size of the hidden states and one the size of the head, instead of the logits of the
whole batch (twice, with the upcast). The arithmetic is the
plain loss's (the same matmuls, in the same dtype), so loss and gradients equal it to rounding
(tests/trainer_core/test_chunked_loss.py).

Only models whose logits are exactly ``lm_head(hidden_states)`` can use it (:func:`chunkable`): a
final soft-capping or logit scale (Gemma 2, Cohere) changes the logits after the head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100
SOFTMAX_ROWS = 64  # rows of the softmax's temporaries (1/16 of a chunk)
CHUNK_TOKENS = 1024  # rows of logits held at once: 1024 x 128k vocab x 4 B = 512 MiB at worst
# Config fields that put something between the head and the logits.
LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
CHUNKED_REFUSAL = (
    "this model changes its logits after the output head (a soft cap or logit scale), so its loss cannot be "
    "computed from the head in chunks; leave efficiency.chunked_loss off"
)


def _logsumexp_then_softmax(logits: torch.Tensor, in_place: bool) -> torch.Tensor:
    """The logsumexp of each row of ``logits``, overwriting them with their softmax if ``in_place``.

    A block of rows at a time, so that only a block's temporaries are allocated, and with the plain
    loss's kernels, so with its numerics."""
    lse = torch.empty(logits.shape[0], dtype=logits.dtype, device=logits.device)
    for rows, row_lse in zip(logits.split(SOFTMAX_ROWS), lse.split(SOFTMAX_ROWS), strict=True):
        row_lse.copy_(torch.logsumexp(rows, dim=-1))
        if in_place:
            rows.copy_(torch.softmax(rows, dim=-1))
    return lse


def _chunk_loss(
    h: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> torch.Tensor:  # fmt: skip
    """The summed loss terms of one chunk (hidden rows ``h``, targets ``t``), adding its gradients into
    ``grads`` (this chunk's rows of d/d hidden, d/d weight, d/d bias; None where not wanted).

    One ``[c, vocab]`` fp32 buffer holds the logits, then the softmax, then d(loss)/d(logits), all in
    place; everything the chunk allocates is freed when this returns."""
    grad_rows, grad_weight, grad_bias = grads
    counted = t != IGNORE_INDEX
    safe = torch.where(counted, t, 0).unsqueeze(1)
    out = nn.functional.linear(h, weight, bias)  # in the autocast dtype under autocast, as the plain loss's
    matmul_dtype = out.dtype  # the plain loss's backward matmuls run in it
    probs = out.float()  # the plain loss upcasts the same way
    del out  # the 16-bit logits, if any
    picked = probs.gather(1, safe).squeeze(1)
    wants_grad = grad_rows is not None or grad_weight is not None or grad_bias is not None
    lse = _logsumexp_then_softmax(probs, in_place=wants_grad)
    loss = torch.where(counted, lse - picked, 0.0).sum()
    if not wants_grad:
        return loss
    # d(loss)/d(logits) = (softmax - one_hot) / divisor on counted rows, 0 elsewhere
    probs.scatter_add_(1, safe, torch.full_like(picked, -1.0).unsqueeze(1))
    probs.mul_((counted.to(probs.dtype) * scale).unsqueeze(1))
    grad = probs.to(matmul_dtype)
    del probs  # the fp32 buffer, once cast
    if grad_rows is not None:
        grad_rows.copy_(grad @ weight)
    if grad_weight is not None:  # in place: no vocab x hidden temporary; 16-bit operands upcast, as chunks
        grad_weight.addmm_(grad.t().float(), h.to(matmul_dtype).float())
    if grad_bias is not None:
        grad_bias.add_(grad.sum(0, dtype=torch.float32))
    return loss


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T + bias, targets)``, summed over counted targets and divided by
    ``divisor``; the gradients are computed chunk by chunk in the forward (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
        divisor: torch.Tensor, chunk: int,
    ) -> torch.Tensor:  # fmt: skip
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if (
            ctx.needs_input_grad[1]) else None  # fmt: skip
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if (
            bias is not None and ctx.needs_input_grad[2]) else None  # fmt: skip
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        scale = 1.0 / divisor.to(torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            if not bool((targets[rows] != IGNORE_INDEX).any()):
                continue
            grad_rows = grad_hidden[rows] if grad_hidden is not None else None
            grads = (grad_rows, grad_weight, grad_bias)
            total = total + _chunk_loss(hidden[rows], targets[rows], weight, bias, scale, grads)
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias))
        )
        ctx.has = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        has_hidden, has_weight, has_bias = ctx.has
        weight_dtype, bias_dtype = ctx.dtypes
        return (
            grad_hidden * grad_output.to(grad_hidden.dtype) if has_hidden else None,
            (grad_weight * grad_output).to(weight_dtype) if has_weight else None,
            (grad_bias * grad_output).to(bias_dtype) if has_bias else None,
            None, None, None,
        )  # fmt: skip


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """The causal-LM loss of ``hidden`` (``[B, L, H]``, the last hidden states) under the output ``head``
    for ``labels`` (``[B, L]``, unshifted, -100 where not counted), as transformers' ``ForCausalLMLoss``
    computes it: the mean over counted targets, or their sum over ``num_items_in_batch`` when given."""
    targets = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    divisor = (
        torch.as_tensor(num_items_in_batch, device=flat.device)
        if num_items_in_batch is not None
        else (targets != IGNORE_INDEX).sum()
    )
    weight = head.weight
    bias = getattr(head, "bias", None)
    assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
    loss = _ChunkedLinearCrossEntropy.apply(flat, weight, bias, targets.to(flat.device), divisor, chunk)
    assert isinstance(loss, torch.Tensor)
    return loss


def _causal_lm(model: nn.Module) -> Any:
    """The ``*ForCausalLM`` module inside a PEFT or accelerate wrapper (typed loosely: its backbone and
    head are found by name)."""
    inner: Any = getattr(model, "module", model)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # PEFT
    return get_base() if callable(get_base) else inner


def chunkable(model: nn.Module) -> bool:
    """Whether ``model``'s logits are exactly its output head applied to its backbone's last hidden states."""
    lm = _causal_lm(model)
    config = getattr(lm, "config", None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    backbone = getattr(lm, str(getattr(lm, "base_model_prefix", "")), None)
    if config is None or not isinstance(head, nn.Linear) or not isinstance(backbone, nn.Module):
        return False
    return changes_logits(config) is None


def changes_logits(config: Any) -> str | None:
    """The config field that changes a model's logits after its head, or None (preflight reads the
    config alone: no model is built at submit)."""
    return next((name for name in LOGIT_CHANGES if getattr(config, name, None)), None)


def causal_lm_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    """``model(**batch).loss`` without the full logits: the backbone's forward, then the chunked loss.

    The backbone is called on the unwrapped model's own module, so LoRA layers (injected into its
    Linears) and gradient checkpointing (set on its layers) work as in the full forward."""
    lm = _causal_lm(model)
    backbone = getattr(lm, lm.base_model_prefix)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = backbone(**inputs, use_cache=False).last_hidden_state
    return chunked_cross_entropy(hidden, lm.get_output_embeddings(), batch["labels"], num_items_in_batch)
