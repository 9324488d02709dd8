"""The ``adapter`` section of the job spec (LoRA / QLoRA).

Kept apart from :mod:`trainer_core.spec` like the optimizer section: the spec imports it. The
memory estimator (``trainer_core/memory/adapters.py``) and the model builder
(``trainer_core/adapters.py``) read every field here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainer_core.spec_base import StrictModel, combination_error

AdapterType = Literal["lora", "qlora"]
ComputeDtype = Literal["bf16", "fp16", "fp32"]
# Fields only QLoRA reads; on a LoRA adapter they must keep their defaults (a dumped spec lists them).
QLORA_FIELDS = ("double_quant", "compute_dtype")


class AdapterSpec(StrictModel):
    """A low-rank adapter through 🤗 PEFT; ``qlora`` also loads the base in 4-bit NF4 (bitsandbytes)."""

    type: AdapterType
    r: int = Field(default=16, ge=1, le=4096, description="LoRA rank.")
    alpha: float = Field(default=32.0, gt=0, le=65536, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(default=0.05, ge=0, lt=1)
    target_modules: Literal["all-linear"] | list[str] = Field(
        default="all-linear",
        description="`all-linear` (every Linear but the output head, as PEFT does) or module-name suffixes.",
    )
    double_quant: bool = Field(default=True, description="QLoRA: quantise the 4-bit blocks' absmax too.")
    compute_dtype: ComputeDtype = Field(default="bf16", description="QLoRA: dtype of the 4-bit matmuls.")
    merge: bool = Field(
        default=False, description="Also write the base with the adapter merged in (`merged/`); LoRA only."
    )

    @model_validator(mode="after")
    def _fields_match_type(self) -> AdapterSpec:
        if isinstance(self.target_modules, list) and (
            not self.target_modules or any(not name.strip() for name in self.target_modules)
        ):
            raise combination_error("adapter.target_modules", "name at least one module, none empty")
        if self.merge and self.type == "qlora":
            raise combination_error(
                "adapter.merge", "qlora adapters are not merged: folding them into 4-bit weights loses precision"
            )
        if self.type == "lora":
            fields = type(self).model_fields
            changed = [f for f in QLORA_FIELDS if getattr(self, f) != fields[f].default]
            if changed:
                raise combination_error(f"adapter.{changed[0]}", "applies to adapter type 'qlora' only")
        return self
