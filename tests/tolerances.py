"""Numeric tolerances of the tests, derived from what a comparison compares (not collected:
no test_ prefix). A bound is a formula in the unit roundoff of the dtype, the magnitude of
the compared values and the reduction lengths on the way to them; never a number tuned until
a test passes. tests/test_tolerances.py greps the tests for bare absolute bounds.

The rounding model behind every fp32/bf16 bound here
----------------------------------------------------
* u, the unit roundoff: 2^-24 (float32), 2^-8 (bfloat16), 2^-53 (float64).
* A reduction of n terms (a dot product in a GEMM, a softmax denominator, a norm)
  rounds n times. Under the probabilistic model of Higham & Mary ("A new approach to
  probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019) each rounding is an
  independent mean-zero relative error of at most u; uniform on [-u, u] it has standard
  deviation u / sqrt(3). The error of the result is then at most sqrt(n / 3) * u * S in
  standard deviation, S the scale of the terms (for an unconditioned sum, of the result).
* A value computed through reductions of lengths n_1, n_2, ... in series (a transformer:
  per layer RMSNorm, the q/k/v projections, q.k, softmax @ V, the output projection,
  RMSNorm, gate/up, down; then the final norm and the head) collects one such error per
  stage. Each stage's relative error passes to the output at the same relative size (the
  stages are O(1)-gain maps of the residual stream), so the variances add:
  sd = sqrt(sum(n_i) / 3) * u * S.
* Two paths that reduce in different orders err independently: KV-cached decoding vs the
  full forward (another key-length blocking), a batch of B rows vs one row (another GEMM
  blocking), AVX2 vs AVX-512 kernels (other vector widths, so other partial sums). The
  difference of the two has sqrt(2) times one path's sd.
* A log-prob z_a - logsumexp(z) carries the absolute error of the logits, which is relative
  to their scale: a log-prob of -15 (a logit gap of 15) carries 15x the absolute error of
  one near -1. So S = max(1, |log-prob|); 1 is the floor set by logsumexp's own terms.
* The bound is K_SIGMA = 6 standard deviations: a Gaussian two-sided tail of 2e-9 per
  compared value; the suite compares well under 1e6 model outputs, so a false failure
  has probability < 2e-3 per full run on any instruction set.

Hence, for two fp32 paths over reductions of total length N = sum(n_i) in series:

    bound = 6 * sqrt(2 * N / 3) * u * max(1, |magnitude|)

Where two paths run the same kernels on the same shapes, the comparison is exact
(torch.equal), not a bound.
"""

from __future__ import annotations

import math
import os
import sys

import torch

U_FP32 = 2.0**-24
"""Unit roundoff of float32 (round to nearest: half the spacing at 1)."""
U_BF16 = 2.0**-8
"""Unit roundoff of bfloat16 (8 significand bits)."""
U_FP64 = 2.0**-53
"""Unit roundoff of float64."""

K_SIGMA = 6.0
"""Standard deviations in a bound: two-sided Gaussian tail 2e-9 per value (module doc)."""

PATHS = 2
"""Two independently rounded paths in a comparison: their difference has sqrt(2) x one sd."""


def _unit(dtype: torch.dtype) -> float:
    return {torch.float32: U_FP32, torch.bfloat16: U_BF16, torch.float64: U_FP64}[dtype]


def decoder_reductions(
    hidden: int,
    intermediate: int,
    layers: int,
    keys: int,
    head_dim: int,
    head: int | None = None,
    mixer_kernel: int = 0,
) -> int:
    """Total reduction length N from the embeddings to a head's output through a pre-norm
    decoder: per layer RMSNorm (hidden), q/k/v projections (hidden), q.k (head_dim), the
    softmax denominator and softmax @ V (2 * keys), the output projection (hidden), RMSNorm
    (hidden), gate/up (hidden), down (intermediate); then the head: `head` (default
    2 * hidden: the final norm and a linear head; `bit_decoder_reductions` for UniAR's
    BSQ decoder); plus, with the tiny model's causal mixers (src/uniweave/models/tiny/mixer.py),
    two depthwise convolutions of `mixer_kernel` taps per layer."""
    per_layer = 5 * hidden + head_dim + 2 * keys + intermediate + 2 * mixer_kernel
    return layers * per_layer + (2 * hidden if head is None else head)


def bit_decoder_reductions(hidden: int, width: int, blocks: int) -> int:
    """UniAR's visual decoder (src/uniweave/models/uniar/heads.py): RMSNorm and W_in over
    `hidden`, per block RMSNorm and up over `width` and down over 2 * width, then RMSNorm
    and W_out over `width`."""
    return 2 * hidden + blocks * 4 * width + 2 * width


