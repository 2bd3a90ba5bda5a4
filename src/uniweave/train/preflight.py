"""Validate everything a run reads before anything is written (`uniweave train`).

`preflight(cfg, algorithms)` runs after the config is validated and before the run
directory is created or opened. It checks, and raises a `ConfigError` (a usage error,
exit 2, one line naming the culprit) on the first problem:

- the algorithm can be trained (`algorithm.name`), the model section fits its kind
  (`check_model_config`, with the kind's own config checks: e.g. UniAR's sizes);
- `run.output_dir` does not exist yet, is empty, is a uniweave run, or holds only what uniweave
  writes there before a run (`check_run_dir`);
- `model.path`, `model.codec.path` and OPD's `algorithm.teacher.path`: they exist, and the header of every safetensors
  file under them is read and its size checked against the file (a truncated file names
  its path); no weights are loaded;
- `model.initial_adapter`: a LoRA run's adapter/ trained on the files now at
  `model.path` with the run's rank, alpha, rslora and target modules
  (`uniweave.train.engine.adapters.check_initial_adapter`);
- the model as its small files say (`check_model`, `inspect_model`: no weights): a
  `model.path` directory holds the kind's files and `model.visual_head`; a
  `model.codec.path` codec is of `model.visual_head`'s kind; `algorithm.share_prompt_prefix`
  only for a model that supports it; for GRPO and OPD, `rollout.length_semantics: exact`
  with `rollout.max_new_tokens` the codec grid's H*W; Ray workers fit `ray.num_cpus`;
- dataset rows (`data.path`, every file and shard, every split; `data.val_path`,
  `data.test_path`) through the same loaders training uses (`uniweave.data.rows`), images
  included, at the model's image size (from its codec or checkpoint files, any kind):
  the first bad row names its `file:line`; for SFT every training row has an
  assistant turn to learn (and, with `algorithm.soft_bsq.weight` > 0, some training row
  has an image in an assistant turn); with the digits word tokenizer, every target maps to known ids;
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
from types import SimpleNamespace

from uniweave.codecs import codec_geometry
from uniweave.codecs.base import CONFIG_NAME as CODEC_CONFIG
from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.errors import InputError
from uniweave.config.methods import get_key, method, names
from uniweave.config.resolved import data_tasks
from uniweave.config.resolved import run_dir as run_dir_of
from uniweave.config.schema import ModelConfig
from uniweave.core.atomic import is_temporary
from uniweave.data.images import processor_for
from uniweave.data.loader import DatasetError, Rows, load_rows
from uniweave.data.rows import answer_image_grid, check_targets, has_split, split_key, split_rows
from uniweave.data.tokenizer import build_tokenizer
from uniweave.models import check_model_config
from uniweave.models.build import build_model
from uniweave.models.registry import ModelFacts, inspect_model
from uniweave.models.tiny.build import new_codec
from uniweave.rewards.answers import check_answers, check_dataset_answers
from uniweave.rewards.defaults import evaluation_reward
from uniweave.rewards.digit_classifier import CLASSIFIER_DIR, DigitClassifier
from uniweave.rewards.service import build_reward_service
from uniweave.rollout.config import sampling_params
from uniweave.train.distributed.parallel import check_fsdp2_support
from uniweave.train.engine.adapters import check_initial_adapter
from uniweave.train.onpolicy.prompts import check_exact_length
from uniweave.train.onpolicy.workers import RayPlan, check_capacity

HEADER_BYTES = 8
SHARD_INDEX = ".safetensors.index.json"
RUN_CODEC, RUN_TOKENIZER = "codec", "tokenizer"
"""Where a run directory keeps the codec and tokenizer of a model built from the config
(`uniweave.train.run`)."""
GENERATIONS = "generations"
"""`uniweave generate`'s default output directory under `run.output_dir`."""
EVALS = "evals"
"""Where a run keeps its evaluations (`uniweave.train.run`)."""
RUN_MARKERS = ("config.yaml", "config_hash", "checkpoints")
"""What makes a directory a uniweave run: a run writes `config.yaml` and `config_hash`
before anything else (`uniweave.train.run.prepare_run_dir`)."""
LEFTOVERS = (CLASSIFIER_DIR, GENERATIONS, RUN_CODEC, RUN_TOKENIZER, EVALS)
"""What uniweave writes into `run.output_dir` before (or without) a run there: the digits
classifier (`uniweave eval`, `uniweave generate --task`), generations, a codec or tokenizer
fitted ahead of the run, evaluations; with `uniweave eval`'s `eval-<split>` directories."""


