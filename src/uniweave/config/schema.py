"""The run schema: `UniweaveConfig` and its sections (one YAML section per model).

Every field has a type, a default and a one-line description, so `run: {}` is a valid
config (the embedded tiny model, SFT on the digits t2i task); an empty file is refused. Cross-field checks
raise `incompatible(...)` naming the dotted key at fault.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import Field, model_validator
from pydantic.fields import FieldInfo

from uniweave.config import methods as registry
from uniweave.config.acts import ActsWhen, method_of, on_rollouts, on_rows, refuse_inactive
from uniweave.config.algorithms import AlgorithmConfig, SFTConfig
from uniweave.config.base import StrictModel, incompatible
from uniweave.config.errors import suggest
from uniweave.config.ray import REWARD_WORKERS, ROLLOUT_WORKERS, SOME_WORKERS, RayConfig
from uniweave.config.trainer import TrainerConfig

Task = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$", max_length=64)]
"""A task label: any name a dataset row carries in its `task` field."""
DIGITS_TASKS: tuple[str, ...] = (
    "t2i",
    "i2t_mc",
    "jigsaw_mc",
    "draw_then_answer",
    "i2t_open",
    "i2t_mc_say",
    "mc_lookup",
    "i2t_pick",
    "i2t_mc_first",
    "i2t_hint",
    "i2t_hint_wrong",
)
"""The built-in digits data provider's tasks (`uniweave.data.digits.TASKS` is this tuple)."""
IMAGE_GENERATION_TASKS: frozenset[str] = frozenset({"t2i", "draw_then_answer"})
"""The digits tasks whose answers hold an image (dataset rows say so themselves)."""
DIGITS_IMAGE_SIZE = 8  # == uniweave.data.digits_images.IMAGE_SIZE (not imported: keep CLI light)
Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")
"""The digits image splits (`uniweave.data.digits_images` re-exports them; here so that
`uniweave data export --help` needs no numpy)."""


