"""LoRA and QLoRA: the model a run with ``spec.adapter`` trains, built through 🤗 PEFT and bitsandbytes.

The memory estimator (:mod:`trainer_core.memory.adapters`) counts exactly what is built here, so the
two must change together:

* the frozen base is kept in the autocast dtype under bf16/fp16 mixed precision (a frozen weight needs
  no fp32 master), else fp32 (:func:`frozen_base_dtype`);
* ``qlora`` loads the base with ``BitsAndBytesConfig`` NF4: transformers quantises the Linear layers it
  picks while loading weights, so a config-built (random) model is saved once and loaded back;
* PEFT adds fp32 ``lora_A`` / ``lora_B`` to the targeted Linear modules and freezes the rest; on a
  classification task the head stays trainable as a ``modules_to_save`` copy.

PEFT's ``prepare_model_for_kbit_training`` is applied in part: it would also upcast every non-4-bit
parameter (embeddings, norms, the output head) to fp32, which only fp16 *weights* need for a stable
loss; here autocast keeps those computations in fp32 already, and the frozen copies stay 16-bit, as
estimated. Its other two steps, freezing the base and the input-grad hook for checkpointing, are done.
"""

from __future__ import annotations

import tempfile
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer_core.memory.linears import CLASSIFIER_HEADS
from trainer_core.modeling import MASTER_DTYPE, MODEL_CLASSES, resolve_config
from trainer_core.spec import JobSpec
from trainer_core.spec_adapter import AdapterSpec

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig, PretrainedConfig

_AUTOCAST_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def frozen_base_dtype(spec: JobSpec) -> torch.dtype:
    """The dtype of a frozen base under an adapter: the autocast dtype, else fp32."""
    return _AUTOCAST_DTYPES[spec.efficiency.mixed_precision]


def quantization_config(adapter: AdapterSpec) -> BitsAndBytesConfig:
    """4-bit NF4 as QLoRA loads its base, with double quant and the compute dtype of the spec."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=adapter.double_quant,
        bnb_4bit_compute_dtype=COMPUTE_DTYPES[adapter.compute_dtype],
    )


def _keep_training_layout(model: nn.Module) -> nn.Module:
    """Turn off bitsandbytes' CPU inference repacking of 4-bit weights.

    The first eval-mode, no-grad forward on an AVX512-BF16 CPU would rewrite each weight in place
    (absmax to bf16, the nested statistics dropped): the run would then train another layout than the
    one it started with and the estimator counts, and layers narrower than a 64-element block fail.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 (bnb's attribute, not typed)
    return model


def _load_quantized(spec: JobSpec, config: PretrainedConfig, weights: str | None) -> nn.Module:
    cls = MODEL_CLASSES[spec.task]
    assert spec.adapter is not None
    quant, dtype = quantization_config(spec.adapter), frozen_base_dtype(spec)
    if weights is None and spec.model.config is not None:
        # bitsandbytes quantises while weights load; a config-built model (seeded by the caller) has none
        # to load, so its random init is written once and read back quantised.
        with tempfile.TemporaryDirectory(prefix="trainjobs-qlora-") as tmp:
            cls.from_config(config, dtype=MASTER_DTYPE).save_pretrained(tmp)
            model: nn.Module = cls.from_pretrained(tmp, quantization_config=quant, dtype=dtype)
        return _keep_training_layout(model)
    model = cls.from_pretrained(
        weights or spec.model.name_or_path,
        config=config,
        revision=None if weights else spec.model.revision,
        ignore_mismatched_sizes=True,
        quantization_config=quant,
        dtype=dtype,
    )
    return _keep_training_layout(model)


def build_base_model(spec: JobSpec, labels: list[str], weights: str | None = None) -> nn.Module:
    """The base an adapter wraps: quantised for qlora, else at :func:`frozen_base_dtype`; ``weights``: a
    checkpoint folder with full weights to load instead (``init_from``)."""
    from trainer_core.modeling import build_model

    assert spec.adapter is not None
    if spec.adapter.type == "qlora":
        return _load_quantized(spec, resolve_config(spec.model, labels, spec.task), weights)
    return build_model(spec.task, spec.model, labels, weights).to(frozen_base_dtype(spec))


def lora_config(spec: JobSpec, model: nn.Module) -> Any:
    """PEFT's ``LoraConfig`` from the ``adapter`` section; classification heads stay trainable."""
    from peft import LoraConfig

    adapter = spec.adapter
    assert adapter is not None
    heads = None
    task_type = "CAUSAL_LM" if spec.task == "causal-lm" else None
    if spec.task == "text-classification":
        task_type = "SEQ_CLS"  # PEFT adds its head names to modules_to_save itself
    elif spec.task != "causal-lm":
        heads = [h for h in CLASSIFIER_HEADS if isinstance(getattr(model, h, None), nn.Module)]
    return LoraConfig(
        r=adapter.r,
        lora_alpha=adapter.alpha,  # type: ignore[arg-type]  # typed int, used as a float (alpha / r)
        lora_dropout=adapter.dropout,
        target_modules=adapter.target_modules,
        task_type=task_type,
        modules_to_save=heads,
    )


def with_adapter(spec: JobSpec, base: nn.Module, checkpointing: bool) -> nn.Module:
    """``base`` frozen and wrapped in a PEFT LoRA model; checkpointing gets the input-grad hook."""
    from peft import get_peft_model

    for param in base.parameters():
        param.requires_grad_(False)
    if checkpointing:
        # The frozen embeddings' output has no grad, so checkpointed blocks would see inputs that do not
        # require grad and backpropagate nothing into the adapters; this hook marks them (PEFT's recipe).
        base.enable_input_require_grads()  # type: ignore[operator]
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    model: nn.Module = get_peft_model(base, lora_config(spec, base))  # type: ignore[arg-type]
    return model


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors (adapters, a ``modules_to_save`` head) under their ``state_dict`` names.

    What an adapter run's checkpoint needs: the frozen base is rebuilt from its source on resume, and
    a 4-bit base's packed weights and quantisation state would not load back into ``Params4bit``.
    """
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {name: t.detach() for name, t in model.state_dict(keep_vars=True).items() if id(t) in trainable}
