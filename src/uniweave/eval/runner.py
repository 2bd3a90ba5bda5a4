"""The evaluator: `uniweave eval`, in-training validation (`val/...` every
`trainer.eval_every`) and the end-of-run test evaluation (`eval.json`) are all
`evaluate` — a model on one data split, through the rollout engine, scored by the
configured reward plugins; resumable records, `summary.json` and `index.html`.

Rows: `data.path` rows of `evaluation.split` (`uniweave.data.rows.split_rows`, images
through the model's processor; a row a verifier would score without the answer it
needs is a DatasetError naming its file:line, `check_answers`), or the digits tasks'
rows of that split (`data.<split>_size` per task, from `data.seed`); of a `data.path`
val or test split, training's evaluations and `uniweave eval` alike keep the first
`data.<split>_size` rows per task (0 is refused), so both score the same rows; then
`evaluation.max_samples` (0 = all) rows stratified by task (`stratified_cap`): the cap is
dealt round-robin over the tasks in order of first appearance (a task with no rows left
passes its turn), and each task keeps that many of its rows, drawn without replacement
by a generator seeded from (data.seed, the task's name), in their original order. A
kept row keeps its index among its task's rows, so its rollout seeds (below) do not
depend on the cap.

Scoring (`uniweave.rewards.evaluation_reward`): the `reward:` plugins, or, when it names
none, each task's default verifier (`uniweave.rewards.TASK_VERIFIERS`: the digits
classifier for t2i, the exact answer for draw_then_answer, ...); which one is written to
summary.json (`scoring`). A task with neither is a ConfigError. The digits classifier,
when a plugin needs it, is `<run.output_dir>/classifier` (fitted there on first use;
training passes its run directory's), so a run's evaluations and `uniweave eval` with the
run's config score with one classifier. A rollout passes when its total reward is >=
`evaluation.pass_threshold` (`uniweave.rewards.passes`).

Decoding: row i of task t is its task's k-th row; it is rolled out
n = `evaluation.rollouts_per_sample` times, member m drawing with the stateless seed
`seed_for(run.seed, 0, k, m)`, so two checkpoints evaluated on the same config see
common random numbers, and a task's seeds do not depend on the other tasks or on how
many rows are kept. A row whose answer is one image (an image or a generate_image item,
never a task name) is forced into an image of its grid with an exact count of H*W
positions; other rows decode under the `rollout:` cap. Greedy or sampled is
`evaluation.greedy` (image rows: sampled whenever `evaluation.sample_images`); the other
sampling parameters are `rollout:`'s.

Task extras: for `draw_then_answer` rows the masked-image answer probe
(`uniweave.eval.masked`) runs on the same rollouts and each record keeps its two scores.

Layout of the output directory (`evaluation.output_dir`, default
<run.output_dir>/eval-<split>; training: <run_dir>/evals/<split>-update-NNNNNN):
results.jsonl (one record per (id, member), see `uniweave.eval.records`), images/*.png,
summary.json, index.html, config_hash (a re-run with another config refuses to mix its
records in) and weights_sha256 (`weights_sha256` of the model: records are reused only for
the same weights; `uniweave eval` refuses other weights, training replaces their records).

Several ranks (`ranks`: in-training validation under trainer.parallel ddp): rank 0
prepares the directory (weights and config hashes, a torn last record truncated), then
every rank reads the same committed records and so the same list of (row, member) still
to do; the ranks claim its engine batches (`rollout.batch_size` consecutive items) from a
counter in the job's torch.distributed store (`uniweave.rollout.queue.WorkQueue`) and each
commits its records to the shared results.jsonl, one atomic O_APPEND write per record.
After a barrier rank 0 reads every record back and summarises them in sample order, so
the records and the summary equal one rank's (every item carries its own seed; the
engine batches are the same ones), and a killed evaluation resumes from whatever any
rank committed.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import shutil
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from rich.progress import Progress

from uniweave.config import ConfigError, UniweaveConfig, config_hash
from uniweave.config.resolved import data_tasks, run_dir
from uniweave.config.trained_on import mismatch_warnings
from uniweave.core.atomic import write_text_atomic
from uniweave.core.host_memory import apply_mmap_threshold
from uniweave.core.sample import ImagePart, Part, Sample, TextPart
from uniweave.core.seeding import seed_for
from uniweave.data.digits import make_task_samples
from uniweave.data.rows import answer_image_grid, resolve_tasks
from uniweave.eval.masked import TASK as MASKED_TASK
from uniweave.eval.masked import masked_answer_scores
from uniweave.eval.records import RESULTS, ResultLog
from uniweave.eval.scorecard import PAGE, SUMMARY, summarize, write_json, write_page
from uniweave.models.base import UnifiedModel
from uniweave.models.build import build_model, dataset_rows, resolve_device
from uniweave.models.registry import with_saved_sizes
from uniweave.rewards import (
    RewardService,
    build_responses,
    build_reward_service,
    check_answers,
    evaluation_reward,
    headline_metrics,
    passes,
)
from uniweave.rewards.digit_classifier import (
    CLASSIFIER_DIR,
    load_or_fit_classifier,
    needs_digit_classifier,
)
from uniweave.rollout import RolloutEngine, RolloutRequest
from uniweave.rollout.config import sampling_params
from uniweave.rollout.queue import WorkQueue, job_store

Rollout = Callable[[Sequence[RolloutRequest]], list]

logger = logging.getLogger(__name__)


def engine_rollout(model: UnifiedModel) -> Rollout:
    """The rollout function evaluation uses: the engine, directly (one place to swap in
    the rollout service)."""
    engine = RolloutEngine(model, model.tokenizer)
    return engine.generate


def eval_samples(cfg: UniweaveConfig, model: UnifiedModel, per_task: int = 0) -> list[Sample]:
    """The rows to evaluate (module docstring); with `per_task` > 0, only the first
    `per_task` rows of each task (training: `data.<split>_size`)."""
    return [s for _, s in indexed_eval_samples(cfg, model, per_task)]


def indexed_eval_samples(
    cfg: UniweaveConfig, model: UnifiedModel, per_task: int = 0
) -> list[tuple[int, Sample]]:
    """`eval_samples`' rows, each with its index among its task's rows before the
    `evaluation.max_samples` cap (its seed index)."""
    split = cfg.evaluation.split
    sizes = {"train": cfg.data.train_size, "val": cfg.data.val_size, "test": cfg.data.test_size}
    if cfg.data.path is not None:
        if not per_task and split in ("val", "test"):
            # the run's own evaluations take the first data.<split>_size rows per task;
            # `uniweave eval` takes the same rows, so both give the same numbers
            if sizes[split] == 0:
                raise ConfigError(
                    f"evaluation.split={split} evaluates nothing: data.{split}_size is 0",
                    key=f"data.{split}_size",
                    expected="> 0 rows per task",
                )
            per_task = sizes[split]
        rows = dataset_rows(cfg, model, split)
        check_answers(evaluation_reward(cfg)[0], rows)
        samples = rows.samples
        if per_task:
            samples = [s for s, k in zip(samples, task_indices(samples)) if k < per_task]
    else:
        n = sizes
        if n[split] == 0:
            raise ConfigError(
                f"the digits {split} split of evaluation.split has no rows",
                key=f"data.{split}_size",
                expected="> 0 rows per task",
            )
        samples = [
            s
            for task in data_tasks(cfg.data)
            for s in make_task_samples(task, split, n[split], seed=cfg.data.seed)
        ]
    indexed = list(zip(task_indices(samples), samples))
    keep = stratified_cap([s.task for s in samples], cfg.evaluation.max_samples, cfg.data.seed)
    return [indexed[i] for i in keep]


def stratified_cap(tasks: Sequence[str | None], cap: int, seed: int) -> list[int]:
    """Positions (ascending) of at most `cap` rows (0 = all) whose tasks are `tasks`,
    stratified by task (module docstring): quotas dealt round-robin over the tasks in
    order of first appearance, each task's rows drawn by a generator seeded from
    (`seed`, the task's name)."""
    if not cap or cap >= len(tasks):
        return list(range(len(tasks)))
    by_task: dict[str | None, list[int]] = {}
    for i, task in enumerate(tasks):
        by_task.setdefault(task, []).append(i)
    quota = dict.fromkeys(by_task, 0)
    left = cap
    while left:
        for task, rows in by_task.items():
            if left and quota[task] < len(rows):
                quota[task] += 1
                left -= 1
    keep: list[int] = []
    for task, rows in by_task.items():
        name = zlib.crc32(str(task).encode())
        chosen = np.random.default_rng([seed, name]).choice(len(rows), quota[task], replace=False)
        keep.extend(rows[j] for j in chosen)
    return sorted(keep)


def task_indices(samples: Sequence[Sample]) -> list[int]:
    """Each row's index among the rows of its own task, in order (its seed index)."""
    seen: dict[str | None, int] = {}
    out = []
    for sample in samples:
        k = seen.get(sample.task, 0)
        out.append(k)
        seen[sample.task] = k + 1
    return out


def make_request(
    cfg: UniweaveConfig, sample: Sample, index: int, member: int, grid
) -> RolloutRequest:
    """Member `member` of the task's row `index` (module docstring)."""
    e = cfg.evaluation
    seed = seed_for(cfg.run.seed, 0, index, member)
    image = answer_image_grid(sample, grid)
    if image is not None:
        params = sampling_params(
            cfg.rollout,
            max_new_tokens=image[0] * image[1],
            length_semantics="exact",
            greedy=e.greedy and not e.sample_images,
        )
        return RolloutRequest(sample.fork(member), seed, params, image_grid=image)
    params = sampling_params(cfg.rollout, length_semantics="cap", greedy=e.greedy)
    return RolloutRequest(sample.fork(member), seed, params)


def eval_rewards(cfg: UniweaveConfig, model: UnifiedModel, classifier_dir: Path) -> RewardService:
    """The reward service an evaluation scores with (`evaluation_reward`); the digits
    classifier, when a plugin needs one, from (or fitted into) `classifier_dir`."""
    reward, _ = evaluation_reward(cfg)
    resources = {}
    if needs_digit_classifier(reward):
        resources["digit_classifier"] = load_or_fit_classifier(classifier_dir)
    return build_reward_service(reward, decode_images=model.codec.decode, resources=resources)


def _text_of(parts: Sequence[Part]) -> str:
    pieces = []
    for part in parts:
        pieces.append(part.text if isinstance(part, TextPart) else "<image>")
    return "".join(pieces)


def _pixels(part: ImagePart, model: UnifiedModel) -> np.ndarray | None:
    if part.pixels is not None:
        return part.pixels
    if part.codes is None:
        return None
    try:
        return model.codec.decode(part.codes[None])[0].float().cpu().numpy()
    except ValueError:
        return None


def _records(cfg, model, log, batch, trajs, rewards: RewardService) -> None:
    """Score one batch of (task index, member, sample) rows and commit their records."""
    forked = [s.fork(m) for _, m, s in batch]
    parsed = [model.parse_response(t) for t in trajs]
    responses, _ = build_responses(parsed, model.codec.decode)
    result = rewards.score(forked, trajs, parsed, alarm=False)
    passed = passes(result.total, cfg.evaluation.pass_threshold)
    probe = [j for j, s in enumerate(forked) if s.task == MASKED_TASK and s.answer is not None]
    masked: dict[int, dict[str, float]] = {}
    if probe:
        scores = masked_answer_scores(
            model, [forked[j] for j in probe], [trajs[j] for j in probe], cfg.rollout.batch_size
        )
        masked = {j: {k: v[r] for k, v in scores.items()} for r, j in enumerate(probe)}
    for j, ((index, m, sample), traj, response) in enumerate(zip(batch, trajs, responses)):
        images: dict[str, np.ndarray] = {}
        prompt_parts = [p for p in sample.parts if p.role != "assistant"]
        prompt_images = []
        for k, part in enumerate(p for p in prompt_parts if isinstance(p, ImagePart)):
            pixels = _pixels(part, model)
            if pixels is not None:
                rel = log.image_path(sample.id, m, k, "in")
                images[rel] = pixels
                prompt_images.append(rel)
        out_images, codes = [], []
        for k, (part, decoded) in enumerate(
            zip([p for p in response.parts if isinstance(p, ImagePart)], response.images)
        ):
            codes.append(part.codes.tolist() if part.codes is not None else None)
            if decoded is not None:
                rel = log.image_path(sample.id, m, k)
                images[rel] = decoded.numpy()
                out_images.append(rel)
        applied = [k for k in result.per_plugin if result.applied[k][j]]
        record: dict[str, Any] = {
            "id": sample.id,
            "member": m,
            "task": sample.task,
            "answer": sample.answer,
            "prompt": _text_of(prompt_parts),
            "prompt_images": prompt_images,
            "response": _text_of(response.parts) if response.parsed else "",
            "parsed": response.parsed,
            "images": out_images,
            "codes": codes,
            "finish_reason": traj.finish_reason,
            "scores": {k: float(result.per_plugin[k][j]) for k in applied},
            "invalid": [k for k in applied if bool(result.invalid[k][j])],
            "total": float(result.total[j]),
            "passed": bool(passed[j]),
            "seed": seed_for(cfg.run.seed, 0, index, m),
        }
        if j in masked:
            record["masked"] = masked[j]
        log.commit(record, images)


def records_config(cfg: UniweaveConfig) -> UniweaveConfig:
    """`cfg` without its execution-only evaluation settings (`evaluation.workers_per_gpu`:
    the records do not depend on it), the config an evaluation directory is keyed by."""
    evaluation = cfg.evaluation.model_copy(update={"workers_per_gpu": 1})
    return cfg.model_copy(update={"evaluation": evaluation})


def _check_hash(out: Path, cfg: UniweaveConfig) -> None:
    path, digest = out / "config_hash", config_hash(records_config(cfg))
    if path.is_file() and path.read_text().strip() != digest:
        raise ConfigError(
            f"{out} holds an evaluation of another config; choose a new evaluation.output_dir",
            key="evaluation.output_dir",
        )
    path.write_text(digest + "\n")


WEIGHTS_HASH = "weights_sha256"
WORK = "work.json"
"""Who computed this attempt's records: `computed[r][w]` records by worker w of rank r,
`kept` records an earlier attempt had committed (a resumed evaluation)."""


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the model's state dict: each tensor's name, dtype, shape and bytes, in
    name order (the identity of the weights an evaluation ran on)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name} {t.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _check_weights(out: Path, digest: str, stale: str) -> None:
    """Records in `out` are reused only for the same weights (`weights_sha256`): records
    of other weights — or of unknown weights, without the hash file — are refused
    (`stale` refuse: `uniweave eval`) or removed (`stale` replace: training's evaluations,
    e.g. a validation re-run after a resume)."""
    path = out / WEIGHTS_HASH
    held = path.read_text().strip() if path.is_file() else None
    has_records = (out / RESULTS).is_file()
    if held != digest and (held is not None or has_records):
        if stale == "refuse":
            raise ConfigError(
                f"{out} holds an evaluation of other weights (weights_sha256 "
                f"{(held or 'unknown')[:12]}, this model {digest[:12]}); choose a new "
                "evaluation.output_dir",
                key="evaluation.output_dir",
            )
        shutil.rmtree(out)
        out.mkdir(parents=True)
    write_text_atomic(path, digest + "\n")


def split_config(cfg: UniweaveConfig, split: str) -> UniweaveConfig:
    """`cfg` evaluating `split` (training's validation and test evaluations)."""
    evaluation = cfg.evaluation.model_copy(update={"split": split})
    return cfg.model_copy(update={"evaluation": evaluation})


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without any)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def worker_models(model: UnifiedModel, n: int) -> list[UnifiedModel]:
    """The models of `n` evaluation workers (`evaluation.workers_per_gpu`): `model` itself
    and n - 1 deep copies (same weights, buffers and training flag, so every worker
    computes what `model` would; each copy costs one more model of memory)."""
    return [model] + [copy.deepcopy(model) for _ in range(n - 1)]