class RunConfig(StrictModel):
    """Identity of a run."""

    name: str = Field("uniweave", min_length=1, description="Run name (used in logs and paths).")
    seed: int = Field(0, ge=0, description="Run seed: all sampling seeds derive from it.")
    output_dir: str | None = Field(
        None, description="Run directory (created by train, never by loading); null = runs/<name>."
    )
    parent: str | None = Field(
        None,
        description="Start this (new) run directory from a parent run's newest intact "
        "checkpoint, or from the checkpoint directory named (docs/campaigns.md); the "
        "changes allowed against it are checkpoint.resume_mode's. A retry of this run "
        "resumes from its own newest checkpoint first.",
    )
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$", description="auto | cpu | mps | cuda[:N]."
    )
    deterministic: bool = Field(
        True,
        description="Deterministic kernels (torch.use_deterministic_algorithms; on CUDA "
        "also CUBLAS_WORKSPACE_CONFIG=:4096:8): the same command gives the same bits at "
        "a fixed thread count and device. Off: faster, and runs (and resumes) agree only "
        "to float rounding (~1e-7), which can grow over updates.",
    )
    host_mmap_threshold: int | None = Field(
        None,
        gt=0,
        le=32 * 1024 * 1024,  # uniweave.core.host_memory.MAX_THRESHOLD (config imports no torch)
        description="Bytes from which a freed host (CPU) block goes straight back to the "
        "OS (glibc mallopt M_MMAP_THRESHOLD, fixed): the resident set then follows the "
        "live tensors, as `uniweave plan --host` predicts, at the price of a fresh mapping "
        "per large temporary (tiny SFT recipe 1.6x slower, CPU bf16 steps at Janus-Pro-1B "
        "1.45-2.09x; docs/plan.md, 'On the host'). null (default): glibc's dynamic "
        "threshold (or MALLOC_MMAP_THRESHOLD_), which keeps freed temporaries resident "
        "for reuse: fastest, and a step's peak can exceed the plan by the range "
        "`uniweave plan --host` prints. 1048576 (1 MiB) for predictable host memory. "
        "Not glibc: not applied, said in the log.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_output_dir(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("output_dir") is None:
            return {**data, "output_dir": f"runs/{data.get('name', 'uniweave')}"}
        return data


class DecoderSizes(StrictModel):
    """The sizes of a decoder built from the config (their one definition): the base of
    `TinyModelConfig` (the `model.tiny` keys) and of the classes the model packages build
    from (`uniweave.models.tiny.TinyArchitecture`, `uniweave.models.uniar.TinyUniARSizes`)."""

    hidden_size: int = Field(128, gt=0, description="Residual width.")
    num_layers: int = Field(4, gt=0, description="Decoder layers.")
    num_heads: int = Field(4, gt=0, description="Attention heads (must divide hidden_size).")
    intermediate_size: int = Field(512, gt=0, description="MLP inner width.")
    max_position_embeddings: int = Field(
        512, gt=0, description="Native context length (a rollout stop condition)."
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> DecoderSizes:
        if self.hidden_size % self.num_heads:
            raise incompatible(
                "num_heads", f"{self.num_heads} does not divide hidden_size={self.hidden_size}"
            )
        return self


LOADED_WITH: dict[str, str] = {"tiny": "its own sizes", "codec": "its own image codec"}


def _kind_reads(section: str, name: str | None = None) -> Callable[[Any], bool]:
    """Whether `cfg.model.kind`'s builder reads `model.<section>` (any field of it, or
    field `name`). A kind that only loads checkpoints and has no model.path yet passes:
    `uniweave.models.check_model_config` refuses it ("loads a local checkpoint"), the
    clearer error."""

    def reads(cfg: Any) -> bool:
        fields = KIND_READS.get(cfg.model.kind)
        if fields is None:
            return True
        if not KIND_READS[cfg.model.kind]["tiny"] and cfg.model.path is None:
            return True
        return bool(fields[section]) if name is None else name in fields[section]

    return reads


RECORDS_SIZES: dict[str, tuple[str, ...]] = {"tiny": ("tiny", "uniar"), "codec": ("tiny",)}
"""Per `model.<section>`: the kinds whose model directories record that section's values
(`uniweave.models.registry.saved_sizes`: a tiny model's `uniweave_model.json` and codec, a
UniAR's Qwen3-VL `config.json`), so that a value given next to their `model.path` is checked
against the directory there."""


def _built_here(section: str) -> ActsWhen:
    """`model.<section>` acts only for a model built from the config: a `model.path`
    checkpoint is loaded with its own sizes and codec. A tiny model directory records
    them, so there `uniweave.models.registry.with_saved_sizes` takes them from it and
    refuses a given value that differs (it reads files; the schema does not)."""
    return ActsWhen(
        lambda cfg: cfg.model.path is None or cfg.model.kind in RECORDS_SIZES[section],
        "for a model built from the config (model.path null; with a "
        f"{' or '.join(RECORDS_SIZES[section])} model.path, a value given must be the one its "
        "directory records, which fills the others)",
        lambda cfg: (
            f"acts only for a model built from the config (model.path null); "
            f"model.path {cfg.model.path} is loaded with {LOADED_WITH[section]}"
        ),
    )


OWN_CODEC = ActsWhen(
    lambda cfg: cfg.model.path is None or cfg.model.kind == "tiny",
    "for a model built from the config (model.path null; with a tiny model.path, only as "
    "the codec the model directory holds)",
    lambda cfg: (
        "acts only for a model built from the config (model.path null); "
        f"model.path {cfg.model.path} is loaded with its own image codec"
    ),
)


def _kind_builds(section: str) -> ActsWhen:
    return ActsWhen(
        _kind_reads(section),
        "with a kind that builds from the config (tiny, uniar)",
        lambda cfg: KIND_IGNORES[cfg.model.kind, section],
    )


def _fitted_head(head: str) -> ActsWhen:
    """A size of the codec fitted here that only `head`'s codec has."""
    return ActsWhen(
        lambda cfg: (
            cfg.model.path is not None  # a loaded model's codec: its directory's sizes
            or cfg.model.codec.path is not None
            or cfg.model.visual_head == head
        ),
        f"with model.visual_head {head} (for a codec fitted here; a model.codec.path codec "
        "has its own)",
        lambda cfg: (
            f"acts only with model.visual_head {head} (the codec fitted here is "
            f"{cfg.model.visual_head})"
        ),
    )


class TinyModelConfig(DecoderSizes):
    """Sizes of a decoder built from the config: model.kind tiny (every field) or uniar
    (all but tie_embeddings; mixer_kernel must be 0: `KIND_READS`); a model.path
    checkpoint, and a kind that only loads checkpoints, read none."""

    mixer_kernel: int = Field(
        4,
        ge=0,
        description="Depthwise causal conv over the last k positions after each layer norm "
        "(0 = off).",
    )
    tie_embeddings: Annotated[
        bool,
        ActsWhen(
            _kind_reads("tiny", "tie_embeddings"),
            "with model.kind tiny",
            lambda cfg: KIND_IGNORES[cfg.model.kind, "tiny"],
        ),
    ] = Field(
        False,
        description="Share one matrix between the input token embedding and the text "
        "output head (logits = h @ E^T).",
    )


def _kind_reads_codec(name: str) -> ActsWhen:
    """A `model.codec` geometry field only some builders read (uniar: not)."""
    return ActsWhen(
        _kind_reads("codec", name),
        "with model.kind tiny",
        lambda cfg: KIND_IGNORES[cfg.model.kind, "codec"],
    )


class CodecConfig(StrictModel):
    """The embedded image codec of the tiny model (real checkpoints ship their own)."""

    path: Annotated[str | None, OWN_CODEC] = Field(
        None,
        description="Directory of a fitted codec; null = fit one on the digits train split "
        "(8px greyscale) or on digits-world canvases of image_size and channels.",
    )
    patch_size: int = Field(2, gt=0, description="Pixels per side of one visual position.")
    codebook_size: Annotated[int, _fitted_head("vq")] = Field(
        32, ge=2, description="VQ codebook entries."
    )
    bits: Annotated[int, _fitted_head("bsq")] = Field(16, gt=0, description="BSQ bits L per patch.")
    group: Annotated[int, _fitted_head("bsq")] = Field(
        1, gt=0, description="BSQ: k x k patches form one position of k*k*L bits (1 = none)."
    )
    image_size: Annotated[int, _kind_reads_codec("image_size")] = Field(
        DIGITS_IMAGE_SIZE,
        gt=0,
        multiple_of=DIGITS_IMAGE_SIZE,
        description="Pixels per side of the codec's square images: 8 = one digit; a "
        "multiple of 8 = a canvas of (image_size/8)^2 digit cells (the digits world), "
        "which a codec built here is fitted on.",
    )
    channels: Annotated[Literal[1, 3], _kind_reads_codec("channels")] = Field(
        1, description="Colour channels of the codec's images: 1 greyscale, 3 RGB."
    )

    @model_validator(mode="after")
    def _grid(self) -> CodecConfig:
        if self.image_size % self.patch_size:
            raise incompatible(
                "patch_size", f"{self.patch_size} does not divide the {self.image_size}px image"
            )
        grid = self.image_size // self.patch_size
        if grid % self.group:
            raise incompatible("group", f"{self.group} does not divide the {grid}x{grid} grid")
        return self


KIND_READS: dict[str, dict[str, tuple[str, ...]]] = {
    "tiny": {"tiny": tuple(TinyModelConfig.model_fields), "codec": tuple(CodecConfig.model_fields)},
    "uniar": {
        "tiny": tuple(n for n in TinyModelConfig.model_fields if n != "tie_embeddings"),
        "codec": tuple(n for n in CodecConfig.model_fields if n not in ("image_size", "channels")),
    },
    "janus_pro": {"tiny": (), "codec": ()},
}
"""The `model.tiny` and `model.codec` fields each registered kind's builder reads
(`uniweave.models.tiny.build.build_tiny`, `uniweave.models.uniar.tiny.build_uniar`; janus_pro
has no builder: it always loads model.path). A kind not listed is left to the model
registry, which refuses an unknown kind."""
KIND_IGNORES: dict[tuple[str, str], str] = {
    ("uniar", "tiny"): "acts only with model.kind tiny (kind 'uniar' builds its Qwen3-VL "
    "decoder with untied embeddings)",
    ("uniar", "codec"): "acts only with model.kind tiny (kind 'uniar' reads 8x8 greyscale "
    "digits through its fixed Qwen image processor)",
    ("janus_pro", "tiny"): "acts only for a model built from the config (kind tiny or uniar); "
    "kind 'janus_pro' takes its sizes from the model.path checkpoint",
    ("janus_pro", "codec"): "acts only for a model built from the config (kind tiny or uniar); "
    "kind 'janus_pro' ships its image codec in the model.path checkpoint",
}


ADAPTER_BASE = ActsWhen(
    lambda cfg: cfg.model.path is not None,
    "with model.path (the base the adapter was trained on)",
    "needs model.path (the base the adapter was trained on)",
)
ADAPTER_LORA = ActsWhen(
    lambda cfg: cfg.trainer.lora.enabled,
    "with trainer.lora.enabled true",
    "is trained on unmerged: it needs trainer.lora.enabled true (with the adapter's r, "
    "alpha and target_modules)",
)


class ModelConfig(StrictModel):
    """Which unified model to post-train.

    `kind` names a kind a model package registers (`uniweave.models.registry`); the kind's
    registration is checked (known and implemented, its visual heads, whether it needs
    `path`) by `uniweave.models.check_model_config` before a model is built. The
    `model.tiny` and `model.codec` sections act only for a model built from the config
    (their `ActsWhen` declarations).
    """

    kind: str = Field(
        "tiny",
        pattern=r"^[a-z][a-z0-9_]*$",
        description="A registered model kind: tiny (embedded) | janus_pro (VQ) | ...",
    )
    path: str | None = Field(
        None,
        description="Checkpoint directory, or a hub id org/name resolved through "
        "huggingface_hub's cache (HF_HUB_OFFLINE honoured; a local path wins); required "
        "unless the kind builds from the config, as tiny does.",
    )
    visual_head: Literal["vq", "bsq"] = Field(
        "vq", description="Visual action space: VQ codebook softmax or BSQ Bernoulli bits."
    )
    initial_adapter: Annotated[str | None, ADAPTER_BASE, ADAPTER_LORA] = Field(
        None,
        description="A LoRA run's adapter/ directory (peft format + uniweave_adapter.json) to "
        "start from, unmerged, on model.path (needs trainer.lora with the same r, alpha, "
        "rslora and target_modules, and the base it was trained on).",
    )
    tiny: Annotated[TinyModelConfig, _kind_builds("tiny"), _built_here("tiny")] = Field(
        default_factory=TinyModelConfig,
        description="Tiny sizes; with model.path (kind tiny), the sizes the model directory "
        "records fill them (stated in the log, recorded in config.yaml).",
    )
    codec: Annotated[CodecConfig, _kind_builds("codec"), _built_here("codec")] = Field(
        default_factory=CodecConfig,
        description="Tiny model's codec; with model.path (kind tiny), its codec's sizes "
        "fill these.",
    )


def _in_process(why: str) -> ActsWhen:
    return ActsWhen(
        lambda cfg: cfg.rollout.workers == 0,
        "in-process (rollout.workers 0)",
        f"acts only in-process (rollout.workers 0): {why}",
    )


WITH_DATA_PATH = ActsWhen(
    lambda cfg: cfg.data.path is not None,
    "with data.path",
    "needs data.path (the digits tasks are built in)",
)
TINY_BUILT_HERE = ActsWhen(
    lambda cfg: cfg.model.kind == "tiny" and cfg.model.path is None,
    "for the tiny model built from the config (model.kind tiny, model.path null)",
    "only the tiny model built here takes a tokenizer (a model.path checkpoint ships its "
    "own); leave it auto",
)
WITH_BPE = ActsWhen(
    lambda cfg: cfg.data.uses_bpe,
    "with the bpe tokenizer (data.tokenizer bpe, or auto with data.path)",
    "acts only with the bpe tokenizer",
)
ROWS_BOUNDED = on_rows(
    "{name} rows are bounded by the rollout (rollout.max_new_tokens and the model's context length)"
)
ROWS_SHUFFLED = on_rows(
    "{name} draws its prompts from a fresh permutation of each task's pool every epoch"
)
WITH_LIMIT = ActsWhen(
    lambda cfg: cfg.data.max_sequence_tokens is not None,
    "with data.max_sequence_tokens set",
    "acts only with data.max_sequence_tokens set (no limit)",
)


class DataConfig(StrictModel):
    """Training and evaluation data: the built-in digits tasks, or your own rows."""

    tasks: list[Task] | None = Field(
        None,
        min_length=1,
        description="Tasks to use (no repeats): digits tasks, or the `task` labels of "
        "data.path rows (rows of other tasks are left out, and counted). null: [t2i] for "
        "the digits; with data.path, the one task label of its train rows (read when a "
        "command starts and stated in its log; several labels are an error listing them).",
    )
    task_weights: dict[Task, float] | None = Field(
        None, description="Sampling weight per task (> 0); null = uniform."
    )
    path: str | None = Field(
        None,
        description="JSONL/parquet file or directory of shards (train rows: its `split: "
        "train` rows, or all rows without a split field); null = built-in digits tasks.",
    )
    val_path: Annotated[str | None, WITH_DATA_PATH] = Field(
        None, description="Validation rows (file/directory); null = data.path rows of split val."
    )
    test_path: Annotated[str | None, WITH_DATA_PATH] = Field(
        None, description="Test rows (file/directory); null = data.path rows of split test."
    )
    default_task: Annotated[Task | None, WITH_DATA_PATH] = Field(
        None, description="Task of rows without a `task` field; null = such a row is an error."
    )
    image_resize: Literal["resize", "error"] = Field(
        "error",
        description="A dataset image (data.path rows; also `uniweave generate --image`, "
        "with or without data.path) whose size differs from the model's: resize it "
        "(bicubic) or stop with its file:line.",
    )
    tokenizer: Annotated[Literal["auto", "word", "bpe"], TINY_BUILT_HERE] = Field(
        "auto",
        description="Tiny model tokenizer: word (digits vocabulary) | bpe (byte-level, "
        "trained on the training text); auto = word without data.path, bpe with it.",
    )
    bpe_vocab_size: Annotated[int, WITH_BPE] = Field(
        1024, ge=300, description="Vocabulary size of the byte-level BPE (data.tokenizer bpe)."
    )
    train_size: int = Field(
        0, ge=0, description="Training samples per task (0 = one per train-split image)."
    )
    val_size: int = Field(
        64,
        ge=0,
        description="Validation rows per task per evaluation (data.path: the first N val "
        "rows of each task; 0 = none).",
    )
    test_size: int = Field(
        64,
        ge=0,
        description="Test rows per task of the final evaluation (data.path: the first N "
        "test rows of each task; 0 = none).",
    )
    seed: int = Field(0, ge=0, description="Seed of data shuffling and task sampling.")
    shuffle: Annotated[bool, ROWS_SHUFFLED] = Field(
        True, description="Shuffle the training rows every epoch."
    )
    max_sequence_tokens: Annotated[int | None, ROWS_BOUNDED] = Field(
        None,
        gt=0,
        description="Hard context limit of a serialised SFT row (positions, prompt "
        "included); null = none.",
    )
    over_length: Annotated[Literal["refuse", "drop"], WITH_LIMIT] = Field(
        "refuse",
        description="An SFT row longer than data.max_sequence_tokens: stop naming it "
        "(refuse) or leave it out with a logged count (drop).",
    )

    @property
    def uses_bpe(self) -> bool:
        """Whether the tiny model's tokenizer is the byte-level BPE (see `tokenizer`)."""
        return self.tokenizer == "bpe" or (self.tokenizer == "auto" and self.path is not None)

    @model_validator(mode="before")
    @classmethod
    def _digits_default(cls, data: Any) -> Any:
        """No tasks and no data.path: the digits' t2i (the rows' label is read later)."""
        if isinstance(data, dict) and data.get("tasks") is None and data.get("path") is None:
            return {**data, "tasks": ["t2i"]}
        return data

    @model_validator(mode="after")
    def _tasks(self) -> DataConfig:
        if self.tasks is None:  # from data.path's rows (uniweave.data.rows.resolve_tasks)
            return self
        if len(set(self.tasks)) != len(self.tasks):
            raise incompatible("tasks", f"repeated task in {self.tasks}")
        for task, weight in (self.task_weights or {}).items():
            if task not in self.tasks:
                close = suggest(task, self.tasks)
                hint = f"; did you mean '{close}'?" if close else ""
                raise incompatible(
                    f"task_weights.{task}", f"task '{task}' is not in tasks {self.tasks}{hint}"
                )
            if weight <= 0:
                raise incompatible(f"task_weights.{task}", f"weight must be > 0 (got {weight})")
        if self.path is None:
            unknown = [t for t in self.tasks if t not in DIGITS_TASKS]
            if unknown:
                raise incompatible(
                    "tasks",
                    f"'{unknown[0]}' is not a built-in digits task ({', '.join(DIGITS_TASKS)}); "
                    "set data.path to a dataset whose rows carry it",
                )
        if self.default_task is not None and self.default_task not in self.tasks:
            raise incompatible("default_task", f"'{self.default_task}' is not in data.tasks")
        return self


GUIDED = ActsWhen(
    lambda cfg: cfg.rollout.guidance != 1.0,
    "with rollout.guidance != 1 (without guidance the guided and the conditional "
    "distributions are the same)",
)
BSQ_HEAD = ActsWhen(
    lambda cfg: cfg.model.visual_head == "bsq",
    "with model.visual_head bsq (VQ codes are sampled at rollout.temperature)",
)
FLOAT32_WEIGHTS = ActsWhen(
    lambda cfg: cfg.trainer.precision != "fp64",
    "with float32 weights (trainer.precision not fp64)",
    "acts only with float32 weights: autocast leaves trainer.precision fp64 tensors in float64",
)
CYCLE_STOP = ActsWhen(
    lambda cfg: cfg.rollout.cycle_max_period > 0,
    "with rollout.cycle_max_period > 0 (the cycle stop on)",
    "acts only with rollout.cycle_max_period > 0 (the cycle stop is off)",
)
SLOTS = (
    on_rollouts("; evaluation is static"),
    _in_process("Ray rollout workers are static"),
    ActsWhen(
        lambda cfg: cfg.rollout.batch_size >= 2,
        "with rollout.batch_size >= 2",
        "needs rollout.batch_size >= 2 slots (a guided pair takes two)",
    ),
    ActsWhen(
        lambda cfg: cfg.model.kind != "uniar",
        "for plain RoPE positions (not model.kind uniar)",
        "not built for model.kind uniar (M-RoPE decode positions per slot)",
    ),
    ActsWhen(
        lambda cfg: (
            not (
                cfg.model.kind == "tiny" and cfg.model.path is None and cfg.model.tiny.mixer_kernel
            )
        ),
        "for a plain KV cache (not the tiny model's conv prior, model.tiny.mixer_kernel > 0)",
        "not built for the tiny model's conv prior (its cache carries per-row mixer state): "
        "set model.tiny.mixer_kernel=0",
    ),
)
DYNAMIC = (
    on_rollouts(),
    ActsWhen(
        lambda cfg: cfg.rollout.workers == 0,
        "in-process (rollout.workers 0)",
        "dynamic assignment is built for in-process rollouts over torch.distributed ranks, "
        "not for Ray rollout workers (rollout.workers > 0): use static",
    ),
)


class RolloutConfig(StrictModel):
    """Sampling parameters of the rollout engine (also applied in replay).

    Each field maps 1:1 onto `uniweave.rollout.SamplingParams` (`uniweave.rollout.config`
    builds them); `batch_size` is how many rows the engine decodes together.
    """

    temperature: float = Field(1.0, gt=0.0, description="Text/VQ softmax temperature.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely ids (0 = off).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass (1.0 = off).")
    guidance: float = Field(
        1.0, ge=0.0, description="CFG weight w: z = u + w (c - u) on visual logits (1 = off)."
    )
    guidance_logprob: Annotated[Literal["guided", "conditional"], GUIDED] = Field(
        "guided", description="Score visual log-probs under the guided or the conditional logits."
    )
    bit_temperature: Annotated[float, BSQ_HEAD] = Field(
        1.0, gt=0.0, description="BSQ bit-logit temperature."
    )
    max_new_tokens: int | None = Field(
        64,
        gt=0,
        description="Sampled positions per row (exact: must equal the image's H*W); null: "
        "the model's context length bounds the row, with the cycle detector on.",
    )
    length_semantics: Literal["cap", "exact"] = Field(
        "cap", description="cap: hitting max_new_tokens truncates; exact: image-only, by design."
    )
    batch_size: int = Field(64, gt=0, description="Rows decoded together.")
    precision: Annotated[
        Literal["fp32", "bf16"],
        on_rollouts("; evaluation samples in fp32"),
        FLOAT32_WEIGHTS,
        _in_process("Ray rollout workers sample in fp32"),
    ] = Field(
        "fp32",
        description="Compute of the training rollouts: fp32, or bf16 autocast (weights "
        "stay fp32; replay keeps trainer.precision: a measured sampler/trainer mismatch).",
    )
    workers: Annotated[int, ROLLOUT_WORKERS] = Field(
        0, ge=0, description="Ray rollout actors, each given whole engine batches (0 = in-process)."
    )
    continuous_batching: Annotated[bool, SLOTS] = Field(
        False,
        description="Decode in rollout.batch_size slots; a finished row's slot takes the next "
        "waiting request (same tokens per seed in fp32). In-process grpo/opd rollouts; plain RoPE and "
        "KV cache only (not uniar, not tiny with mixer_kernel > 0).",
    )
    assignment: Annotated[Literal["static", "dynamic"], DYNAMIC] = Field(
        "static",
        description="Which rank samples which training row: static (round-robin) | dynamic "
        "(ranks claim engine batches of the longest remaining rows through the job's "
        "torch.distributed store); same trajectories either way (per-row seeds).",
    )
    cycle_max_period: int = Field(
        4, ge=0, description="Stop a row repeating a block of <= this many tokens (0 = off)."
    )
    cycle_repeats: Annotated[int, CYCLE_STOP] = Field(
        3, ge=2, description="Consecutive repeats that count as a cycle."
    )
    min_grid_side: int = Field(1, gt=0, description="Smallest H or W accepted in an image header.")
    max_grid_side: int = Field(
        32,
        gt=0,
        description="Largest H or W accepted in an image header (a model's own limit, "
        "UniAR's 30, bounds it too).",
    )
    on_invalid_header: Literal["invalid", "text"] = Field(
        "invalid",
        description="Bad 'generate image H W' header: end the row 'invalid', or keep "
        "<|vision_start|> as a text token (text).",
    )

    @model_validator(mode="after")
    def _grid(self) -> RolloutConfig:
        if self.max_new_tokens is None:
            if self.cycle_max_period == 0:
                raise incompatible(
                    "max_new_tokens",
                    "null (the context length as the horizon) needs the cycle detector on "
                    "(rollout.cycle_max_period > 0): a looping row would otherwise run to "
                    "the end of the context",
                )
            if self.length_semantics == "exact":
                raise incompatible(
                    "max_new_tokens",
                    "null cannot go with length_semantics 'exact' (an exact image needs "
                    "max_new_tokens = H*W)",
                )
        if self.min_grid_side > self.max_grid_side:
            raise incompatible(
                "min_grid_side", f"{self.min_grid_side} exceeds max_grid_side={self.max_grid_side}"
            )
        return self


class RewardPluginConfig(StrictModel):
    """One reward plugin; the total reward is the weighted sum of the plugins' scores."""

    name: str = Field(
        "mc_exact", pattern=r"^[a-z][a-z0-9_]*$", description="Registered reward plugin name."
    )
    weight: float = Field(1.0, description="Weight of this plugin's score in the total.")
    path: str | None = Field(
        None, description="Model directory (or hub id org/name) for learned scorers."
    )
    tasks: list[Task] | None = Field(
        None, description="Score only rows of these tasks (any data.tasks labels); null = all."
    )
    kwargs: dict[str, bool | int | float | str] = Field(
        default_factory=dict, description="Plugin-specific scalar options."
    )


class RewardConfig(StrictModel):
    """The reward service (GRPO)."""

    plugins: list[RewardPluginConfig] = Field(
        default_factory=list, description="Reward plugins (GRPO requires at least one)."
    )
    truncated_reward: Literal["zero", "keep"] = Field(
        "zero", description="Reward of rows truncated by a cap/context/cycle."
    )
    on_error: Literal["raise", "zero"] = Field(
        "raise", description="A plugin exception or non-finite score: fail, or score 0 and count."
    )
    workers: Annotated[int, REWARD_WORKERS] = Field(
        0, ge=0, description="Ray reward actors, each scoring a round-robin share (0 = in-process)."
    )

    @model_validator(mode="after")
    def _some_weight(self) -> RewardConfig:
        if self.plugins and all(p.weight == 0 for p in self.plugins):
            raise incompatible(
                "plugins", "every plugin has weight 0: the total reward would always be 0"
            )
        return self


EPOCHS = on_rows(
    "{name} draws each task's prompts from its own pool, so the run has no single epoch boundary"
)
SAVES_ROLLOUTS = ActsWhen(
    lambda cfg: method_of(cfg).rollouts,
    lambda: f"with {' or '.join(registry.names(rollouts=True))}",
    lambda cfg: (
        f"acts only with {' or '.join(registry.names(rollouts=True))} "
        f"({cfg.algorithm.name} samples no rollouts)"
    ),
)
KEEPS_BEST = ActsWhen(lambda cfg: cfg.checkpoint.keep_best is not None, "with checkpoint.keep_best")


class CheckpointConfig(StrictModel):
    """Atomic checkpoints in <output_dir>/checkpoints."""

    every_updates: int = Field(50, ge=0, description="Checkpoint every N updates (0 = off).")
    every_minutes: float = Field(0.0, ge=0.0, description="Also every N minutes (0 = off).")
    every_epochs: Annotated[int, EPOCHS] = Field(
        0,
        ge=0,
        description="SFT: also at every N-th exact epoch boundary, the update ceil(e*R/B) "
        "whose batch holds the last row of epoch e (R rows, B = global_batch_size; 0 = off).",
    )
    keep_best: str | None = Field(
        None,
        pattern=r"^val/.+",
        description="A validation metric (val/loss, val/<task>/accuracy, ...): an evaluated "
        "update that improves it is checkpointed and kept (checkpoints/best.json) beside "
        "the keep_last newest; null = off.",
    )
    keep_best_mode: Annotated[Literal["min", "max"], KEEPS_BEST] = Field(
        "min", description="Whether keep_best keeps the lowest (min) or highest (max) value."
    )
    save_rollouts: Annotated[bool, SAVES_ROLLOUTS] = Field(
        False,
        description="GRPO/OPD: save each update's trajectories, rewards, advantages, routing "
        "and replay selection to rollouts/update-N.pt + .json, linked from checkpoints.",
    )
    keep_last: int = Field(2, ge=0, description="Complete checkpoints kept (0 = all).")
    resume_mode: Literal[
        "strict",
        "allow_schedule_changes",
        "epoch_extension",
        "rollout_limit_change",
        "execution_change",
    ] = Field(
        "strict",
        description="What may change when resuming (in place or from run.parent; "
        "uniweave.config.hashing.RESUME_MODES): strict: nothing but cadence/logging/execution-"
        "only keys; allow_schedule_changes: total_updates, scheduler, eval_every; "
        "epoch_extension: a longer constant-LR run (total_updates, run.name); "
        "rollout_limit_change: rollout caps; execution_change: micro-batching, gradient "
        "checkpointing, DDP/FSDP2 execution flags.",
    )


A_SINK = ActsWhen(
    lambda cfg: cfg.logging.jsonl or cfg.logging.tensorboard or cfg.logging.wandb,
    "with a metrics sink (logging.jsonl, tensorboard or wandb)",
)
SPLIT_GRADIENT = ActsWhen(
    lambda cfg: method_of(cfg).gradient_diagnostics is not None,
    lambda: f"with {_split_methods()} (distillation vs GT-replay gradients)",
    lambda cfg: (
        f"acts only with {_split_methods()} (distillation vs GT-replay gradients), "
        f"not {cfg.algorithm.name}"
    ),
)
SAMPLE_SINK = ActsWhen(
    lambda cfg: cfg.logging.tensorboard or cfg.logging.wandb,
    "with logging.tensorboard or logging.wandb (samples go to no other sink)",
)


class LoggingConfig(StrictModel):
    """Metric sinks (`uniweave.train.engine.metrics.MetricsLogger`)."""

    jsonl: bool = Field(True, description="Write <output_dir>/metrics.jsonl.")
    tensorboard: bool = Field(True, description="Write TensorBoard event files.")
    wandb: bool = Field(
        False,
        description="Also log to Weights & Biases (pip install 'uniweave[wandb]'; project from "
        "WANDB_PROJECT, default uniweave; WANDB_MODE=offline works without an account).",
    )
    progress_bar: bool = Field(True, description="Show a rich progress bar on a TTY.")
    every: Annotated[int, A_SINK] = Field(
        1,
        gt=0,
        description="Log metrics every N updates (the last update and updates that ran an "
        "evaluation are always logged).",
    )
    samples_every: Annotated[
        int, SAMPLE_SINK, on_rollouts(lambda cfg: f"; {cfg.algorithm.name} logs no samples")
    ] = Field(
        50,
        ge=0,
        description="Log a few rollout samples (prompt, response, reward, image) to "
        "TensorBoard / W&B every N updates (0 = off).",
    )
    gradient_diagnostics_every_updates: Annotated[int, SPLIT_GRADIENT] = Field(
        0,
        ge=0,
        description="OPD with GT replay: every N updates log the pre-clip norms of the "
        "distillation and GT-replay gradients, their ratio and cosine, from the update's one "
        "backward per micro-batch (the two row kinds are micro-batched apart; 0 = off).",
    )

    @model_validator(mode="after")
    def _wandb_installed(self) -> LoggingConfig:
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise incompatible(
                "wandb", "the wandb package is not installed (pip install 'uniweave[wandb]')"
            )
        return self


class EvaluationConfig(StrictModel):
    """`uniweave eval`, in-training validation and the final test evaluation (one evaluator,
    `uniweave.eval.runner`): the model on one data split, scored by the reward plugins (or
    each task's default verifier, `uniweave.rewards.defaults`)."""

    split: Literal["train", "val", "test"] = Field(
        "test", description="Rows to evaluate: data.<split>_path, or data.path rows of it."
    )
    max_samples: int = Field(
        0,
        ge=0,
        description="Evaluate at most N rows (0 = all), stratified by task: the N are dealt "
        "round-robin over the tasks, each task's rows drawn with a seed from data.seed and "
        "the task's name.",
    )
    rollouts_per_sample: int = Field(
        1, ge=1, description="Rollouts n per row: mean@n and pass@n are reported."
    )
    greedy: bool = Field(True, description="Greedy decoding (n must be 1) or sampled.")
    sample_images: bool = Field(
        True,
        description="Rows whose answer is an image (t2i) are sampled with the rollout: "
        "parameters even when evaluation.greedy is true (greedy decoding would draw one "
        "image per prompt text, e.g. one per digit); false: evaluation.greedy decides "
        "for them too.",
    )
    pass_threshold: float = Field(
        0.5,
        description="A row passes when its total reward is >= this: pass@n, the records' "
        "`passed`, GRPO/OPD task/<task>/accuracy and OPD's verified routing "
        "(uniweave.rewards.passes). 0.5 passes a verifier's 1 and a classifier's 0.9999.",
    )
    output_dir: str | None = Field(
        None, description="Results directory; null = <run.output_dir>/eval-<split>."
    )
    workers_per_gpu: int = Field(
        1,
        ge=1,
        description="Evaluation workers per process (per device): N threads, each with its "
        "own copy of the model (N - 1 extra copies in memory) and, on CUDA, its own stream, "
        "claiming engine batches from the evaluation's queue; the records do not depend on N.",
    )

    @model_validator(mode="after")
    def _greedy_once(self) -> EvaluationConfig:
        if self.greedy and self.rollouts_per_sample > 1:
            raise incompatible(
                "rollouts_per_sample",
                f"{self.rollouts_per_sample} greedy rollouts are identical; set "
                "evaluation.greedy=false to sample them",
            )
        return self


VISUAL_LOSS: dict[str, str] = {"vq": "vq", "bsq": "bits"}
"""The suffix of SFT's validation visual loss per visual head (`val/loss_image_<suffix>`)."""


class HealthConfig(StrictModel):
    """Health alarms and the run report's before/after test (`uniweave.eval.health`,
    docs/reports.md). An alarm is logged as one plain line when it fires and listed at the
    top of the run's report.md / report.html; null turns a threshold's alarm off."""

    baseline_eval: bool = Field(
        True,
        description="Evaluate the starting model (update 0) on the val and test splits the "
        "run evaluates, so every later evaluation has a paired before/after comparison "
        "(false: no baseline, no verdicts, no held-out alarm).",
    )
    heldout_se: float = Field(
        2.0,
        gt=0.0,
        description="A held-out change counts when the paired per-prompt mean difference "
        "exceeds this many standard errors: the report's improved / got worse verdicts and "
        "the held-out alarm.",
    )
    heldout_drop: bool = Field(
        True,
        description="Alarm when a held-out mean@n / pass@n got worse than at the start "
        "(the heldout_se test; needs baseline_eval).",
    )
    zero_variance_share: float | None = Field(
        0.75,
        gt=0.0,
        le=1.0,
        description="Alarm when the share of GRPO groups whose rewards are all equal "
        "(adv/frac_zero_std_groups) is >= this.",
    )
    zero_signal_updates: int = Field(
        3,
        ge=0,
        description="Alarm when all advantages (adv/advantage_std = 0) or all gradients "
        "(grad_norm = 0) were zero for this many logged updates in a row (0 = off).",
    )
    truncation_overwrite_share: float | None = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Alarm when truncation shaping overwrote >= this share of an update's "
        "rewards (reward/overwritten_frac).",
    )
    reward_saturation: float | None = Field(
        0.98,
        description="Alarm when the mean training reward (reward/total_mean) is >= this "
        "(nothing left to learn: groups go zero-variance).",
    )
    entropy_collapse_ratio: float | None = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Alarm when a policy entropy (policy/entropy_text, policy/entropy_visual) "
        "falls below this fraction of its value at the first logged update.",
    )
    kl_max: float | None = Field(
        1.0,
        ge=0.0,
        description="Alarm when the KL to the reference (policy/kl_ref_mean) exceeds this.",
    )
    invalid_rise: float | None = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Alarm when an invalid-output share rises more than this above its "
        "start: training reward/<plugin>/invalid_frac vs its first logged update, held-out "
        "invalid_frac vs the baseline evaluation.",
    )
    off_target_drift: float | None = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description="Alarm (off_target) when an off-target image statistic (images/brightness, "
        "edge_density, colour_entropy, blank_frac, grey_frac, noise_frac, source_copy_frac; "
        "all in [0, 1], docs/reports.md) drifted by more than this over the logged updates "
        "(the least-squares change from the first to the latest, as in the report's curves; "
        "the means either way, the *_frac shares upwards) while the training reward rises "
        "(off_target_reward_ratio): a hacked image reward.",
    )
    off_target_reward_ratio: float = Field(
        3.0,
        gt=0.0,
        description="The off_target alarm needs the training reward (reward/total_mean) to "
        "rise: its least-squares drift over the logged updates at least this many times "
        "its residual noise (3: the report's learning-claim bar).",
    )


