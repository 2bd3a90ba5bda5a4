"""The `trainer:` section: optimizer, schedule, batch geometry, precision and LoRA.

One "update" is one optimizer step; `total_updates` counts them.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from uniweave.config import methods as registry
from uniweave.config.acts import ActsWhen, method_of, on_rows
from uniweave.config.base import StrictModel, incompatible

Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class OptimizerConfig(StrictModel):
    """AdamW (torch.optim.AdamW argument names)."""

    lr: float = Field(1e-4, gt=0.0, description="Peak learning rate.")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="Adam (beta1, beta2).")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay.")
    eps: float = Field(1e-8, gt=0.0, description="Adam denominator epsilon.")


WARMS_UP = ActsWhen(
    lambda cfg: cfg.trainer.scheduler.name != "constant",
    "with a warmup schedule (warmup_cosine, warmup_constant)",
    "the 'constant' schedule has no warmup; set trainer.scheduler.name=warmup_constant (or "
    "trainer.scheduler.warmup_steps=0)",
)
DECAYS = ActsWhen(
    lambda cfg: cfg.trainer.scheduler.name == "warmup_cosine",
    "with scheduler.name warmup_cosine",
    lambda cfg: (
        f"the '{cfg.trainer.scheduler.name}' schedule keeps the peak lr; "
        "min_lr_ratio is for 'warmup_cosine'"
    ),
)


class SchedulerConfig(StrictModel):
    """Learning-rate multiplier as a function of the update index."""

    name: Literal["constant", "warmup_cosine", "warmup_constant"] = Field(
        "constant",
        description="constant | warmup_cosine (linear warmup, cosine to min_lr_ratio) | warmup_constant.",
    )
    warmup_steps: Annotated[int, WARMS_UP] = Field(
        0, ge=0, description="Linear warmup length in updates."
    )
    min_lr_ratio: Annotated[float, DECAYS] = Field(
        0.0, ge=0.0, le=1.0, description="Final lr / peak lr for warmup_cosine."
    )


LORA_ON = ActsWhen(
    lambda cfg: cfg.trainer.lora.enabled,
    "with trainer.lora.enabled true",
    "acts only with trainer.lora.enabled true (LoRA is off)",
)


def _parallel(*modes: str, why: str = "") -> ActsWhen:
    """Acts only with `trainer.parallel` one of `modes`; `why`: the error's tail."""
    words = " or ".join(modes)
    return ActsWhen(
        lambda cfg: cfg.trainer.parallel in modes,
        f"with trainer.parallel {words}",
        lambda cfg: f"acts only with trainer.parallel {words} (got '{cfg.trainer.parallel}'{why})",
    )


def _packers() -> str:
    return " or ".join(m.name for m in registry.methods() if m.packing)


PACKS = (
    ActsWhen(
        lambda cfg: method_of(cfg).packing is not None,
        lambda: f"with {_packers()}",
        lambda cfg: f"packing is built for {_packers()}, not {cfg.algorithm.name}",
    ),
    ActsWhen(
        lambda cfg: cfg.model.kind == "tiny",
        "with model.kind tiny",
        lambda cfg: f"packing needs model.kind=tiny (got {cfg.model.kind})",
    ),
)
EPOCH_EVALS = on_rows(
    "{name} draws each task's prompts from its own pool, so the run has no single epoch boundary"
)
PROCESS_GROUP = ActsWhen(
    lambda cfg: cfg.trainer.parallel != "none",
    "with trainer.parallel ddp or fsdp2",
    "acts only with trainer.parallel ddp or fsdp2 (parallel 'none' runs one process and "
    "opens no process group)",
)


class LoRAConfig(StrictModel):
    """Low-rank adapters via peft (base weights frozen when enabled)."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    r: Annotated[int, LORA_ON] = Field(8, gt=0, description="Adapter rank.")
    alpha: Annotated[float, LORA_ON] = Field(
        16.0, gt=0.0, description="LoRA scaling numerator (scale = alpha / r)."
    )
    dropout: Annotated[float, LORA_ON] = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input."
    )
    rslora: Annotated[bool, LORA_ON] = Field(
        False, description="Rank-stabilised LoRA: scale = alpha / sqrt(r) instead of alpha / r."
    )
    target_modules: Annotated[str, LORA_ON] = Field(
        r".*\.(q_proj|k_proj|v_proj|o_proj)$",
        min_length=1,
        description="Regex (full match) of module names that get adapters.",
    )

    @field_validator("target_modules")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class DDPConfig(StrictModel):
    """torch DistributedDataParallel options (`trainer.parallel: ddp`)."""

    find_unused_parameters: bool = Field(
        True,
        description="Let DDP find parameters a backward did not reach (a micro-batch "
        "without images skips the visual head); false is faster when every step uses all.",
    )
    static_graph: bool = Field(
        False, description="Tell DDP the set of used parameters is the same every iteration."
    )


class FSDPConfig(StrictModel):
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) options (`trainer.parallel: fsdp2`)."""

    param_dtype: Literal["fp32", "bf16", "fp64"] = Field(
        "bf16",
        description="Dtype parameters are all-gathered in for forward/backward "
        "(fp64 only with trainer.precision fp64).",
    )
    reduce_dtype: Literal["fp32", "bf16", "fp64"] = Field(
        "fp32",
        description="Dtype gradients are reduce-scattered in (fp64 only with "
        "trainer.precision fp64).",
    )
    reshard_after_forward: bool = Field(
        True, description="Free each layer's gathered parameters after its forward (ZeRO-3)."
    )


