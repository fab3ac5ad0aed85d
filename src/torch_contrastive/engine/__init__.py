"""The tiled autograd engine: contrastive statistics in O(N * tile) extra memory.

Every loss of the package reduces to per-anchor statistics of the logit matrix
``S = scale * A @ B.T`` (R anchors, C candidates), which this package computes block
by block without ever holding S (README, "Tiled engine").

A loss describes each call as an immutable :class:`~.problem.Problem` (the rows, the scale, the
relation of positives, the statistic, the shared :class:`~.problem.Options`);
:func:`~.problem_plan.plan` turns it and its device into one frozen typed plan (:mod:`.plans`, holding
the device :class:`~.planner.Decision`) without running anything, and :func:`~.solve.solve` plans
it and runs the executor registered for its statistic and the plan's backend. The statistics, with
their keyword forms:

:class:`~.problem.Softmax` -- :func:`softmax_terms` (:mod:`.softmax`)
    ``alpha_i * log sum_{j != self(i)} exp(S_ij) - beta_i * sum_j P_ij S_ij`` per row,
    and the same per column (the second direction of the image-text loss). This serves
    NT-Xent (pairing rules), SupCon and the image-text loss: their positive part is
    linear and costs O(N * D) through
    :meth:`~torch_contrastive.positives.Positives.aggregate`, not a tile pass.
    A row's single positive is kept apart from the sums where its place is known
    (:mod:`.confident`), so a loss near 0 keeps its digits.
:class:`~.problem.SigmoidPairs` -- :func:`sigmoid_rows` (:mod:`.sigmoid`)
    SigLIP's per-pair binary cross-entropy ``softplus(-z_ij S_ij)`` with a logit bias;
    positives fixed in place (a strided diagonal, or a mask with ids).
:class:`~.problem.PairTerms` -- :func:`pairwise_rows` (:mod:`.pairwise`)
    Statistics that need the positive mask inside the tile: the per-positive-pair
    NT-Xent of pytorch-metric-learning and NT-BXent's element-wise binary cross-entropy.

Both are ``torch.autograd.Function`` s that can also L2-normalise their inputs inside,
so a loss call adds only a few autograd nodes. Forward keeps only O(R + C) statistics;
backward recomputes each logit tile, forms the gradient tile G and accumulates
``dA += scale * G @ B``, ``dB += scale * G.T @ A`` and ``dscale += sum(G * A @ B.T)``.
Inputs in fp16/bf16 are computed and accumulated in fp32; gradients are returned in the
input dtype. ``scale`` is a float or a 0-dim tensor that multiplies the anchors once
(O(R * D)); its value is never read on the host, and nothing else is either, so the
engine makes no host synchronisation and traces under ``torch.compile(fullgraph=True)``.

Two log-sum-exp algorithms, chosen by the caller from a host-side bound on ``scale``:

* **fixed** -- when the inputs are L2-normalised every logit lies in ``[-scale, scale]``,
  so for ``scale <= 40`` in fp32 (tau >= 0.025) ``exp(S)`` itself can neither overflow
  nor underflow and no running maximum (not even a fixed shift) is needed. Then one
  ``exp`` per element serves the row and the column soft-max, and in backward the
  gradient tile is that same ``exp`` scaled by ``u_i + v_j`` with
  ``u_i = g_i exp(-LSE_i)``.
* **online maximum** -- exact for any logit range (raw dot products, tau < 0.025, or a
  scale whose value is not known on the host).

``backend="triton"`` runs the log-sum-exp passes of :func:`softmax_terms` as Triton kernels
(:mod:`.triton_backend`: one program per row block, a GEMM loop over D, the gradient tile
formed once in registers; CUDA, or ``TRITON_INTERPRET=1`` on CPU for the tests).

Single-set losses (``symmetric=True``) visit only the upper-triangle tiles: ``S`` is
symmetric, so one tile feeds the statistics of both its row block and its column
block, and ``H = G + G.T`` feeds both ``dZ_I`` and ``dZ_J``. A problem that fits in one
tile (the common small batch) skips the tile bookkeeping altogether.
"""

from .keywords import pairwise_rows, sigmoid_rows, softmax_terms
from .pairwise import tile_label_bounds
from .planner import Decision, decide, resolve_tile
from .precision import Scale, compute_dtype, fixed_scale_applies
from .problem import LabelRanges, Options, PairTerms, Problem, SigmoidPairs, Softmax
from .problem_plan import label_sort_tile, plan
from .recorded import explain
from .solve import solve
from .tiling import DEFAULT_TILE, DENSE_BUDGET_BYTES

__all__ = [
    "DEFAULT_TILE",
    "DENSE_BUDGET_BYTES",
    "Decision",
    "LabelRanges",
    "Options",
    "PairTerms",
    "Problem",
    "Scale",
    "SigmoidPairs",
    "Softmax",
    "compute_dtype",
    "decide",
    "explain",
    "fixed_scale_applies",
    "label_sort_tile",
    "pairwise_rows",
    "plan",
    "resolve_tile",
    "sigmoid_rows",
    "softmax_terms",
    "solve",
    "tile_label_bounds",
]
