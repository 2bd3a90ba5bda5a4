"""Action spaces as distributions (docs/numerics.md §1).

Categorical processing, in order: temperature tau divides the logits; top-k keeps the k
largest (0 = off) and, like transformers' TopKLogitsWarper, keeps *every* entry tied with
the k-th largest (so a tie can keep more than k); top-p, on the renormalised top-k result,
keeps the smallest prefix of the descending-sorted distribution whose mass is >= p, again
with every entry tied with the last kept one (1.0 = off). The top-1 is always kept.
Removed entries get -inf and the kept ones are renormalised. `log_prob`, `entropy`, `kl`
and `jsd` are all computed on this processed distribution, the one actually sampled.

Masked (-inf) entries follow 0·log 0 = 0, with gradients that stay finite. KL(p || q) is
+inf where q has zero mass and p does not (the divergence is infinite there).

Sampling is Gumbel-max: argmax(log p + g) with g = -log(-log U), U ~ Uniform(0, 1), which
draws exactly from p. Given a sequence of generators (one per leading row), row i's
uniforms come from generator i only, so its draw does not depend on the other rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from uniweave.core.dtypes import at_least_fp32

Generators = torch.Generator | Sequence[torch.Generator] | None
LogprobMode = Literal["guided", "conditional"]


def _as_float(logits: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor")
    if logits.dim() == 0:
        raise ValueError(f"{name} needs a last (vocabulary / factor) dimension")
    return at_least_fp32(logits)


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number, got {temperature!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use mode() for greedy), got {temperature}")


def guide(cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float) -> torch.Tensor:
    """Classifier-free guidance z = u + w (c - u); `uncond` None requires w == 1."""
    if uncond is None:
        if guidance != 1.0:
            raise ValueError(f"guidance {guidance} != 1 needs uncond_logits")
        return cond
    if uncond.shape != cond.shape:
        raise ValueError(
            f"uncond_logits shape {tuple(uncond.shape)} != cond_logits {tuple(cond.shape)}"
        )
    return uncond + guidance * (cond - uncond)


def process_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Normalised log-probs [..., V] of softmax(logits / tau) truncated by top-k then top-p.

    Removed entries are -inf; see the module docstring for the tie rule.
    """
    _check_temperature(temperature)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    z = _as_float(logits, "logits") / temperature
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -math.inf)
    logp = torch.log_softmax(z, dim=-1)
    if top_p < 1.0:
        sorted_logp = torch.sort(logp, dim=-1, descending=True).values
        sorted_p = sorted_logp.exp()
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        n_keep = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min(1)
        threshold = sorted_logp.gather(-1, n_keep - 1)
        logp = torch.log_softmax(logp.masked_fill(logp < threshold, -math.inf), dim=-1)
    return logp


def entropy_from_logp(logp: torch.Tensor) -> torch.Tensor:
    """H(p) = -sum p log p over the last dim, with 0 log 0 = 0."""
    safe = logp.masked_fill(torch.isneginf(logp), 0.0)
    return -(logp.exp() * safe).sum(-1)


