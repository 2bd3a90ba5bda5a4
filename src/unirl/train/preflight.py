"""Validate everything a run reads before anything is written (`unirl train`).

`preflight(cfg, algorithms)` runs after the config is validated and before the run
directory is created or opened. It checks, and raises a `ConfigError` (a usage error,
exit 2, one line naming the culprit) on the first problem:

- the algorithm can be trained (`algorithm.name`), the model section fits its kind
  (`check_model_config`, with the kind's own config checks: e.g. UniAR's sizes);
- `run.output_dir` is a directory or does not exist yet;
- `model.path`, `model.codec.path` and OPD's `algorithm.teacher.path`: they exist, and the header of every safetensors
  file under them is read and its size checked against the file (a truncated file names
  its path); no weights are loaded;
- `model.initial_adapter`: a LoRA run's adapter/ trained on the files now at
  `model.path` with the run's rank, alpha, rslora and target modules
  (`unirl.train.engine.adapters.check_initial_adapter`);
- the model as its small files say (`check_model`, `inspect_model`: no weights): a
  `model.path` directory holds the kind's files and `model.visual_head`; a
  `model.codec.path` codec is of `model.visual_head`'s kind; `algorithm.share_prompt_prefix`
  only for a model that supports it; for GRPO and OPD, `rollout.length_semantics: exact`
  with `rollout.max_new_tokens` the codec grid's H*W; Ray workers fit `ray.num_cpus`;
- dataset rows (`data.path`, every file and shard, every split; `data.val_path`,
  `data.test_path`) through the same loaders training uses (`unirl.data.rows`), images
  included, at the model's image size (from its codec or checkpoint files, any kind):
  the first bad row names its `file:line`; for SFT every training row has an
  assistant turn to learn; with the digits word tokenizer, every target maps to known ids;
  every row a reward plugin verifies (GRPO, OPD; evaluated splits) has its answer; for
  GRPO and OPD every training row is one the rollout engine takes (an image answer under
  `exact`, forced grids within `rollout.min_grid_side`..`max_grid_side`) and, for a
  privileged OPD teacher, has an answer;
- the reward plugins: the reward service is built once from the `reward` section (an
  unknown plugin, option or path names its `reward.plugins.N` key);
- OPD: the teacher shares the student's action spaces (`compare_action_spaces`: visual
  head, visual outputs, codec grid, vocabulary, codec tensors), read from the teacher's
  record, tokenizer and codec files (no weights). A student at `model.path` is read the
  same way; a student built from the config is built here as the run will build it,
  writing nothing (a codec or tokenizer the run directory already holds is reused; else
  the codec is fitted and a BPE tokenizer trained in memory: seconds for a VQ codec,
  most of a minute for a BSQ one on the digits — only then).

Numbers that cannot reach the tensors (`trainer.optimizer.lr=1e39`) and reward mixes
whose weights are all zero are refused earlier, by the config schema.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

from unirl.codecs import codec_geometry
from unirl.codecs.base import CONFIG_NAME as CODEC_CONFIG
from unirl.config import ConfigError, UnirlConfig
from unirl.config.schema import DIGITS_IMAGE_SIZE, ModelConfig
from unirl.core.sample import GenerationRequest, Sample
from unirl.data.images import processor_for
from unirl.data.loader import DatasetError, Rows, load_rows
from unirl.data.rows import answer_image_grid, check_targets, split_rows
from unirl.data.tokenizer import build_tokenizer
from unirl.models import check_model_config
from unirl.models.build import build_model
from unirl.models.registry import ModelFacts, inspect_model
from unirl.models.tiny.build import new_codec
from unirl.rewards.answers import check_dataset_answers
from unirl.rewards.digit_classifier import DigitClassifier
from unirl.rewards.service import build_reward_service
from unirl.rollout.config import sampling_params
from unirl.train.dist.parallel import check_fsdp2_support
from unirl.train.engine.adapters import check_initial_adapter
from unirl.train.methods.grpo.job import check_prefix_sharing
from unirl.train.methods.opd.objective import KEY as TEACHER_KEY
from unirl.train.methods.opd.objective import compare_action_spaces
from unirl.train.rollouts.prompts import check_exact_length
from unirl.train.rollouts.workers import RayPlan, check_capacity

HEADER_BYTES = 8
SHARD_INDEX = ".safetensors.index.json"
ROLLOUT_METHODS = ("grpo", "opd")
"""Methods whose training rolls the policy out under the `rollout` section."""
RUN_CODEC, RUN_TOKENIZER = "codec", "tokenizer"
"""Where a run directory keeps the codec and tokenizer of a model built from the config
(`unirl.train.run`)."""


class InputError(ConfigError):
    """A file the config names cannot be used, on one line: "FILE[:LINE]: what (KEY in
    SOURCE)", KEY the config key that named the file, SOURCE the config file that set it
    (filled in by the CLI)."""

    def __init__(self, text: str, key: str | None = None) -> None:
        self.text = " ".join(str(text).split())
        super().__init__(self.text, key=key)

    @property
    def message(self) -> str:
        if not self.key:
            return self.text
        return f"{self.text} ({self.key}{f' in {self.source}' if self.source else ''})"


def preflight(cfg: UnirlConfig, algorithms: Collection[str]) -> None:
    """Check everything `cfg` makes a run read (module docstring); writes nothing."""
    if cfg.algorithm.name not in algorithms:
        raise ConfigError(
            f"'{cfg.algorithm.name}' cannot be trained yet",
            key="algorithm.name",
            expected=" | ".join(sorted(algorithms)),
        )
    check_model_config(cfg.model)
    if cfg.trainer.parallel == "fsdp2":
        check_fsdp2_support()
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory", key="run.output_dir")
    check_weights(cfg.model.path, "model.path")
    check_weights(cfg.model.initial_adapter, "model.initial_adapter")
    check_initial_adapter(cfg)
    teacher = getattr(cfg.algorithm, "teacher", None)  # OPD
    if teacher is not None:
        check_weights(teacher.path, "algorithm.teacher.path")
    if cfg.model.path is None:  # a model built from the config (tiny, uniar) reads its codec
        check_weights(cfg.model.codec.path, "model.codec.path")
    for k, plugin in enumerate(cfg.reward.plugins):
        check_weights(plugin.path, f"reward.plugins.{k}.path")
    geometry = check_model(cfg)
    check_ray(cfg)
    if cfg.data.path is not None:
        check_rows(cfg, geometry)
    if cfg.reward.plugins:
        check_rewards(cfg)
    if teacher is not None:
        check_teacher(cfg)


def check_safetensors(path: Path, key: str) -> None:
    """Read the header of safetensors file `path` and check the file holds exactly the
    bytes it declares (8-byte header length, JSON header, tensor data)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        n = int.from_bytes(head, "little") if len(head) == HEADER_BYTES else -1
        if n < 0 or HEADER_BYTES + n > size:
            raise InputError(f"{path}: truncated safetensors file ({size} bytes)", key)
        try:
            header = json.loads(f.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise InputError(f"{path}: unreadable safetensors header ({err})", key) from None
    if HEADER_BYTES + n + end != size:
        problem = "truncated" if HEADER_BYTES + n + end > size else "oversized"
        raise InputError(
            f"{path}: {problem} safetensors file ({size} bytes; its header says "
            f"{HEADER_BYTES + n + end})",
            key,
        )


def check_weights(path: str | None, key: str) -> None:
    """`path` (a model directory or file named by config key `key`) exists; every
    safetensors file in it has an intact header and size; shard indexes name files that
    exist."""
    if path is None:
        return
    root = Path(path)
    if not root.exists():
        raise InputError(f"{root}: not found", key)
    files = sorted(root.rglob("*.safetensors")) if root.is_dir() else [root]
    for file in files:
        if file.suffix == ".safetensors":
            check_safetensors(file, key)
    for index in sorted(root.rglob(f"*{SHARD_INDEX}")) if root.is_dir() else []:
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise InputError(f"{index}: unreadable shard index ({err})", key) from None
        for shard in sorted(shards):
            if not (index.parent / shard).is_file():
                raise InputError(f"{index}: names shard {shard}, which is missing", key)


def _inspect(path: str, key: str, full: bool = False) -> ModelFacts | None:
    """`inspect_model`, its refusals as InputErrors naming `key`."""
    try:
        return inspect_model(path, full)
    except (OSError, ValueError) as err:
        raise InputError(str(err), key) from None


def _config_grid(model: ModelConfig) -> tuple[int, int]:
    """The codec grid of a model built from the config: its `model.codec.path` codec
    (which must be of `model.visual_head`'s kind), else the one `model.codec` describes
    (a run's fitted codec, saved in its run directory, is of that geometry too)."""
    if model.codec.path is None:
        return tuple(new_codec(model).grid)
    try:
        kind, grid, _ = codec_geometry(model.codec.path)
    except (OSError, ValueError) as err:
        raise InputError(str(err), "model.codec.path") from None
    if kind != model.visual_head:
        raise ConfigError(
            f"{model.codec.path} holds a {kind} codec but model.visual_head is {model.visual_head}",
            key="model.codec.path",
        )
    return (int(grid[0]), int(grid[1]))


Geometry = tuple[tuple[int, int], tuple[int, int] | None]
"""(codec grid, image size) of the model: what dataset rows are read with."""


def check_model(cfg: UnirlConfig) -> Geometry | None:
    """The model as its files and config say, no weights read (module docstring); returns
    its codec grid and image size (None for a kind that cannot tell them up front)."""
    m, algo = cfg.model, cfg.algorithm
    if m.path is None:
        grid = _config_grid(m)  # prefix sharing: the schema decides from model.tiny
        size: tuple[int, int] | None = (DIGITS_IMAGE_SIZE, DIGITS_IMAGE_SIZE)  # its codec's
    else:
        facts = _inspect(m.path, "model.path")
        if facts is None:
            return None
        if facts.visual_head != m.visual_head:
            raise ConfigError(
                f"{m.path} holds a model with a {facts.visual_head} head but "
                f"model.visual_head is {m.visual_head}",
                key="model.visual_head",
            )
        if algo.name == "grpo":
            where = f"the {m.kind} model at {m.path}"
            check_prefix_sharing(algo, facts.supports_prefix_sharing, where)
        grid, size = facts.grid, facts.image_size
    if algo.name in ROLLOUT_METHODS:
        check_exact_length(cfg.rollout, grid)
    return grid, size


def check_ray(cfg: UnirlConfig) -> None:
    """Ray workers on a new local instance of `ray.num_cpus` CPUs fit in it (the GPUs
    and the CPUs of an instance sized by Ray are checked when it has started)."""
    if not (cfg.rollout.workers or cfg.reward.workers):
        return
    plan = RayPlan.from_config(cfg)
    if plan.init.get("address") == "local" and "num_cpus" in plan.init:
        check_capacity(plan, {"CPU": float(plan.init["num_cpus"])})


def _student_facts(cfg: UnirlConfig) -> ModelFacts | None:
    """The student's full `ModelFacts`: read from `model.path`, or of the model built
    from the config as the run builds it, writing nothing (module docstring)."""
    if cfg.model.path is not None:
        return _inspect(cfg.model.path, "model.path", full=True)
    run_dir = Path(cfg.run.output_dir)
    codec_dir, tokenizer_dir = run_dir / RUN_CODEC, run_dir / RUN_TOKENIZER
    model = build_model(
        cfg,
        codec_dir=codec_dir if (codec_dir / CODEC_CONFIG).is_file() else None,
        tokenizer_dir=tokenizer_dir if (tokenizer_dir / "tokenizer.json").is_file() else None,
    )
    return ModelFacts.of(model)


def check_teacher(cfg: UnirlConfig) -> None:
    """OPD: the teacher directory holds a model of the student's action spaces
    (`compare_action_spaces`), from its files (module docstring)."""
    path = cfg.algorithm.teacher.path
    if not Path(path).is_dir():
        raise ConfigError(f"{path} is not a directory", key=TEACHER_KEY)
    teacher = _inspect(path, TEACHER_KEY, full=True)
    if teacher is None:
        return  # a kind without `inspect`: checked when the teacher is loaded
    student = _student_facts(cfg)
    if student is not None:
        compare_action_spaces(student, teacher)


def _processor(cfg: UnirlConfig, geometry: Geometry | None):
    """The image processor and grid the run reads dataset rows with (`dataset_rows`:
    `processor_for` the model's kind at its codec's image size); for a kind that cannot
    tell its geometry up front, no processor (images are only read here) and a
    placeholder grid."""
    if geometry is None or geometry[1] is None:
        return None, geometry[0] if geometry else (1, 1)
    grid, size = geometry
    return processor_for(cfg.model.kind, size, cfg.data.image_resize), grid


def _as_input_error(err: DatasetError, key: str) -> InputError:
    return InputError(str(err), key)


def _has_target(sample: Sample) -> bool:
    return any(p.role == "assistant" and not isinstance(p, GenerationRequest) for p in sample.parts)


def _answered_splits(cfg: UnirlConfig) -> tuple[str, ...]:
    """The splits whose rows the reward plugins verify: the training prompts of a rollout
    method, the val rows of in-training evaluation, the test rows of the final one."""
    splits = ["train"] if cfg.algorithm.name in ROLLOUT_METHODS else []
    if cfg.data.val_size > 0 and cfg.trainer.eval_every > 0:
        splits.append("val")
    if cfg.data.test_size > 0:
        splits.append("test")
    return tuple(splits)


def check_rows(cfg: UnirlConfig, geometry: Geometry | None = None) -> Rows:
    """Every row of every dataset file the config names, read as the run reads them
    (`geometry`: the model's codec grid and image size, `check_model`); the training rows
    returned."""
    processor, grid = _processor(cfg, geometry)
    codec_grid = geometry[0] if geometry else None
    data = cfg.data
    try:
        load_rows(data.path, processor, grid, data.default_task)
        train = split_rows(data, "train", processor, grid)
        for split, path in (("val", data.val_path), ("test", data.test_path)):
            if path is not None:
                split_rows(data, split, processor, grid)
        # rows a verifier scores need their answers (prompt pools, evaluation)
        check_dataset_answers(cfg, _answered_splits(cfg))
    except DatasetError as err:
        raise _as_input_error(err, "data.path") from None
    if cfg.algorithm.name in ROLLOUT_METHODS:
        check_prompts(cfg, train, codec_grid)
    if cfg.algorithm.name == "sft":
        for sample in train.samples:
            if not _has_target(sample):
                raise InputError(
                    f"{train.where.get(sample.id, sample.id)}: messages: no assistant turn "
                    "to learn (SFT trains on the assistant's answer)",
                    "data.path",
                )
    if cfg.model.path is None and cfg.model.kind == "tiny" and not data.uses_bpe:
        try:
            check_targets(train, build_tokenizer())
        except DatasetError as err:
            raise _as_input_error(err, "data.path") from None
    return train


def check_prompts(cfg: UnirlConfig, rows: Rows, codec_grid: tuple[int, int] | None) -> None:
    """GRPO / OPD: every training row of `data.tasks` is a request the rollout engine
    takes (`unirl.train.rollouts.prompts.rollout_request`): under `length_semantics:
    exact` its answer is one image; an image answer's grid lies within
    `rollout.min_grid_side`..`max_grid_side`; for OPD's privileged teacher
    (`algorithm.teacher.privilege: answer`) it has an answer."""
    params = sampling_params(cfg.rollout)
    teacher = getattr(cfg.algorithm, "teacher", None)
    privileged = teacher is not None and teacher.privilege == "answer"
    tasks = set(cfg.data.tasks)
    for sample in rows.samples:
        if sample.task not in tasks:
            continue
        where = rows.where.get(sample.id, sample.id)
        grid = answer_image_grid(sample, codec_grid or (1, 1))
        if grid is None and params.length_semantics == "exact":
            raise InputError(
                f"{where}: messages: the answer is not one image, and length_semantics "
                "'exact' rolls out image-only rows (use 'cap', or leave the row out)",
                "rollout.length_semantics",
            )
        if grid is not None and codec_grid is not None and not params.grid_allowed(*grid):
            low = min(grid) < params.min_grid_side
            raise InputError(
                f"{where}: its answer image of {grid[0]}x{grid[1]} positions is outside "
                f"[{params.min_grid_side}, {params.max_grid_side}] per side",
                "rollout.min_grid_side" if low else "rollout.max_grid_side",
            )
        if privileged and sample.answer is None:
            raise InputError(
                f"{where}: answer: missing; the privileged teacher reads the row's answer",
                "algorithm.teacher.privilege",
            )


def _never_decode(codes):
    raise RuntimeError("the preflight reward service decodes no images")


def check_rewards(cfg: UnirlConfig) -> None:
    """Build the reward service of the `reward` section once (plugins loading their own
    models from `path` load them; the run's digits classifier, fitted later in the run
    directory, stands in as an unfitted one)."""
    resources = {"digit_classifier": DigitClassifier()}
    build_reward_service(cfg.reward, decode_images=_never_decode, resources=resources)