def preflight(cfg: UniweaveConfig, algorithms: Collection[str] | None = None) -> None:
    """Check everything `cfg` makes a run read (module docstring); writes nothing.
    `algorithms`: the method names that can be trained (default: every registered one)."""
    if algorithms is None:
        algorithms = names()
    if cfg.algorithm.name not in algorithms:
        raise ConfigError(
            f"'{cfg.algorithm.name}' cannot be trained yet",
            key="algorithm.name",
            expected=" | ".join(sorted(algorithms)),
        )
    check_model_config(cfg.model)
    if cfg.trainer.parallel == "fsdp2":
        check_fsdp2_support()
    check_run_dir(run_dir_of(cfg))
    check_weights(cfg.model.path, "model.path")
    check_weights(cfg.model.initial_adapter, "model.initial_adapter")
    check_initial_adapter(cfg)
    spec = method(cfg.algorithm.name)
    for dotted in spec.model_dirs:  # OPD: the teacher
        check_weights(get_key(cfg.algorithm, dotted), f"algorithm.{dotted}")
    check_weights(cfg.model.codec.path, "model.codec.path")  # set only with model.path null
    for k, plugin in enumerate(cfg.reward.plugins):
        check_weights(plugin.path, f"reward.plugins.{k}.path")
    geometry = check_model(cfg)
    check_ray(cfg)
    if cfg.data.path is not None:
        check_rows(cfg, geometry)
    if cfg.reward.plugins:
        check_rewards(cfg)
    if spec.preflight is not None:  # OPD: the teacher's action spaces
        spec.preflight(cfg, SimpleNamespace(inspect=_inspect, student_facts=_student_facts))