class UniweaveConfig(StrictModel):
    """A complete run: what `uniweave inspect` prints and the config hash covers."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Data.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Rewards.")
    algorithm: AlgorithmConfig = Field(
        default_factory=SFTConfig, description="sft | grpo | opd, chosen by algorithm.name."
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Optimisation.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig, description="`uniweave eval`."
    )
    ray: Annotated[RayConfig, SOME_WORKERS] = Field(
        default_factory=RayConfig, description="Ray workers (rollout.workers, reward.workers)."
    )
    health: HealthConfig = Field(
        default_factory=HealthConfig, description="Health alarms and the run report's test."
    )

    @model_validator(mode="after")
    def _cross_section(self) -> UniweaveConfig:
        algo = self.algorithm
        if self.data.tasks is None:
            # data.path rows name the tasks: the checks that need them run when
            # uniweave.data.rows.resolve_tasks validates the config with the rows' label
            tasks: set[str] | None = None
        else:
            tasks = set(self.data.tasks)
        spec = registry.method(algo.name)
        refuse_inactive(self)
        if spec.check is not None:
            spec.check(self, tasks)
        if self.trainer.packing and spec.packing is not None:  # declared: trainer.packing
            spec.packing(self)
        if spec.check_late is not None:
            spec.check_late(self, tasks)
        if tasks is not None:
            if self.data.path is None:
                self._digits_rollout(tasks)
            self._reward_routes(tasks)
        self._inert(spec)
        self._cadence(spec)
        self._gradient_diagnostics(spec)
        return self

    def _inert(self, spec: registry.MethodSpec) -> None:
        """Settings whose value another section makes pointless (a conflict rather than
        a setting that does not act: the value given or not, the run could not honour
        it)."""
        if self.trainer.eval_every > 0 and self.data.val_size == 0:
            raise incompatible(
                "trainer.eval_every",
                f"{self.trainer.eval_every} evaluates nothing: data.val_size is 0 (set it > 0, "
                "or eval_every 0)",
            )

    def _cadence(self, spec: registry.MethodSpec) -> None:
        """An epoch cadence and a best checkpoint that could measure nothing, and a
        best-checkpoint metric the run does not have (`uniweave.train.engine.trainer`,
        `uniweave.train.engine.retention`; docs/campaigns-validation.md). A method's own
        validation metrics are its spec's `val_metrics`."""
        if self.trainer.eval_every_epochs > 0 and self.data.val_size == 0:
            raise incompatible(
                "trainer.eval_every_epochs",
                f"{self.trainer.eval_every_epochs} evaluates nothing: data.val_size is 0",
            )
        c = self.checkpoint
        if c.keep_best is None:
            return
        if self.trainer.eval_every == 0 and self.trainer.eval_every_epochs == 0:
            raise incompatible(
                "checkpoint.keep_best",
                f"{c.keep_best} is never measured: set trainer.eval_every or "
                "trainer.eval_every_epochs",
            )
        own: set[str] = set()
        prefix, hint = None, ""
        if spec.val_metrics is not None:
            own, prefix, hint = spec.val_metrics(self)
        task = c.keep_best.split("/")[1]
        if c.keep_best in own:
            return
        if prefix is not None and c.keep_best.startswith(prefix):
            return
        if task in (self.data.tasks or [task]) and c.keep_best.count("/") >= 2:
            return
        raise incompatible(
            "checkpoint.keep_best",
            f"'{c.keep_best}' is not a validation metric of this run (expected "
            f"{', '.join(sorted(own) + ['val/<task>/<statistic>'])} with <task> in data.tasks"
            f"{hint})",
        )

    def _gradient_diagnostics(self, spec: registry.MethodSpec) -> None:
        """The gradient diagnostics split the gradient into a method's parts
        (`uniweave.train.engine.diagnostics`; OPD: the distillation and the GT-replay
        part): they act only for a method whose spec has `gradient_diagnostics` (declared
        on the field), which adds its own checks here."""
        if self.logging.gradient_diagnostics_every_updates and spec.gradient_diagnostics:
            spec.gradient_diagnostics(self)

    def _digits_rollout(self, tasks: set[str]) -> None:
        """Rollout checks that the digits tasks' names decide (dataset rows decide it
        for data.path: the engine refuses an exact-count row that generates no image)."""
        if self.rollout.length_semantics == "exact" and tasks != {"t2i"}:
            raise incompatible(
                "rollout.length_semantics",
                f"'exact' is for image-only generation (tasks [t2i]); got {sorted(tasks)}",
            )
        if self.rollout.guidance != 1.0 and not tasks & IMAGE_GENERATION_TASKS:
            raise incompatible(
                "rollout.guidance",
                f"guidance {self.rollout.guidance} needs an image-generation task "
                f"({', '.join(sorted(IMAGE_GENERATION_TASKS))}); got {sorted(tasks)}",
            )

    def _reward_routes(self, tasks: set[str]) -> None:
        """Every plugin's `tasks` are data.tasks; with plugins (GRPO always has some),
        every data task is scored by at least one of them."""
        plugins = self.reward.plugins
        for k, plugin in enumerate(plugins):
            for task in plugin.tasks or []:
                if task not in tasks:
                    raise incompatible(
                        f"reward.plugins.{k}.tasks",
                        f"task '{task}' is not in data.tasks {sorted(tasks)}",
                    )
        if not plugins:
            return
        routed = set().union(*(set(p.tasks) if p.tasks is not None else tasks for p in plugins))
        for task in sorted(tasks - routed):
            raise incompatible(
                "reward.plugins",
                f"task '{task}' has no reward route: add it to a plugin's tasks (or leave "
                "that plugin's tasks null)",
            )


def _split_methods() -> str:
    """'opd': the registered methods whose gradient the diagnostics split (messages)."""
    return " or ".join(m.name for m in registry.methods() if m.gradient_diagnostics)


def _rebuild_algorithm_field() -> None:
    """`UniweaveConfig.algorithm`: the discriminated union of the registered methods'
    config classes (`uniweave.config.methods`), rebuilt when a method is registered or
    removed (the built-in ones are the union it is declared with)."""
    specs = registry.methods()
    members = tuple(spec.config for spec in specs)
    field = UniweaveConfig.model_fields["algorithm"]
    if members == get_args(field.annotation):
        return
    info = FieldInfo.merge_field_infos(
        FieldInfo.from_annotation(Annotated[Union[members], Field(discriminator="name")]),  # type: ignore[arg-type]  # a union built at run time
        default_factory=field.default_factory,
        description=algorithm_description(),
    )
    UniweaveConfig.__pydantic_fields__["algorithm"] = info
    UniweaveConfig.model_rebuild(force=True)


def algorithm_description() -> str:
    """The description of the `algorithm` field: the registered method names."""
    return " | ".join(registry.names()) + ", chosen by algorithm.name."


registry.on_change(_rebuild_algorithm_field)