def kl_from_logp(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum p (log p - log q) over the last dim; terms with p = 0 are 0,
    terms with p > 0 and q = 0 make it +inf."""
    dead = torch.isneginf(logp)
    diff = logp.masked_fill(dead, 0.0) - logq.masked_fill(dead, 0.0)
    return (logp.exp() * diff).sum(-1)


def _log_mixture(logp: torch.Tensor, logq: torch.Tensor, beta: float) -> torch.Tensor:
    """log((1 - beta) p + beta q), computed in log space without NaN values or gradients."""
    a = logp + math.log(1.0 - beta)
    b = logq + math.log(beta)
    top = torch.maximum(a, b)
    dead = torch.isneginf(top)
    top = top.masked_fill(dead, 0.0)
    total = ((a - top).exp() + (b - top).exp()).masked_fill(dead, 1.0)
    return (top + total.log()).masked_fill(dead, -math.inf)


def jsd_from_logp(logp_s: torch.Tensor, logp_t: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised JSD (TRL GKD) of student p_S and teacher p_T over the last dim.

    m = (1 - beta) p_S + beta p_T; JSD = beta KL(p_T || m) + (1 - beta) KL(p_S || m).
    As in TRL, the endpoints are the plain KLs: beta = 0 gives KL(p_T || p_S) (forward),
    beta = 1 gives KL(p_S || p_T) (reverse). beta = 0.5 is the symmetric JSD.
    """
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if beta == 0.0:
        return kl_from_logp(logp_t, logp_s)
    if beta == 1.0:
        return kl_from_logp(logp_s, logp_t)
    logm = _log_mixture(logp_s, logp_t, beta)
    return beta * kl_from_logp(logp_t, logm) + (1.0 - beta) * kl_from_logp(logp_s, logm)


# -- blockwise reductions over a large last dimension ----------------------------------
# A replay chunk's categorical log-probs are [n, V] with V up to ~10^5: these compute one
# block of rows at a time, so no temporary larger than a block exists beside the inputs,
# forward or backward. `generalized_jsd` has the analytic gradient in log p (entries
# treated as independent; the chain rule through log_softmax / a top-K gather does the
# rest):  0 < β < 1: ∂D/∂log p_k = (1 − β)·p_k·log(p_k / m_k);  β = 0: −q_k;
# β = 1: p_k·(log p_k − log q_k + 1).

BLOCK_ELEMENTS = 1 << 20


def _row_blocks(x: torch.Tensor) -> list[slice]:
    rows = max(1, BLOCK_ELEMENTS // max(int(x.shape[-1]), 1))
    return [slice(s, s + rows) for s in range(0, int(x.shape[0]), rows)]


def _plogr(logp: torch.Tensor, logr: torch.Tensor) -> torch.Tensor:
    """p·(log p − log r) elementwise, 0 where p = 0."""
    dead = torch.isneginf(logp)
    return torch.where(dead, 0.0, logp.exp() * (logp - logr.masked_fill(dead, 0.0)))


def _jsd_grad_rows(logp: torch.Tensor, logq: torch.Tensor, beta: float) -> torch.Tensor:
    if beta == 0.0:
        return -logq.exp()
    if beta == 1.0:
        dead = torch.isneginf(logp)
        return torch.where(dead, 0.0, logp.exp() * (logp - logq.masked_fill(dead, 0.0) + 1.0))
    return (1.0 - beta) * _plogr(logp, _log_mixture(logp, logq, beta))


class _GeneralizedJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp: torch.Tensor, logq: torch.Tensor, beta: float) -> torch.Tensor:
        out = logp.new_empty(logp.shape[:-1])
        for b in _row_blocks(logp):
            out[b] = jsd_from_logp(logp[b], logq[b], beta)
        ctx.save_for_backward(logp, logq)
        ctx.beta = beta
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logp, logq = ctx.saved_tensors
        out = torch.empty_like(logp)
        for b in _row_blocks(logp):
            out[b] = _jsd_grad_rows(logp[b], logq[b], ctx.beta).mul_(grad[b, None])
        return out, None, None


def generalized_jsd(logp: torch.Tensor, logq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """D_β(p, q) per row [n] of student log-probs `logp` and teacher log-probs `logq`
    [n, C] (`jsd_from_logp`, computed blockwise); differentiable in `logp` only, temporaries one block of
    rows at a time. β = 0: KL(q ‖ p); β = 1: KL(p ‖ q); 0·log 0 = 0."""
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if logp.shape != logq.shape or logp.dim() != 2:
        raise ValueError(f"expected two [n, C] tensors, got {logp.shape} and {logq.shape}")
    return _GeneralizedJSD.apply(logp, logq.detach(), float(beta))


@torch.no_grad()
def blockwise_entropy(logp: torch.Tensor) -> torch.Tensor:
    """H(p) per row [n] of log-probs [n, V] (`entropy_from_logp`), one block of rows at a
    time, without gradient (a logged statistic)."""
    out = logp.new_empty(logp.shape[:-1])
    for b in _row_blocks(logp):
        out[b] = entropy_from_logp(logp[b])
    return out


def uniform_noise(shape: torch.Size, device: torch.device, generator: Generators) -> torch.Tensor:
    """Uniforms in [tiny, 1) of `shape`; a generator sequence draws row i from generator i."""
    tiny = torch.finfo(torch.float32).tiny
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = device if generator is None else generator.device
        u = torch.rand(shape, generator=generator, device=gen_device).to(device)
        return u.clamp_min_(tiny)
    gens = list(generator)
    if len(shape) < 2 or len(gens) != shape[0]:
        raise ValueError(
            f"got {len(gens)} generators for leading dimension of {tuple(shape)}; "
            "a generator sequence needs one generator per leading row"
        )
    rows = [torch.rand(shape[1:], generator=g, device=g.device).to(device) for g in gens]
    return torch.stack(rows).clamp_min_(tiny)


class TextCategorical:
    """Softmax over a vocabulary with temperature, top-k and top-p (module docstring)."""

    n_factors = 1

    def __init__(
        self,
        logits: torch.Tensor,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.log_probs = process_logits(logits, temperature, top_k, top_p)

    @property
    def sampling_log_probs(self) -> torch.Tensor:
        """Log-probs [..., V] of the distribution `sample` draws from."""
        return self.log_probs

    @property
    def probs(self) -> torch.Tensor:
        """Probabilities [..., V] of the scoring distribution (0 where masked)."""
        return self.log_probs.exp()

    @property
    def batch_shape(self) -> torch.Size:
        return self.log_probs.shape[:-1]

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        """log p(action) [...] for long `actions` of the batch shape."""
        if actions.dtype != torch.long or actions.shape != self.batch_shape:
            raise ValueError(
                f"actions must be long {tuple(self.batch_shape)}, got {actions.dtype} "
                f"{tuple(actions.shape)}"
            )
        return self.log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    def sample(self, generator: Generators = None) -> torch.Tensor:
        """Draw long [...] by Gumbel-max from the sampling distribution."""
        logp = self.sampling_log_probs
        u = uniform_noise(logp.shape, logp.device, generator).to(logp.dtype)
        return torch.argmax(logp - torch.log(-torch.log(u)), dim=-1)

    def mode(self) -> torch.Tensor:
        """argmax of the sampling distribution, long [...]."""
        return torch.argmax(self.sampling_log_probs, dim=-1)

    def entropy(self) -> torch.Tensor:
        """H(p) [...] of the scoring distribution."""
        return entropy_from_logp(self.log_probs)

    def _other_logp(self, other: TextCategorical) -> torch.Tensor:
        if not isinstance(other, TextCategorical):
            raise TypeError(f"expected a categorical distribution, got {type(other).__name__}")
        if other.log_probs.shape != self.log_probs.shape:
            raise ValueError(
                f"shape mismatch: {tuple(self.log_probs.shape)} vs {tuple(other.log_probs.shape)}"
            )
        return other.log_probs

    def kl(self, other: TextCategorical) -> torch.Tensor:
        """KL(self || other) [...] (+inf where other has no mass where self has)."""
        return kl_from_logp(self.log_probs, self._other_logp(other))

    def jsd(self, other: TextCategorical, beta: float = 0.5) -> torch.Tensor:
        """Generalised JSD [...] with self = student, other = teacher (`jsd_from_logp`)."""
        return jsd_from_logp(self.log_probs, self._other_logp(other), beta)


class VisualCategorical(TextCategorical):
    """Softmax over a VQ codebook with classifier-free guidance z = u + w (c - u).

    Sampling always uses processed(z). `log_prob`/`entropy`/`kl`/`jsd` score processed(z)
    for logprob_mode "guided" (on-policy) or processed(c) for "conditional" (T2I-R1 /
    AR-GRPO; off-policy whenever w != 1), with the same temperature, top-k and top-p.
    """

    def __init__(
        self,
        cond_logits: torch.Tensor,
        uncond_logits: torch.Tensor | None = None,
        guidance: float = 1.0,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        logprob_mode: LogprobMode = "guided",
    ) -> None:
        if logprob_mode not in ("guided", "conditional"):
            raise ValueError(
                f"logprob_mode must be 'guided' or 'conditional', got {logprob_mode!r}"
            )
        self.guidance, self.logprob_mode = guidance, logprob_mode
        guided = guide(_as_float(cond_logits, "cond_logits"), uncond_logits, guidance)
        super().__init__(guided, temperature, top_k, top_p)
        self._sampling = self.log_probs
        if logprob_mode == "conditional" and uncond_logits is not None:
            self.log_probs = process_logits(cond_logits, temperature, top_k, top_p)

    @property
    def sampling_log_probs(self) -> torch.Tensor:
        """Log-probs [..., V] of the guided distribution (what `sample` draws from)."""
        return self._sampling


def bit_pairs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-factor two-outcome log-probs [..., L, 2] of Bernoulli bit logits [..., L]:
    (log P(1), log P(0)) = (log σ(z/τ), log σ(−z/τ)) (the one construction: `VisualBits`,
    OPD's distillation, SFT's necessity distillation)."""
    z = logits if temperature == 1.0 else logits / temperature
    return torch.stack([F.logsigmoid(z), F.logsigmoid(-z)], dim=-1)


def bernoulli_jsd(pairs_s: torch.Tensor, pairs_t: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """D_β per position [n]: the mean over the L factors of the per-factor generalised
    JSD (`generalized_jsd`: blockwise, differentiable in the student's side only) of pair
    log-probs [n, L, 2] (`bit_pairs`) of student and teacher. A visual position weighs
    like one token. `VisualBits.jsd` is the same divergence computed densely."""
    n, L = pairs_s.shape[0], pairs_s.shape[1]
    d = generalized_jsd(pairs_s.reshape(n * L, 2), pairs_t.reshape(n * L, 2), beta)
    return d.view(n, L).mean(-1)


class VisualBits:
    """L independent Bernoulli factors per position (BSQ), logits [..., L].

    Bit logits z = u + w (c - u) (guidance, optional) then z / tau; log p(b) =
    b log sigmoid(z) + (1 - b) log sigmoid(-z). Position-level `log_prob`, `entropy` and
    `kl` sum over factors (the product distribution); `jsd` is the MEAN over factors of
    the per-factor Bernoulli JSD. logprob_mode "conditional" scores c / tau instead of the
    guided logits (sampling always uses the guided ones).
    """

    def __init__(
        self,
        logits: torch.Tensor,
        temperature: float = 1.0,
        uncond_logits: torch.Tensor | None = None,
        guidance: float = 1.0,
        logprob_mode: LogprobMode = "guided",
    ) -> None:
        _check_temperature(temperature)
        if logprob_mode not in ("guided", "conditional"):
            raise ValueError(
                f"logprob_mode must be 'guided' or 'conditional', got {logprob_mode!r}"
            )
        self.temperature, self.guidance, self.logprob_mode = temperature, guidance, logprob_mode
        cond = _as_float(logits, "logits")
        self.sampling_logits = guide(cond, uncond_logits, guidance) / temperature
        if logprob_mode == "conditional":
            self.logits = cond / temperature
        else:
            self.logits = self.sampling_logits

    @property
    def n_factors(self) -> int:
        """L, the number of Bernoulli factors per position."""
        return int(self.logits.shape[-1])

    @property
    def batch_shape(self) -> torch.Size:
        return self.logits.shape[:-1]

    @property
    def probs(self) -> torch.Tensor:
        """P(bit = 1) [..., L] of the scoring distribution."""
        return torch.sigmoid(self.logits)

    def _pair_logp(self) -> torch.Tensor:
        """Per-factor two-outcome log-probs [..., L, 2]: (log P(1), log P(0))."""
        return bit_pairs(self.logits)

    def log_prob_factors(self, bits: torch.Tensor) -> torch.Tensor:
        """log p(b_f) [..., L] for float `bits` in {0, 1} of shape [..., L]."""
        if bits.shape != self.logits.shape:
            raise ValueError(f"bits shape {tuple(bits.shape)} != logits {tuple(self.logits.shape)}")
        if not ((bits == 0) | (bits == 1)).all():
            raise ValueError("bits must have values in {0, 1}")
        return torch.where(bits > 0.5, F.logsigmoid(self.logits), F.logsigmoid(-self.logits))

    def log_prob(self, bits: torch.Tensor) -> torch.Tensor:
        """log p(bits) [...] = sum over the L factors."""
        return self.log_prob_factors(bits).sum(-1)

    def sample(self, generator: Generators = None) -> torch.Tensor:
        """Draw float {0, 1} [..., L]: bit = U < sigmoid(z) from the guided logits."""
        z = self.sampling_logits
        u = uniform_noise(z.shape, z.device, generator).to(z.dtype)
        return (u < torch.sigmoid(z)).to(z.dtype)

    def mode(self) -> torch.Tensor:
        """Most likely bits under the guided logits (z > 0; z = 0 gives 0)."""
        return (self.sampling_logits > 0).to(self.sampling_logits.dtype)

    def entropy_factors(self) -> torch.Tensor:
        """Per-factor Bernoulli entropy [..., L]."""
        return entropy_from_logp(self._pair_logp())

    def entropy(self) -> torch.Tensor:
        """Entropy of the product distribution [...] (sum over factors)."""
        return self.entropy_factors().sum(-1)

    def _other_pair(self, other: VisualBits) -> torch.Tensor:
        if not isinstance(other, VisualBits):
            raise TypeError(f"expected VisualBits, got {type(other).__name__}")
        if other.logits.shape != self.logits.shape:
            raise ValueError(
                f"shape mismatch: {tuple(self.logits.shape)} vs {tuple(other.logits.shape)}"
            )
        return other._pair_logp()

    def kl_factors(self, other: VisualBits) -> torch.Tensor:
        """Per-factor KL(self || other) [..., L]."""
        return kl_from_logp(self._pair_logp(), self._other_pair(other))

    def kl(self, other: VisualBits) -> torch.Tensor:
        """KL of the product distributions [...] (sum over factors)."""
        return self.kl_factors(other).sum(-1)

    def jsd_factors(self, other: VisualBits, beta: float = 0.5) -> torch.Tensor:
        """Per-factor generalised Bernoulli JSD [..., L] (self = student, other = teacher)."""
        return jsd_from_logp(self._pair_logp(), self._other_pair(other), beta)

    def jsd(self, other: VisualBits, beta: float = 0.5) -> torch.Tensor:
        """MEAN over factors of the per-factor JSD [...]."""
        return self.jsd_factors(other, beta).mean(-1)
