"""The `algorithm:` section: one of SFT, GRPO or OPD, chosen by its `name` field.

Formulas are in docs/numerics.md; the field descriptions name the choice each knob makes.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from uniweave.config.base import StrictModel, incompatible

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


class BitflipConfig(StrictModel):
    """Input noise for BSQ teacher forcing: flip each input bit with some probability."""

    probability: float = Field(
        0.0, ge=0.0, lt=1.0, description="Bit-flip probability of input visual bits (0 = off)."
    )
    probability_mode: Literal["fixed", "uniform"] = Field(
        "fixed",
        description="fixed: every sample uses `probability`; uniform: per sample ~ U(0, probability).",
    )
    partition: Literal["all", "half"] = Field(
        "all",
        description="all: every row of the batch is noised; half: the rows at even positions "
        "of the update's distinct row seeds in ascending order are noised, the rest stay "
        "clean (docs/numerics.md §2 BitFlip).",
    )


class InformationGainConfig(StrictModel):
    """Information Gain term: reward target blocks that use their source block (full vs
    blind view; docs/numerics.md §3 "Information Gain", `uniweave.algorithms.information_gain`).

    The loss added to SFT is `weight` · L_IG; weight 0 switches IG off (no blind views).
    """

    weight: float = Field(0.0, ge=0.0, description="Weight of the IG loss (0 = off).")
    formulation: Literal["absolute", "relative_per_unit"] = Field(
        "relative_per_unit",
        description="absolute: -gain; relative_per_unit: tau*softplus(-margin/tau), "
        "margin = gain / (|blind score| + eps).",
    )
    temperature: float = Field(
        0.25, gt=0.0, description="tau of the relative_per_unit gate (UniAR: 0.25)."
    )
    eps: float = Field(
        1e-4, gt=0.0, description="Added to |blind score| in the relative margin's denominator."
    )
    text_to_visual_weight: float = Field(
        1.0, ge=0.0, description="w_dir of text->visual events (a drawing reads its text)."
    )
    visual_to_text_weight: float = Field(
        1.0, ge=0.0, description="w_dir of visual->text events (text reads the image before it)."
    )
    event_selection: Literal["cycle", "all"] = Field(
        "cycle",
        description="cycle: one event per trajectory and direction, cycling with the update "
        "number (validation pins index 0); all: every event.",
    )
    blind_view_chunk_size: int = Field(
        8, gt=0, description="Blind views (events) per forward of the detached blind pass."
    )
    student_full_view: Literal["fused", "sequential"] = Field(
        "fused",
        description="With bitflip.partition half, IG scores the clean rows. fused: their "
        "full view is the SFT forward itself (one backbone call for the noisy SFT rows and "
        "the clean IG rows); sequential: a separate eval-mode forward of the clean rows.",
    )

    @model_validator(mode="after")
    def _check(self) -> InformationGainConfig:
        if self.weight > 0 and self.text_to_visual_weight == 0 and self.visual_to_text_weight == 0:
            raise incompatible(
                "weight",
                f"weight={self.weight} has no effect with both direction weights 0",
            )
        return self


class SoftBSQConfig(StrictModel):
    """Soft-BSQ feature loss (BSQ heads): the expected code of the predicted bits and the
    target's hard code, both through the frozen codec's code -> feature projection,
    compared by squared distance (docs/numerics.md §2 "Soft-BSQ")."""

    weight: float = Field(
        0.0,
        ge=0.0,
        description="lambda of the Soft-BSQ feature loss, averaged over the global batch's "
        "scored visual positions (0 = off; needs model.visual_head bsq).",
    )


class NecessityDistillationConfig(StrictModel):
    """EMA Necessity distillation (docs/numerics.md §3 "Necessity"): an EMA shadow of the
    trainable parameters scores the necessity of each answer position's source block
    (full view vs source blinded, one fused no-grad batch) and, at the selected carriers,
    is the teacher of a generalised JSD on the clean student."""

    weight: float = Field(
        0.0, ge=0.0, description="lambda of the distillation loss (0 = off: no EMA, no views)."
    )
    ema_decay: float = Field(
        0.99,
        ge=0.0,
        lt=1.0,
        description="mu of the EMA shadow: theta_bar <- mu*theta_bar + (1-mu)*theta after "
        "every optimizer step (theta_bar_0 = theta at the run's start).",
    )
    selection: Literal["min_necessity", "fraction"] = Field(
        "min_necessity",
        description="Carriers: min_necessity, the positions with n_p >= min_necessity; "
        "fraction, the top carrier_fraction of each row's positions by n_p.",
    )
    min_necessity: float = Field(
        0.0,
        description="Threshold on n_p = log pi(y|full) - log pi(y|source blinded) under the "
        "EMA (selection min_necessity).",
    )
    carrier_fraction: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Share of each row's scored positions kept, ceil(f*n) (selection fraction).",
    )
    beta: float = Field(
        0.5, ge=0.0, le=1.0, description="beta of the generalised JSD (0.5: symmetric JSD)."
    )
    chunk_size: int = Field(
        16, gt=0, description="View rows (11 and 10 of each event) per no-grad EMA forward."
    )


class SFTConfig(StrictModel):
    """Supervised fine-tuning: cross-entropy on policy-owned target positions."""

    name: Literal["sft"] = Field("sft", description="Algorithm selector.")
    lambda_visual: float = Field(
        1.0, ge=0.0, description="Weight of the visual-token loss (VQ CE or bit CE) vs text CE."
    )
    bitflip: BitflipConfig = Field(
        default_factory=BitflipConfig, description="BSQ input bit-flip noise."
    )
    information_gain: InformationGainConfig = Field(
        default_factory=InformationGainConfig, description="Information Gain auxiliary loss."
    )
    soft_bsq: SoftBSQConfig = Field(
        default_factory=SoftBSQConfig, description="Soft-BSQ feature loss (BSQ heads)."
    )
    necessity_distillation: NecessityDistillationConfig = Field(
        default_factory=NecessityDistillationConfig,
        description="EMA Necessity distillation auxiliary loss.",
    )


class KLConfig(StrictModel):
    """Divergence penalty to the frozen reference policy (the initial weights)."""

    type: Literal["none", "k1", "k2", "k3", "jsd"] = Field(
        "none",
        description="none | k1 (l - l_ref) | k2 (0.5 d^2) | k3 (exp(d) - d - 1) | jsd (full-distribution symmetric JSD).",
    )
    coef: float = Field(0.0, ge=0.0, description="Coefficient of the penalty in the loss.")


class MismatchConfig(StrictModel):
    """Guards against the rollout-training mismatch (docs/numerics.md §7a): the sampler's
    log-prob ℓˢ of each action against the replay ℓ° of the same parameters at training
    geometry, Δ = ℓ° − ℓˢ. A masked action contributes 0 to the policy-gradient term; the
    normalisers stay those of the whole batch; the reference penalty is not masked."""

    replay_bound: float | None = Field(
        None,
        gt=1.0,
        description="C > 1: mask every action of a trajectory whose replay/sampler ratio, "
        "the geometric mean exp(mean_t Δ) over its scored actions, lies outside [1/C, C] "
        "(masked importance sampling per trajectory); null = off.",
    )
    percentile: float | None = Field(
        None,
        gt=0.0,
        lt=100.0,
        description="p in (0, 100): mask the actions whose |Δ| exceeds the p-th percentile "
        "(nearest rank) of |Δ| over every scored action of the update's global batch, all "
        "micro-batches and ranks; with updates_per_batch 1 the source then anchors the rows "
        "with a no-grad replay before the update; null = off.",
    )


class RLInformationGainConfig(StrictModel):
    """RL Information Gain (GRPO; docs/numerics.md §3a): before the update, the behaviour
    policy scores each rollout's answer block with and without its source block (fused
    11/10 views, no grad); the necessity N_i = S_11 - S_10 shapes the reward,
    r' = r + weight * clip(N_i, -clip, clip), before the group advantages."""

    weight: float = Field(
        0.0, ge=0.0, description="lambda_IG of the reward shaping (0 = off: no views scored)."
    )
    clip: float = Field(1.0, gt=0.0, description="c: N_i is clipped to [-c, c].")
    chunk_size: int = Field(
        16, gt=0, description="View rows (11 and 10 of each rollout) per no-grad forward."
    )