def run_claims(
    claims: Iterator[list[int]],
    run_batch: Callable[[int, list[int]], None],
    workers: int,
    device: torch.device,
) -> None:
    """Run `run_batch(worker, claim)` for every claim `claims` yields. One worker: in
    order, in this thread. Several: one thread per worker, each taking the next claim
    (under a lock: the iterator may claim from the job's store) whenever it is free, on
    CUDA in a stream of its own so the workers' kernels may overlap. The first error
    stops every worker from claiming more and is raised here."""
    if workers == 1:
        for claim in claims:
            run_batch(0, claim)
        return
    lock = threading.Lock()
    failed = threading.Event()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies' weights are written before any stream reads

    def next_claim() -> list[int] | None:
        with lock:
            if failed.is_set():
                return None
            return next(claims, None)

    def work(worker: int) -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        try:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                while (claim := next_claim()) is not None:
                    run_batch(worker, claim)
                if stream is not None:
                    stream.synchronize()
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(workers, thread_name_prefix="uniweave-eval") as pool:
        futures = [pool.submit(work, w) for w in range(workers)]
    for future in futures:
        future.result()  # re-raises a worker's error


def evaluate(
    cfg: UniweaveConfig,
    model: UnifiedModel,
    out: Path,
    rollout: Callable[[UnifiedModel], Rollout] = engine_rollout,
    per_task: int = 0,
    classifier_dir: Path | None = None,
    stale: Literal["refuse", "replace"] = "refuse",
    ranks: tuple[int, int, Any] | None = None,
    committed: list[tuple[str, int]] | None = None,
    worked_by: dict[tuple[str, int], int] | None = None,
) -> dict[str, Any] | None:
    """Evaluate `model` as `cfg` says into `out` (module docstring); the summary.
    `per_task` > 0 keeps the first rows of each task (`eval_samples`); `classifier_dir`
    (default <run.output_dir>/classifier) holds the digits classifier; `stale`: what to
    do with records of other weights in `out` (`_check_weights`). `ranks` (rank, world
    size, process group; a collective, every rank calls it with the same arguments and
    the same weights): the ranks share the work (module docstring, "Several ranks"); the
    summary on rank 0, None on the others. `committed`: gets the (id, member) of every
    record this call (this rank) committed; `worked_by`: (id, member) -> the index of the
    worker (`evaluation.workers_per_gpu`) that computed it. `rollout`: each worker's
    rollout function, made from its model (default the engine)."""
    rank, world, group = ranks if ranks is not None else (0, 1, None)
    reward, source = evaluation_reward(cfg)
    indexed = indexed_eval_samples(cfg, model, per_task)
    samples = [s for _, s in indexed]
    if rank == 0:  # before any other rank reads the directory
        out.mkdir(parents=True, exist_ok=True)
        _check_weights(out, weights_sha256(model), stale)
        _check_hash(out, cfg)
        log = ResultLog(out)  # recovers (truncates) a torn last record
    if world > 1:
        torch.distributed.barrier(group=group)
        if rank > 0:
            log = ResultLog(out)
    classifier_dir = classifier_dir or run_dir(cfg) / CLASSIFIER_DIR
    grid = tuple(model.codec.grid)
    n = cfg.evaluation.rollouts_per_sample
    todo = [(k, m, s) for k, s in indexed for m in range(n) if (s.id, m) not in log.done]
    quiet = os.environ.get("CI", "").lower() == "true" or not sys.stderr.isatty()
    size = cfg.rollout.batch_size
    # engine batches: `size` consecutive todo rows; with several ranks each rank claims
    # the next one from the job's store, so the batches are the same at any world size
    queue = WorkQueue("eval", rank, world, job_store()) if world > 1 else None
    claims = (
        queue.claims([0] * len(todo), size)  # equal lengths: in todo order
        if queue is not None
        else (list(range(i, min(i + size, len(todo)))) for i in range(0, len(todo), size))
    )
    models = worker_models(model, cfg.evaluation.workers_per_gpu)
    # the digits classifier is fitted (once) here, before any worker starts
    workers = [(m, eval_rewards(cfg, m, classifier_dir), rollout(m)) for m in models]
    with Progress(disable=quiet or rank > 0, transient=False) as progress:
        bar = progress.add_task("eval", total=len(samples) * n, completed=len(log.done))

        def run_batch(worker: int, claim: list[int]) -> None:
            wmodel, rewards, generate = workers[worker]
            batch = [todo[i] for i in claim]
            requests = [make_request(cfg, s, k, m, grid) for k, m, s in batch]
            with torch.no_grad():
                trajs = generate(requests)
            _records(cfg, wmodel, log, batch, trajs, rewards)
            if committed is not None:
                committed.extend((s.id, m) for _, m, s in batch)
            if worked_by is not None:
                worked_by.update({(s.id, m): worker for _, m, s in batch})
            with lock:
                counts[worker] += len(batch)
            progress.advance(bar, len(batch))

        lock, counts = threading.Lock(), [0] * len(workers)
        run_claims(claims, run_batch, len(workers), model_device(model))
    work = [counts]
    if world > 1:
        work = [[] for _ in range(world)]
        # every rank's records are committed once every rank has sent its counts
        torch.distributed.all_gather_object(work, counts, group=group)
        torch.distributed.barrier(group=group)
        if rank > 0:
            return None
        assert queue is not None, "a queue with more than one rank"
        queue.close()
        log = ResultLog(out)  # every rank's records
    write_json(out / WORK, {"computed": work, "kept": len(samples) * n - sum(map(sum, work))})
    wanted = {(s.id, m) for s in samples for m in range(n)}
    position = {(s.id, m): j for j, (s, m) in enumerate((s, m) for s in samples for m in range(n))}
    # sample order, members in order: whatever rank or attempt committed a record
    records = sorted(
        (r for r in log.records if (r["id"], r["member"]) in wanted),
        key=lambda r: position[(r["id"], r["member"])],
    )
    summary = summarize(records, n, headline_metrics(data_tasks(cfg.data)))
    summary["scoring"] = {
        "source": source,
        "plugins": [p.model_dump(mode="json") for p in reward.plugins],
        "truncated_reward": reward.truncated_reward,
        "pass_threshold": cfg.evaluation.pass_threshold,
    }
    write_json(out / SUMMARY, summary)
    write_page(out / PAGE, records, summary)
    return summary


def task_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's per-task statistics as flat `<task>/<statistic>` metrics (what
    training logs under `val/` and writes to eval.json)."""
    return {f"{t}/{k}": v for t, stats in summary["tasks"].items() for k, v in stats.items()}


def run_eval(cfg: UniweaveConfig) -> Path:
    """`uniweave eval`: build the model (`model.path`, or the tiny model built from the
    config's seed), evaluate it, and return the output directory."""
    cfg = resolve_tasks(cfg)  # data.tasks null: the rows' one label
    cfg = with_saved_sizes(cfg)  # model.path: the loaded model's sizes
    e = cfg.evaluation
    out = Path(e.output_dir or f"{cfg.run.output_dir}/eval-{e.split}")
    evaluation_reward(cfg)  # a task nothing can score: a ConfigError before the model loads
    for line in mismatch_warnings(cfg):  # tasks / rows the model was not trained on
        logger.warning("%s", line)
    apply_mmap_threshold(cfg.run.host_mmap_threshold)
    model = build_model(cfg).to(resolve_device(cfg.run.device)).eval()
    evaluate(cfg, model, out)
    return out