def check_run_dir(out: Path) -> None:
    """`run.output_dir` does not exist, is empty, is a uniweave run (it holds one of
    `RUN_MARKERS`), or holds only what uniweave writes there before a run (`LEFTOVERS`,
    `eval-<split>` directories of `uniweave eval`, temporaries of interrupted writes):
    anything else is someone's directory, which a run must not fill."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory", key="run.output_dir")
    names = sorted(p.name for p in out.iterdir())
    if any(name in RUN_MARKERS for name in names):
        return
    foreign = [
        n
        for n in names
        if n not in LEFTOVERS and not n.startswith("eval-") and not is_temporary(out / n)
    ]
    if foreign:
        shown = ", ".join(foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise ConfigError(
            f"{out} is not empty and is not a uniweave run (it holds {shown}); choose a new "
            "or empty directory",
            key="run.output_dir",
        )


def preflight_inference(
    cfg: UniweaveConfig, splits: Collection[str] = (), verify: bool = True
) -> None:
    """`uniweave eval`, `probe` and `generate`: check what the command reads before it builds
    the model or writes anything, as `preflight` does for a run: the model section, the
    weights at `model.path` (or the codec at `model.codec.path`), the model's files, the
    reward plugins' paths, and every row of each of `splits` (`data.<split>_path` or the
    split's `data.path` rows, images at the model's size) with the answers its verifiers
    need (`check_split_rows`; `verify` False: the rows only, for a command that scores
    nothing, `uniweave probe`). Raises the same one-line `ConfigError`s; writes nothing."""
    check_model_config(cfg.model)
    out = run_dir_of(cfg)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory", key="run.output_dir")
    check_weights(cfg.model.path, "model.path")
    check_weights(cfg.model.codec.path, "model.codec.path")
    for k, plugin in enumerate(cfg.reward.plugins):
        check_weights(plugin.path, f"reward.plugins.{k}.path")
    geometry = check_model(cfg)
    if cfg.data.path is not None and splits:
        check_split_rows(cfg, splits, geometry, verify)
    if cfg.reward.plugins:
        check_rewards(cfg)


def check_split_rows(
    cfg: UniweaveConfig,
    splits: Collection[str],
    geometry: Geometry | None = None,
    verify: bool = True,
) -> None:
    """The rows of each of `splits` as an evaluation reads them (`split_rows`, images
    through the model's processor) and verified by the plugins that score them
    (`evaluation_reward`: the `reward:` plugins, else the tasks' default verifiers); a
    bad row is an InputError naming its file:line and the key naming its file."""
    if not splits:
        return
    processor, grid = _processor(cfg, geometry)
    reward = evaluation_reward(cfg)[0] if verify else None
    for split in splits:
        try:
            rows = split_rows(cfg.data, split, processor, grid)
            if reward is not None:
                check_answers(reward, rows)
        except DatasetError as err:
            raise _as_input_error(err, split_key(cfg.data, split)) from None


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
        grid = new_codec(model).grid
        return int(grid[0]), int(grid[1])
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


Geometry = tuple[tuple[int, int], tuple[int, int] | None, int | None]
"""(codec grid, image size, channels) of the model: what dataset rows are read with."""


def check_model(cfg: UniweaveConfig) -> Geometry | None:
    """The model as its files and config say, no weights read (module docstring); returns
    its codec grid, image size and channels (None for a kind that cannot tell them up
    front)."""
    m, spec = cfg.model, method(cfg.algorithm.name)
    channels: int | None
    if m.path is None:
        grid = _config_grid(m)  # prefix sharing: the schema decides from model.tiny
        size: tuple[int, int] | None = (m.codec.image_size, m.codec.image_size)  # its codec's
        channels = m.codec.channels
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
        if spec.preflight_model is not None:  # GRPO: prompt-prefix sharing
            spec.preflight_model(cfg, facts, f"the {m.kind} model at {m.path}")
        grid, size, channels = facts.grid, facts.image_size, facts.channels
    if spec.rollouts:
        check_exact_length(cfg.rollout, grid)
    return grid, size, channels


def check_ray(cfg: UniweaveConfig) -> None:
    """Ray workers on a new local instance of `ray.num_cpus` CPUs fit in it (the GPUs
    and the CPUs of an instance sized by Ray are checked when it has started)."""
    if not (cfg.rollout.workers or cfg.reward.workers):
        return
    plan = RayPlan.from_config(cfg)
    if plan.init.get("address") == "local" and "num_cpus" in plan.init:
        check_capacity(plan, {"CPU": float(plan.init["num_cpus"])})


def _student_facts(cfg: UniweaveConfig) -> ModelFacts | None:
    """The student's full `ModelFacts`: read from `model.path`, or of the model built
    from the config as the run builds it, writing nothing (module docstring)."""
    if cfg.model.path is not None:
        return _inspect(cfg.model.path, "model.path", full=True)
    run_dir = run_dir_of(cfg)
    codec_dir, tokenizer_dir = run_dir / RUN_CODEC, run_dir / RUN_TOKENIZER
    model = build_model(
        cfg,
        codec_dir=codec_dir if (codec_dir / CODEC_CONFIG).is_file() else None,
        tokenizer_dir=tokenizer_dir if (tokenizer_dir / "tokenizer.json").is_file() else None,
    )
    return ModelFacts.of(model)


def _processor(cfg: UniweaveConfig, geometry: Geometry | None):
    """The image processor and grid the run reads dataset rows with (`dataset_rows`:
    `processor_for` the model's kind at its codec's image size); for a kind that cannot
    tell its geometry up front, no processor (images are only read here) and a
    placeholder grid."""
    if geometry is None:
        return None, (1, 1)
    grid, size, channels = geometry
    if size is None:
        return None, grid
    return processor_for(cfg.model.kind, size, cfg.data.image_resize, channels or 1), grid


def _as_input_error(err: DatasetError, key: str) -> InputError:
    """`err` as an InputError naming the key it carries (the file of its split, or
    `data.tasks`), else `key`."""
    return InputError(str(err), err.key or key)


def _evaluated_splits(cfg: UniweaveConfig) -> tuple[str, ...]:
    """The splits a run evaluates that have rows: the val rows of in-training evaluation,
    the test rows of the final one."""
    splits = []
    if cfg.data.val_size > 0 and cfg.trainer.eval_every > 0:
        splits.append("val")
    if cfg.data.test_size > 0:
        splits.append("test")
    return tuple(s for s in splits if has_split(cfg.data, s))


def check_rows(cfg: UniweaveConfig, geometry: Geometry | None = None) -> Rows:
    """Every row of every dataset file the config names, read as the run reads them
    (`geometry`: the model's codec grid and image size, `check_model`); the training rows
    returned."""
    processor, grid = _processor(cfg, geometry)
    codec_grid = geometry[0] if geometry else None
    data = cfg.data
    spec = method(cfg.algorithm.name)
    rollouts = spec.rollouts
    assert data.path is not None, "check_rows runs for a config with data.path"
    try:
        load_rows(data.path, processor, grid, data.default_task)
        train = split_rows(data, "train", processor, grid)
        for split, path in (("val", data.val_path), ("test", data.test_path)):
            if path is not None:
                split_rows(data, split, processor, grid)
        # the prompts a verifier scores need their answers
        if rollouts:
            check_dataset_answers(cfg, ("train",))
        evaluated = _evaluated_splits(cfg)
    except DatasetError as err:
        raise _as_input_error(err, "data.path") from None
    # val/test rows: read and verified as the run's evaluations will (`uniweave eval` too)
    check_split_rows(cfg, evaluated, geometry)
    if rollouts:
        check_prompts(cfg, train, codec_grid)
    if spec.preflight_rows is not None:  # SFT: every row has a target to learn
        spec.preflight_rows(cfg, train)
    if cfg.model.path is None and cfg.model.kind == "tiny" and not data.uses_bpe:
        try:
            check_targets(train, build_tokenizer())
        except DatasetError as err:
            raise _as_input_error(err, "data.path") from None
    return train


def check_prompts(cfg: UniweaveConfig, rows: Rows, codec_grid: tuple[int, int] | None) -> None:
    """GRPO / OPD: every training row of `data.tasks` is a request the rollout engine
    takes (`uniweave.train.onpolicy.prompts.rollout_request`): under `length_semantics:
    exact` its answer is one image; an image answer's grid lies within
    `rollout.min_grid_side`..`max_grid_side`; for OPD's privileged teacher
    (`algorithm.teacher.privilege: answer`) it has an answer."""
    params = sampling_params(cfg.rollout)
    own = method(cfg.algorithm.name).preflight_prompt  # OPD: a privileged teacher's answers
    tasks = set(data_tasks(cfg.data))
    for sample in rows.samples:
        if sample.task not in tasks:
            continue
        where = rows.where.get(sample.id, sample.id)
        grid = answer_image_grid(sample, codec_grid or (1, 1))
        if grid is None and params.length_semantics == "exact":
            raise InputError(
                f"{where}: messages: the answer is not one image, and length_semantics "
                "'exact' rolls out image-only rows (set rollout.length_semantics=cap, or leave the row out)",
                "rollout.length_semantics",
            )
        if grid is not None and codec_grid is not None and not params.grid_allowed(*grid):
            low = min(grid) < params.min_grid_side
            raise InputError(
                f"{where}: its answer image of {grid[0]}x{grid[1]} positions is outside "
                f"[{params.min_grid_side}, {params.max_grid_side}] per side",
                "rollout.min_grid_side" if low else "rollout.max_grid_side",
            )
        if own is not None:
            own(cfg, sample, where)


def _never_decode(codes):
    raise RuntimeError("the preflight reward service decodes no images")


def check_rewards(cfg: UniweaveConfig) -> None:
    """Build the reward service of the `reward` section once (plugins loading their own
    models from `path` load them; the run's digits classifier, fitted later in the run
    directory, stands in as an unfitted one)."""
    resources = {"digit_classifier": DigitClassifier()}
    build_reward_service(cfg.reward, decode_images=_never_decode, resources=resources)