class GRPOConfig(StrictModel):
    """Group-relative policy optimisation with a clipped surrogate (docs/numerics.md §4-7).

    An update draws trainer.global_batch_size / group_size fresh prompts and G samples of
    each (`uniweave.train.methods.grpo.source`).
    """

    name: Literal["grpo"] = Field("grpo", description="Algorithm selector.")
    group_size: int = Field(
        8, ge=2, description="G: samples per prompt (prompts per update = global_batch_size / G)."
    )
    scope: Literal["group", "global"] = Field(
        "group", description="Advantage baseline: per-prompt group, or the whole gathered batch."
    )
    normalize_by_std: bool = Field(
        True, description="Divide advantages by std + eps (false: A = r - mean, Dr.GRPO)."
    )
    std_ddof: Literal[0, 1] = Field(
        1,
        description="Std degrees of freedom: 1 = sample std (default; verl, TRL), 0 = population.",
    )
    eps: float = Field(
        1e-6, gt=0.0, description="Added to the std in the advantage denominator (verl: 1e-6)."
    )
    clip_low: float = Field(
        0.2, gt=0.0, lt=1.0, description="eps_low: ratio floor is 1 - clip_low."
    )
    clip_high: float = Field(0.2, gt=0.0, description="eps_high: ratio cap is 1 + clip_high.")
    dual_clip: float | None = Field(
        None, gt=1.0, description="Dual-clip constant c > 1 for A < 0 (verl: 3); null = off."
    )
    aggregation: Aggregation = Field(
        "token_mean", description="How per-position losses are reduced (docs/numerics.md §6)."
    )
    horizon: int | None = Field(
        None, gt=0, description="H for seq_mean_token_sum_norm (required there)."
    )
    kl: KLConfig = Field(default_factory=KLConfig, description="Penalty to the reference policy.")
    old_logp_source: Literal["rollout", "replay"] = Field(
        "replay",
        description="Ratio denominator: the sampler's log-probs (rollout) or a replay at training geometry.",
    )
    updates_per_batch: int = Field(
        1,
        ge=1,
        description="Consecutive optimizer steps on one rollout batch (PPO epochs; > 1 needs "
        "old_logp_source replay).",
    )
    surrogate: Literal["standard", "aligned"] = Field(
        "standard",
        description="standard: the clipped surrogate on exp(l - l_old) (old from "
        "old_logp_source); aligned: clipped on the replay ratio exp(l - l_replay_old), "
        "weighted by the sampler correction sg(exp(l_replay_old - l_sampled)), so its value "
        "is the ratio to the sampler and its gradient rho_sampled * grad l "
        "(docs/numerics.md §5a).",
    )
    mismatch: MismatchConfig = Field(
        default_factory=MismatchConfig,
        description="Rollout-training mismatch guards (replay bound, percentile mask).",
    )
    chunk_size: int = Field(
        128, gt=0, description="Scored positions per head chunk in replay (memory vs speed)."
    )
    share_prompt_prefix: bool = Field(
        False,
        description="Replay runs each distinct prompt through the body once and the group's "
        "completions against its KV cache (same loss and gradients; tiny model with "
        "model.tiny.mixer_kernel 0).",
    )
    information_gain: RLInformationGainConfig = Field(
        default_factory=RLInformationGainConfig,
        description="RL Information Gain: necessity-shaped rewards (behaviour policy, no grad).",
    )

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if self.old_logp_source == "rollout" and self.updates_per_batch > 1:
            raise incompatible(
                "old_logp_source",
                f"'rollout' requires updates_per_batch=1 (got {self.updates_per_batch}): "
                "later updates must anchor the ratio at a replay at training geometry; "
                "use old_logp_source=replay",
            )
        if self.aggregation == "seq_mean_token_sum_norm" and self.horizon is None:
            raise incompatible("horizon", "aggregation 'seq_mean_token_sum_norm' requires horizon")
        return self


