"""The Linear layers of a model as PEFT and bitsandbytes see them, recorded once per structure.

PEFT's ``all-linear`` (peft 0.21 ``tuners_utils._maybe_include_all_linear_layers``) targets every
``nn.Linear`` and transformers ``Conv1D`` except the output embedding (causal LMs) or the top-level
``score`` / ``classifier`` head (classification). transformers' bitsandbytes integration quantises
the same layers except ``get_keys_to_not_convert``: the output embedding, tied weights and the
module of the model's last parameter; those stay in 16/32-bit with embeddings and norms.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers.pytorch_utils import Conv1D

# PEFT's SEQ_CLS_HEAD_NAMES: the classifier head it skips in all-linear and trains as modules_to_save.
CLASSIFIER_HEADS = ("score", "classifier")


@dataclass(frozen=True)
class LinearInfo:
    """One Linear (or GPT-2 ``Conv1D``) module: what LoRA and 4-bit quantisation act on."""

    name: str  # module name, as PEFT matches target_modules against it
    in_features: int
    out_features: int
    weight: str  # parameter names of its weight and bias (None without bias)
    bias: str | None
    all_linear: bool  # chosen by target_modules="all-linear"
    quantized: bool  # replaced by bnb Linear4bit under QLoRA


def _last_module(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0]


def linear_modules(model: nn.Module, task: str) -> tuple[LinearInfo, ...]:
    """Every Linear / Conv1D of ``model`` with the two flags above (``model`` may be on the meta device)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    first_name = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    get_out = getattr(model, "get_output_embeddings", None)
    out_emb = get_out() if callable(get_out) else None
    excluded = {n for n, m in model.named_modules() if out_emb is not None and m is out_emb}
    if out_emb is None and task != "causal-lm":
        head = next((getattr(model, h) for h in CLASSIFIER_HEADS if getattr(model, h, None) is not None), None)
        excluded |= {n for n, m in model.named_modules() if head is not None and m is head}
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    keep = {k.removesuffix(".weight") for k in (*tied.keys(), *tied.values())}
    keep |= {_last_module(list(model.named_parameters())[-1][0])} | excluded
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D)):
            continue
        weight = module.weight
        # Conv1D stores its weight as (in, out); nn.Linear as (out, in).
        n_in, n_out = (
            (weight.shape[0], weight.shape[1]) if isinstance(module, Conv1D) else (weight.shape[1], weight.shape[0])
        )
        bias = getattr(module, "bias", None)
        out.append(
            LinearInfo(
                name=name,
                in_features=int(n_in),
                out_features=int(n_out),
                weight=first_name.get(id(weight), names[id(weight)]),
                bias=None if bias is None else first_name.get(id(bias), names[id(bias)]),
                all_linear=name not in excluded,
                quantized=name not in keep,
            )
        )
    return tuple(out)