class TrainerConfig(StrictModel):
    """Optimisation loop settings."""

    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW.")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="Learning-rate schedule."
    )
    total_updates: int = Field(100, gt=0, description="Number of optimizer steps in the run.")
    global_batch_size: int = Field(
        16, gt=0, description="Trajectories per update, summed over ranks and micro-batches."
    )
    micro_batch_size: int = Field(
        8, gt=0, description="Trajectories per forward/backward (must divide global_batch_size)."
    )
    micro_token_budget: int | None = Field(
        None,
        gt=0,
        description="If set, pack micro-batches up to this many padded tokens (rows x longest "
        "row); micro_batch_size still caps the rows of each.",
    )
    packing: Annotated[bool, PACKS] = Field(
        False,
        description="SFT: pack each micro-batch's rows into rows as long as its longest "
        "(attention confined to each sequence, positions restarted); less padding, same loss.",
    )
    grad_clip: float | None = Field(1.0, gt=0.0, description="Max global grad norm; null = off.")
    precision: Literal["fp32", "bf16", "fp64"] = Field(
        "fp32",
        description="fp32; bf16 (autocast forward, fp32 weights and optimizer state); fp64 "
        "(float64 weights, compute and optimizer state end to end: numerical checks, e.g. "
        "that data-parallel runs equal one process beyond fp32 reduction-order rounding).",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    eval_every: int = Field(
        0, ge=0, description="Evaluate on the val split every N updates (0 = off)."
    )
    eval_every_epochs: Annotated[int, EPOCH_EVALS] = Field(
        0,
        ge=0,
        description="SFT: also evaluate on the val split at every N-th exact epoch boundary "
        "(the update whose batch holds the epoch's last row; 0 = off).",
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters.")
    parallel: Literal["none", "ddp", "fsdp2"] = Field(
        "none",
        description="Data parallelism under torchrun: none (one process) | ddp "
        "(DistributedDataParallel) | fsdp2 (fully_shard per decoder layer and root).",
    )
    world_size: int = Field(
        1,
        ge=1,
        description="N > 1: `uniweave train` spawns N local worker processes (one per device; "
        "the same as `torchrun --standalone --nproc-per-node N`); needs parallel ddp or "
        "fsdp2, refused under torchrun. Several nodes: torchrun.",
    )
    collective_timeout_s: Annotated[float, PROCESS_GROUP] = Field(
        1800.0, gt=0.0, description="Timeout of every collective (process-group timeout)."
    )
    gradient_sync: Annotated[
        Literal["ddp", "post_backward_sum"],
        _parallel("ddp", why="; fsdp2 always reduce-scatters with SUM"),
    ] = Field(
        "ddp",
        description="trainer.parallel ddp: how gradients are summed over ranks. ddp: DDP's own "
        "buckets (each rank's gradient divided by the world size, all-reduced during "
        "backward), then multiplied by the world size after the update's last backward "
        "(bitwise the sum when the world size is a power of two); post_backward_sum: a "
        "communication hook that all-reduces each bucket with SUM, no division (diagnostics).",
    )
    ddp: Annotated[DDPConfig, _parallel("ddp")] = Field(
        default_factory=DDPConfig, description="DDP options."
    )
    fsdp: Annotated[FSDPConfig, _parallel("fsdp2")] = Field(
        default_factory=FSDPConfig, description="FSDP2 options."
    )

    @model_validator(mode="after")
    def _geometry(self) -> TrainerConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise incompatible(
                "micro_batch_size",
                f"{self.micro_batch_size} does not divide "
                f"global_batch_size={self.global_batch_size}",
            )
        if self.parallel == "fsdp2" and self.micro_token_budget is not None:
            raise incompatible(
                "micro_token_budget",
                "length buckets give ranks different numbers of micro-batches; fsdp2 "
                "needs the same all-gathers on every rank (use micro_batch_size)",
            )
        if self.world_size > 1 and self.parallel == "none":
            raise incompatible(
                "world_size",
                f"{self.world_size} workers need trainer.parallel ddp or fsdp2 (got 'none')",
                also=("parallel",),
            )
        for name in ("param_dtype", "reduce_dtype"):
            fp64 = getattr(self.fsdp, name) == "fp64"
            if fp64 != (self.precision == "fp64") and (fp64 or self.parallel == "fsdp2"):
                raise incompatible(
                    f"fsdp.{name}",
                    "fp64 goes with trainer.precision fp64 and nothing else (float64 "
                    "weights cannot be gathered or reduced in another dtype, nor float32 "
                    "ones in float64)",
                )
        if self.scheduler.warmup_steps > self.total_updates:
            raise incompatible(
                "scheduler.warmup_steps",
                f"{self.scheduler.warmup_steps} warmup updates exceed trainer.total_updates="
                f"{self.total_updates}; for a short trial run also set "
                f"trainer.scheduler.warmup_steps={self.total_updates // 10} (at most "
                f"total_updates), or raise trainer.total_updates",
                also=("total_updates",),
            )
        return self