class TeacherConfig(StrictModel):
    """The frozen teacher of OPD: any registered model checkpoint."""

    path: str | None = Field(
        None,
        min_length=1,
        description="Directory (or hub id org/name) of the teacher checkpoint, any "
        "registered kind (required).",
    )
    privilege: Literal["none", "answer"] = Field(
        "none",
        description="What the teacher sees that the student does not: none | answer (the "
        "row's reference answer, appended to the prompt; scored positions still align).",
    )


class ModalityWeights(StrictModel):
    """Weights w_m of the per-position divergence (and GT-replay CE) by modality."""

    text: float = Field(1.0, ge=0.0, description="Weight of text positions.")
    visual: float = Field(1.0, ge=0.0, description="Weight of visual positions (VQ or BSQ).")


class GTReplayConfig(StrictModel):
    """Ground-truth rows added to each update, trained with the SFT cross-entropy."""

    mode: Literal["none", "uniform", "failure"] = Field(
        "none",
        description="none | uniform (budget train rows drawn uniformly) | failure (the "
        "ground truth of prompts whose trajectory failed its verifier or hit a cap).",
    )
    budget: int = Field(0, ge=0, description="GT rows per update (required > 0 unless mode none).")

    @model_validator(mode="after")
    def _check(self) -> GTReplayConfig:
        if self.mode == "none" and self.budget:
            raise incompatible("budget", f"budget={self.budget} has no effect with mode 'none'")
        if self.mode != "none" and self.budget == 0:
            raise incompatible("budget", f"mode {self.mode!r} needs budget > 0")
        return self