def guidance_gain(guidance: float) -> float:
    """Error gain of classifier-free guidance on a recorded guided log-prob: guided logits
    z_u + w (z_c - z_u) = w z_c - (w - 1) z_u from two forwards with independent errors of
    one scale have sqrt(w^2 + (w - 1)^2) x the sd of one (1 at w = 1: no guidance)."""
    w = float(guidance)
    return math.sqrt(w**2 + (w - 1.0) ** 2)


def reduction_bound(magnitude: float, reductions: int, dtype: torch.dtype = torch.float32) -> float:
    """Absolute bound on |a - b| for two paths computing the same value of scale
    `magnitude` through reductions of total length `reductions` (N) in `dtype`, in
    different summation orders: K_SIGMA * sqrt(PATHS * N / 3) * u * max(1, |magnitude|)
    (module doc: per-rounding sd u/sqrt(3), variances add over N roundings and 2 paths,
    a scale below 1 is floored at 1 for the softmax/normalisation terms)."""
    sd = math.sqrt(PATHS * reductions / 3.0) * _unit(dtype) * max(1.0, abs(float(magnitude)))
    return K_SIGMA * sd


def logprob_bound(
    reference: torch.Tensor | float, reductions: int, dtype: torch.dtype = torch.float32
) -> float:
    """`reduction_bound` at the largest |log-prob| of `reference` (a tensor of log-probs or
    logits, or a float): a log-prob's absolute error scales with its magnitude (module
    doc). `reductions`: `decoder_reductions(...)` of the model that produced it."""
    if isinstance(reference, torch.Tensor):
        finite = reference.detach()[torch.isfinite(reference.detach())]
        mag = float(finite.abs().max()) if finite.numel() else 1.0
    else:
        mag = abs(float(reference))
    return reduction_bound(mag, reductions, dtype)


def factor_sum_bound(per_factor: float, factors: int, total: float) -> float:
    """Bound on a sum of `factors` log-probs of magnitude `total` (a BSQ position's 1,024
    bit log-probs, ~ -700), each within `per_factor` of its reference: the factors' errors
    come from one hidden state through different rows of the head's output projection,
    each with its own rounding, so they add as independent errors: sqrt(factors) x
    `per_factor`; plus the two paths' fp32 sums of the factors, which ATen reduces
    pairwise (cascade sum: ceil(log2(factors)) roundings in series, each relative to the
    partial sum, at most |total|): `reduction_bound(total, ceil(log2(factors)))`."""
    depth = max(1, math.ceil(math.log2(factors)))
    return math.sqrt(factors) * per_factor + reduction_bound(total, depth)


def elementwise_bound(magnitude, ops: int, paths: int = 2, dtype: torch.dtype = torch.float32):
    """Worst case of a chain of `ops` elementwise roundings (rescale, subtract a mean,
    divide by a std) per path, each at most u relative to a value of scale `magnitude`:
    paths * ops * u * max(1, |magnitude|) (paths=1 against an exact float64 reference).
    Short chains are cheap to bound deterministically (Higham, gamma_n). A tensor
    `magnitude` gives the bound per element (each at its own scale, floored at 1)."""
    if isinstance(magnitude, torch.Tensor):
        return paths * ops * _unit(dtype) * magnitude.detach().abs().double().clamp(min=1.0)
    return paths * ops * _unit(dtype) * max(1.0, abs(float(magnitude)))


def fp32_storage_bound(values: torch.Tensor) -> torch.Tensor:
    """Per-element bound on two float64 computations of `values` that agree to float64
    noise (~1e-15 relative) after each is stored in float32: both round to the same or to
    adjacent float32 values, one ulp apart at most: 2 * u_fp32 * |values|."""
    return 2.0 * U_FP32 * values.detach().abs().double()


def sum_bound(magnitude: float, n: int, dtype: torch.dtype = torch.float32) -> float:
    """One path's reduction of n terms of scale `magnitude` against an exact (float64)
    reference: K_SIGMA * sqrt(n / 3) * u * max(1, |magnitude|) (a single path: no factor
    2 in the variance)."""
    return K_SIGMA * math.sqrt(n / 3.0) * _unit(dtype) * max(1.0, abs(float(magnitude)))


def fp64_bound(magnitude: float, n: int) -> float:
    """A float64 formula against a float64 reference of `n` roundings in series (n counts
    elementwise ops and reduction lengths): the deterministic worst case n * u * S (Higham,
    gamma_n), S = max(1, |magnitude|). float64 checks are cheap to make worst-case."""
    return n * U_FP64 * max(1.0, abs(float(magnitude)))


