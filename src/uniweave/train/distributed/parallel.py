"""Data parallelism (`trainer.parallel`): torch DDP or FSDP2 around the policy.

Everything the objective does with the model goes through `Parallel.run(fn, *args)`,
which calls `fn(model, *args)` inside the forward of a `Runner` module, so that the
wrapper's hooks run even though objectives call the model's methods (`prepare`, `hidden`,
the heads) rather than its `forward`:

- `none`: one process; `run` is a plain call.
- `ddp`: `DistributedDataParallel(Runner)`; communication overlaps backward, and the
  accumulation micro-batches but the last run under `no_sync`. Each rank's loss is its
  share of the *global* objective (normalised by the global count), so the gradients
  must be summed, not averaged. `trainer.gradient_sync` says how: `ddp` (default) keeps
  DDP's own buckets (each rank's gradient divided by the world size W, all-reduced with
  SUM during backward) and `after_sync` multiplies the result by W after the update's
  last backward; `post_backward_sum` registers a communication hook that all-reduces
  each bucket with SUM and no division. Both give the sum of the ranks' gradients, so
  the N-process gradient equals the one-process one. When W is a power of two they are
  bitwise equal (dividing and multiplying by 2^k is exact, and a sum of values all
  scaled by 2^-k rounds exactly as the unscaled sum does, barring subnormals); for
  other W each of the two roundings (g / W, then * W) adds at most half an ulp, so an
  element differs by at most ~(W + 1) ulp of the summed gradient.
- `fsdp2`: `fully_shard` on every decoder layer (modules whose class name ends in
  ``DecoderLayer``, transformers' convention) and on the Runner (the root: embeddings,
  heads, the rest). Parameters are all-gathered in `trainer.fsdp.param_dtype` and
  gradients reduce-scattered in `reduce_dtype` with SUM (divide factor 1, sum-only
  collectives); a parameter a rank's micro-batch did not reach (an image tower, a head)
  contributes zeros, so every rank reduce-scatters the same buffers; the optimizer
  built over the sharded parameters has sharded state. Gradients are reduce-scattered
  once per update: the micro-batches but the last accumulate unsharded gradients
  locally (`set_requires_gradient_sync(False)`, FSDP2's `no_sync`) — more memory
  (a full gradient per rank while accumulating), one collective instead of one per
  micro-batch. A parameter that no rank reaches in a whole update would keep the zeros
  FSDP2 reduce-scattered for it, where one process leaves `.grad` None and AdamW skips
  it (no moment decay, no weight decay): hooks on the unsharded parameters record which
  ones got a gradient, and after the last backward `drop_unreached` sets `.grad = None`
  on those no rank reached (e.g. Janus-Pro's understanding aligner in a t2i-only batch).
  Frozen models the objective uses (`objective.frozen_models()`: the GRPO reference, the
  OPD teacher) are sharded the same way under the same root, never replicated per rank;
  their parameters are gathered per forward, like the policy's, and get no gradient.
  Rollouts and other no-grad uses of the policy (and of a frozen model outside the loss,
  e.g. OPD's carrier count) go through `run` as well (`gathered`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from uniweave.config import ConfigError
from uniweave.config.trainer import TrainerConfig
from uniweave.core.dtypes import at_least_fp32
from uniweave.train.distributed.comm import DistInfo, all_gather_objects

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


class ReplicaDriftError(RuntimeError):
    """DDP replicas disagree (a tensor's hash differs between ranks)."""


class Runner(nn.Module):
    """`forward(fn, *args) = fn(model, *args)`: a forward through which any use of the
    model passes the wrapper's hooks. `frozen` modules are registered (fsdp2 shards
    them with the policy) but trained by nobody."""

    def __init__(self, model: nn.Module, frozen: Sequence[nn.Module] = ()) -> None:
        super().__init__()
        self.model = model
        self.frozen = nn.ModuleList(frozen)

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.model, *args)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of `model` (class name ending in ``DecoderLayer``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _sum_hook(state, bucket):  # noqa: ANN001 (DDP checks the annotation object itself)
    """DDP communication hook: all-reduce SUM of the bucket (DDP's default divides by
    the world size)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def check_fsdp2_support() -> None:
    """ConfigError on `trainer.parallel` when this torch's FSDP2 lacks what the fsdp2 mode
    relies on: `FSDPModule.set_reduce_scatter_unused_params` (a parameter that some rank's
    micro-batches never reach still joins the reduce-scatter, so the collectives line up).
    torch 2.11's FSDP2 has no such method (found on a GPU machine); 2.13 has it."""
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        raise ConfigError(
            f"fsdp2 needs FSDPModule.set_reduce_scatter_unused_params, which torch "
            f"{torch.__version__} does not have (torch 2.13 does); set trainer.parallel=ddp or use a newer torch",
            key="trainer.parallel",
        )


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float) -> tuple[float, float]:
    """Clip the global L2 norm to `max_norm` (<= 0: no clipping).

    Returns (pre-clip norm, applied scale), the scale being min(1, max_norm / norm).
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = (
        torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(at_least_fp32(g.detach())) for g in grads])
        ).item()
        if grads
        else 0.0
    )
    scale = 1.0
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm, scale


class Parallel:
    """The policy wrapped as `cfg.parallel` says (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainerConfig,
        info: DistInfo,
        frozen: Sequence[nn.Module] = (),
    ) -> None:
        self.mode = cfg.parallel
        self.info = info
        self.model = model
        if info.enabled and self.mode == "none":
            raise ValueError(f"trainer.parallel=none with {info.world_size} processes")
        self.runner = Runner(model, frozen if self.mode == "fsdp2" else ())
        self.wrapped: nn.Module = self.runner
        # fully_shard turns each unit into an FSDPModule (its methods are added at run time)
        self._units: list[Any] = []
        self._watched: set[int] = set()
        self._reached: set[int] = set()
        if self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device = next(model.parameters()).device
            self.wrapped = DistributedDataParallel(
                self.runner,
                device_ids=[device] if device.type == "cuda" else None,
                find_unused_parameters=cfg.ddp.find_unused_parameters,
                static_graph=cfg.ddp.static_graph,
            )
            if cfg.gradient_sync == "post_backward_sum":
                self.wrapped.register_comm_hook(None, _sum_hook)
        elif self.mode == "fsdp2":
            self._shard(cfg)
        self.gradient_sync = cfg.gradient_sync

    def _shard(self, cfg: TrainerConfig) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        param, reduce = DTYPES[cfg.fsdp.param_dtype], DTYPES[cfg.fsdp.reduce_dtype]
        units = decoder_layers(self.runner)
        if not units:
            raise ValueError(f"fsdp2: {type(self.model).__name__} has no *DecoderLayer modules")
        layer_policy = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
        for layer in units:
            reshard = cfg.fsdp.reshard_after_forward
            fully_shard(layer, mp_policy=layer_policy, reshard_after_forward=reshard)
        # The root's inputs are batches (rollout log-probs, advantages, pixels): never cast.
        root_policy = MixedPrecisionPolicy(
            param_dtype=param, reduce_dtype=reduce, cast_forward_inputs=False
        )
        fully_shard(self.runner, mp_policy=root_policy)
        self._units = [*units, self.runner]
        for unit in self._units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_reduce_scatter_unused_params(True)
        # FSDP2 makes its all-gather buffers and unsharded parameters at the first
        # all-gather and keeps them; made inside `torch.inference_mode` (the rollout
        # engine decodes under it) they would be inference tensors that training cannot
        # update in place. Gather every unit once here, outside it.
        with torch.no_grad():
            for unit in self._units:
                unit.unshard()
            for unit in self._units:
                unit.reshard()
        # Watch now, while every unsharded parameter's requires_grad is its trainable
        # flag (LoRA's adapter switch toggles it later, e.g. around a reference pass).
        self._watch_unsharded()

    @property
    def sharded(self) -> bool:
        return self.mode == "fsdp2"

    @property
    def distributed(self) -> bool:
        """Whether checkpoints go through torch.distributed.checkpoint."""
        return self.mode != "none"

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(model, *args)` through the wrapper's forward."""
        out = self.wrapped(fn, *args)
        if self.sharded and torch.is_grad_enabled():
            self._watch_unsharded()
        return out

    def _watch_unsharded(self) -> None:
        """fsdp2: a hook on every trainable unsharded parameter (FSDP2 creates each at its
        first all-gather, here at wrap time, and keeps it) that records, per update, which
        parameters autograd gave a gradient on this rank (`drop_unreached`)."""
        for unit in self._units:
            for fp in unit._get_fsdp_state()._fsdp_param_group.fsdp_params:
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is None or not unsharded.requires_grad:
                    continue
                if id(unsharded) in self._watched:
                    continue
                key = id(fp.sharded_param)
                unsharded.register_post_accumulate_grad_hook(
                    lambda _t, key=key: self._reached.add(key)
                )
                self._watched.add(id(unsharded))

    def after_sync(self, params: Sequence[nn.Parameter]) -> None:
        """After an update's last backward (the one DDP all-reduces in): under ddp with
        `gradient_sync: ddp`, undo DDP's division by the world size, so `.grad` is the sum
        over ranks (module docstring). Nothing otherwise."""
        if self.mode != "ddp" or self.gradient_sync != "ddp" or not self.info.enabled:
            return
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(self.info.world_size)

    def drop_unreached(self, params: Sequence[nn.Parameter]) -> None:
        """fsdp2, after an update's last backward: the parameters no rank gave a gradient
        get `.grad = None` (FSDP2 reduce-scattered zeros for them), as in one process,
        so the optimizer skips them. One MAX all-reduce of a flag per parameter."""
        if not self.sharded:
            return
        device = next(self.model.parameters()).device
        flags = torch.tensor([float(id(p) in self._reached) for p in params], device=device)
        self._reached.clear()
        if self.info.enabled:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        for p, reached in zip(params, flags.tolist()):
            if not reached:
                p.grad = None

    def gathered(self, fn: Callable[[], Any]) -> Any:
        """`fn()` (batch production: rollouts, anchor replays) with the policy usable as
        an ordinary module: under fsdp2 inside the root's forward (no grad), where the
        root's parameters are gathered and each layer gathers its own."""
        if not self.sharded:
            return fn()
        with torch.no_grad():
            return self.runner(lambda _model: fn())

    def accumulation(self, last: bool):
        """Context of one micro-batch's forward+backward: communication only in the last
        micro-batch of an update. DDP: `no_sync` before it. FSDP2:
        `set_requires_gradient_sync(False)` before it (each rank accumulates its
        unsharded gradients locally, as DDP does), then one reduce-scatter of the sum.
        Every rank runs the same number of micro-batches (fsdp2 refuses a token budget),
        so the collectives line up."""
        if self.mode == "ddp" and not last:
            return cast(Any, self.wrapped).no_sync()  # a DistributedDataParallel here
        if self.mode == "fsdp2":
            cast(Any, self.runner).set_requires_gradient_sync(last)  # an FSDPModule here
        return nullcontext()

    def clip(self, params: Iterable[nn.Parameter], max_norm: float) -> tuple[float, float]:
        """Clip the global gradient L2 norm to `max_norm` (<= 0: off); (norm, scale).

        Sharded gradients: the norm is sqrt of the all-reduced sum of every shard's
        squared entries (float64), and each shard is scaled in place."""
        if not self.sharded:
            return clip_gradients(params, max_norm)
        grads = [p.grad for p in params if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=next(self.model.parameters()).device)
        for g in grads:
            sq += _local(g).detach().double().pow(2).sum()
        dist.all_reduce(sq)
        norm = math.sqrt(float(sq))
        scale = 1.0
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for g in grads:
                _local(g).mul_(scale)
        return norm, scale

    # -- replica drift (DDP) ---------------------------------------------------------
    def check_replicas(self, tensors: Mapping[str, torch.Tensor], what: str) -> None:
        """DDP: raise ReplicaDriftError naming the first tensor of `tensors` whose bytes
        (SHA-256) differ between ranks. Other modes: nothing (no replicas)."""
        if self.mode != "ddp" or not self.info.enabled:
            return
        mine = {name: tensor_digest(t) for name, t in tensors.items()}
        ranks = all_gather_objects(mine, self.info)
        for name in tensors:
            digests = [r.get(name) for r in ranks]
            if len(set(digests)) > 1:
                odd = [r for r, d in enumerate(digests) if d != digests[0]]
                raise ReplicaDriftError(
                    f"replica drift: {what} {name!r} differs on rank(s) {odd} from rank 0; "
                    "stopping before anything is committed"
                )


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (dtype and shape included)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    return hashlib.sha256(head + data).hexdigest()