class OPDConfig(StrictModel):
    """On-policy distillation (docs/numerics.md §9): each update samples one
    trajectory per prompt (trainer.global_batch_size prompts) from the student at
    rollout.temperature / rollout.bit_temperature, the frozen teacher scores the same
    positions, and the student steps on the trajectory-first generalised JSD."""

    name: Literal["opd"] = Field("opd", description="Algorithm selector.")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="The frozen teacher.")
    beta: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Generalised-JSD beta: 0 = KL(T||S), 0.5 = JSD, 1 = KL(S||T).",
    )
    student_sampling: Literal["temperature", "greedy"] = Field(
        "temperature",
        description="Student rollouts: sample at the rollout temperatures, or take the mode "
        "(the divergence is at the rollout temperatures either way).",
    )
    modality_weights: ModalityWeights = Field(
        default_factory=ModalityWeights, description="Per-modality weights of the divergence."
    )
    events: Literal["first_complete_window", "all_complete_transitions"] = Field(
        "all_complete_transitions",
        description="Scored events: every complete segment, or the first complete image "
        "and the text after it.",
    )
    top_k: int = Field(
        0, ge=0, description="Score on the union of teacher and student top-k ids (0 = full vocab)."
    )
    retained_mass_min: float = Field(
        0.95,
        ge=0.0,
        le=1.0,
        description="Fall back to the full vocab where the top-k union keeps less teacher mass.",
    )
    chunk_size: int = Field(
        128, gt=0, description="Scored positions per head chunk (memory vs speed)."
    )
    routing: Literal["all", "correct_only", "privileged_correction"] = Field(
        "all",
        description="all | correct_only (verifier-correct rows only) | privileged_correction "
        "(correct rows vs the plain teacher, wrong ones vs the privileged teacher).",
    )
    gt_replay: GTReplayConfig = Field(
        default_factory=GTReplayConfig, description="Ground-truth replay."
    )
    text_clip: float | None = Field(
        None,
        gt=0.0,
        description="Text contribution clipping (docs/numerics.md §9): a distilled row's "
        "text part of D_i is scaled down to at most this many nats, gradient scaled alike "
        "(null = off).",
    )
    carriers: Literal["all", "necessity"] = Field(
        "all",
        description="Distilled positions: all scored positions of the events, or necessity "
        "only: those where the teacher's log-prob with the source block visible minus "
        "with it blinded (C11/C10, one fused no-grad batch) is >= carrier_min_necessity "
        "(docs/numerics.md §3a).",
    )
    carrier_min_necessity: float = Field(
        0.0, description="Threshold on the teacher's per-position necessity (carriers necessity)."
    )

    @model_validator(mode="after")
    def _check(self) -> OPDConfig:
        if self.teacher.path is None:
            raise incompatible("teacher.path", "opd needs a teacher checkpoint directory")
        if self.gt_replay.mode == "failure" and self.routing == "all":
            raise incompatible(
                "gt_replay.mode",
                "'failure' needs a verifier routing (routing correct_only or "
                "privileged_correction); got routing 'all'",
            )
        if self.routing == "privileged_correction" and self.teacher.privilege == "none":
            raise incompatible(
                "teacher.privilege",
                "routing 'privileged_correction' needs a privileged teacher (privilege: answer)",
            )
        return self


AlgorithmConfig = Annotated[Union[SFTConfig, GRPOConfig, OPDConfig], Field(discriminator="name")]