def tiny_decoder_reductions(config, keys: int, head: int | None = None) -> int:
    """`decoder_reductions` of a tiny model's `TinyArchitecture` (hidden_size,
    intermediate_size, num_layers, num_heads, mixer_kernel) over `keys` keys."""
    return decoder_reductions(
        config.hidden_size,
        config.intermediate_size,
        config.num_layers,
        keys,
        config.hidden_size // config.num_heads,
        head=head,
        mixer_kernel=config.mixer_kernel,
    )


def gradient_reductions(forward: int, tokens: int) -> int:
    """Reduction length N behind a parameter gradient of an objective over `tokens` scored
    positions (rows x positions of the batch): the forward's N (`decoder_reductions`); the
    backward's, the same GEMMs transposed (each layer's reductions swap input and output
    widths, whose totals are the forward's), so N again; and dW = sum over the tokens of
    each token's outer product, one reduction of length `tokens`. Two paths to one
    gradient (micro-batching, packing, prefix sharing) differ in all three:
    2 * forward + tokens."""
    return 2 * forward + tokens


def rmsnorm_fp32_reductions(hidden: int, layers: int) -> int:
    """The float32 reductions inside a float64 model (`.double()`, `trainer.precision:
    fp64`): transformers' LlamaRMSNorm casts its input to float32 whatever the model's
    dtype and reduces its square over `hidden` there; a decoder has 2 norms per layer and
    the final one, run in the forward and again in the backward:
    2 * (2 * layers + 1) * hidden."""
    return 2 * (2 * layers + 1) * hidden


def mixed_fp64_bound(magnitude: float, fp64_reductions: int, fp32_reductions: int) -> float:
    """Two paths through a float64 model whose norms compute in float32
    (`rmsnorm_fp32_reductions`): the float32 stages err as two float32 paths over their
    reductions, the rest as two float64 paths; the variances of independent stages add,
    and the sum of the two 6-sd bounds is an upper bound on the 6-sd bound of the sum:
    reduction_bound(S, n32, float32) + reduction_bound(S, n64, float64). Conservative:
    both paths round the same float32 inputs alike, so only inputs that differ in float64
    (another summation order) can round to adjacent float32 values."""
    return reduction_bound(magnitude, fp32_reductions) + reduction_bound(
        magnitude, fp64_reductions, torch.float64
    )


def fp64_forward_bound(magnitude: float, reductions: int) -> float:
    """Two float64 forwards of a float64 model (another batch geometry, packing, a shared
    prefix) to the same values: `reduction_bound(S, N, float64)`. The model's float32
    norms (`rmsnorm_fp32_reductions`) add nothing in the forward unless the two paths'
    inputs, which agree to ~sqrt(N) * 2^-53 relative, straddle a float32 rounding
    boundary: probability ~ sqrt(N) * 2^-53 / 2^-24 = sqrt(N) * 2^-29 ~ 1e-7 per normed
    value (N ~ 1,000), ~3e-3 over the ~3e4 of a tiny-model batch (the order of the 6-sd
    budget, 2e-3 per run): a flip, a ~1e-7 relative error, is rare enough to be a
    finding. Gradients are bounded with `mixed_fp64_bound`: their backward computes in
    float32 on inputs summed in another order (measured ~1e-7 relative, not 1e-15); so is
    a BSQ model's loss, whose bits' path keeps float32 internals in the forward too
    (tests/test_necessity.py: 3e-9 where this bound gives 1.5e-13)."""
    return reduction_bound(magnitude, reductions, torch.float64)


def magnitude(t) -> float:
    """The scale S of a compared tensor (or float): its largest finite |value|, at least 1
    (the floor of `reduction_bound`)."""
    if isinstance(t, torch.Tensor):
        finite = t.detach()[torch.isfinite(t.detach())]
        return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return max(1.0, abs(float(t)))


def assert_within(err, bound, what: str = "") -> None:
    """assert err <= bound (floats or tensors, elementwise); with UNIWEAVE_TOL_REPORT=1 also
    print the largest err / bound to stderr (how the figures in issue 45 were measured)."""
    e = torch.as_tensor(err, dtype=torch.float64)
    b = torch.as_tensor(bound, dtype=torch.float64)
    ratio = float((e / b.clamp(min=1e-300)).max()) if e.numel() else 0.0
    if os.environ.get("UNIWEAVE_TOL_REPORT"):
        print(f"TOL {what} max_err={float(e.max()):.3g} ratio={ratio:.3f}", file=sys.stderr)
    assert bool((e <= b).all()), f"{what}: err {float(e.max()):.3g}, max err/bound {ratio:.3f}"
