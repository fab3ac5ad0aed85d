"""The engine's keyword forms: each builds the :class:`~.problem.Problem` its arguments describe and
:func:`~.solve.solve` s it -- the statistics' calls as functions of tensors and flags, for callers that do not
build a problem themselves (the tests, the prefix engine, a user's own loss)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from .precision import Scale
from .problem import Combine, LabelRanges, Options, PairTerms, Prefixes, Problem, SigmoidPairs, Softmax
from .solve import solve

if TYPE_CHECKING:
    from ..positives import Positives

__all__ = ["pairwise_rows", "prefix_pass", "sigmoid_rows", "softmax_terms"]


def softmax_terms(
    anchors: Tensor,
    candidates: Tensor,
    scale: Scale,
    *,
    self_offset: int | None,
    positives: Positives | None = None,
    row_weights: tuple[Tensor | None, Tensor | None] = (None, None),
    col_weights: tuple[Tensor | None, Tensor | None] = (None, None),
    symmetric: bool = False,
    columns: bool = False,
    column_positives: bool = True,
    fixed: bool = False,
    bound: float | None = None,
    normalize: bool = False,
    eps: float = 1e-12,
    chunk_size: int | None = None,
    column_comm: Any = None,
    grad_columns: int | None = None,
    exclude: Any = None,
    backend: str = "auto",
    total: tuple[Scale, Scale] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-row (and per-column) soft-max terms of ``S = scale * anchors @ candidates.T``.

    ``row_out_i = alpha_i * LSE_i - beta_i * sum_j P_ij S_ij`` with
    ``LSE_i = log sum_{j != self(i)} exp(S_ij)``, and with ``columns=True`` also
    ``col_out_j = alpha'_j * LSE'_j - beta'_j * sum_i P_ij S_ij`` with
    ``LSE'_j = log sum_i exp(S_ij)``.

    Args:
        anchors: (R, D) tensor, any float dtype.
        candidates: (C, D) tensor; pass ``anchors`` itself for a single set.
        scale: ``1 / temperature``: a float, or a 0-dim tensor (gradients flow to it;
            its value is never read on the host).
        self_offset: anchor ``i`` is candidate ``i + self_offset``; that entry is
            left out of row ``i``. ``None``: nothing is left out.
        positives: the relation P (R x C); ``None``: no positive part (plain LSE).
        row_weights, col_weights: ``(alpha, beta)`` (R,) / (C,) tensors without
            gradient; ``None`` means 1.
        symmetric: ``candidates`` are the anchors themselves (single-set losses on one
            process, ``self_offset=0``): only the upper-triangle tiles are visited.
        columns: also return the column terms (requires ``self_offset=None``).
        column_positives: include ``sum_i P_ij S_ij`` in the column terms (the caller
            computes it itself in distributed training, where this rank holds only
            some rows).
        fixed: force plain ``exp(S)`` without a shift; only exact when every row has
            norm <= 1 and the scale is small (see :func:`fixed_scale_applies`).
        bound: the caller's promise that every ``|S| <= bound`` (unit rows, a host-known
            scale); the planner then picks the one-``exp`` algorithm where it is exact.
        normalize: L2-normalise anchors and candidates inside (``x / max(||x||, eps)``),
            so the whole loss is one autograd node.
        chunk_size: tile edge (see :func:`resolve_tile`).
        column_comm: for ``columns=True`` in distributed training, an object with in-place
            ``all_sum``/``all_max`` over ranks: each rank passes its own anchor rows and
            all candidates, and gets the *global* column statistic (an O(C) all-reduce
            forward, one more for the column gradient backward).
        grad_columns: only the first ``grad_columns`` candidates need a gradient (the
            rest are constants, e.g. a queue of past keys concatenated after the live
            keys): their ``G.T @ A`` products are skipped and their gradient rows are 0.
            ``None``: every candidate (when ``candidates`` requires grad at all).
        exclude: candidates left out of the log-sum-exp besides the self pair (and out of
            the column log-sum-exp): a :class:`~torch_contrastive.positives.Exclusion`.
            With ``symmetric=True`` it must be a symmetric relation. A row whose every
            candidate is left out gets ``LSE = -inf``.
        backend: ``"auto"`` (default; :func:`.planner.decide`), ``"torch"`` or ``"triton"``: the log-sum-exp passes as Triton kernels
            (CUDA tensors, or ``TRITON_INTERPRET=1`` on CPU; see :mod:`.triton_backend`): the
            same semantics -- both regimes, the single-set triangle, exclusions by ids, a
            partner relation, a guide or diagonals, distributed column statistics; positives
            go through ``Positives.aggregate``. Atomic (fused) kernels unless
            ``torch.use_deterministic_algorithms(True)`` asks for the row-owned ones.
        total: ``(c, c')``: return the scalar ``c * sum_i row_out_i + c' * sum_j col_out_j``
            instead (floats or 0-dim tensors without gradient; ``c'`` only with
            ``columns=True``) -- a loss's ``mean``/``sum`` reduction inside the autograd
            function, which saves the small batch a few autograd nodes.

    Returns:
        ``(row_out, col_out)``: (R,) and (C,) or None, fp32 for fp16/bf16 inputs
        (fp64 for fp64). A row with no candidate at all gets ``LSE = 0``. With ``total``:
        ``(scalar, None)``.

    Memory: O((R + C) * D) for the compute-dtype copies plus two tile buffers; never
    R x C (unless one tile covers everything).
    """
    problem = Problem(anchors, candidates, scale, Softmax(row_weights=row_weights, col_weights=col_weights, columns=columns,
                                                          column_positives=column_positives, column_comm=column_comm,
                                                          exclude=exclude, total=total, fixed=fixed),
                      positives=positives, self_offset=self_offset, symmetric=symmetric, bound=bound, grad_columns=grad_columns,
                      options=Options(normalize, float(eps), chunk_size, backend))
    return solve(problem)


def pairwise_rows(
    anchors: Tensor,
    candidates: Tensor,
    scale: Scale,
    positives: Positives,
    *,
    kernel: str,
    normalize: bool = False,
    eps: float = 1e-12,
    chunk_size: int | None = None,
    label_ranges: LabelRanges | None = None,
    fixed: bool = False,
    bound: float | None = None,
    combine: Combine | None = None,
    backend: str = "auto",
) -> tuple[Tensor, ...]:
    """Per-row statistics that need the positive mask in every tile.

    Args:
        anchors: (R, D); candidates: (C, D) (``anchors`` itself for a single set);
            scale: ``1 / temperature``, float or 0-dim tensor.
        positives: a :class:`~torch_contrastive.positives.Positives` for R x C.
        kernel: ``"pair_softplus"`` (returns ``(sum_p softplus(L_i - S_ip),)``, the
            pytorch-metric-learning NT-Xent numerators) or ``"binary"`` (returns
            ``(sum_pos softplus(-S_ij), sum_neg softplus(S_ij))``, NT-BXent).
        normalize, eps: L2-normalise both inputs inside the function.
        chunk_size: tile edge (see :func:`resolve_tile`).
        label_ranges: for rows and columns sorted by label (a key relation), the (lowest,
            highest) label of every block of rows and of columns (:class:`~.problem.LabelRanges`, from
            :func:`tile_label_bounds`).
            A tile whose two ranges do not overlap holds only negatives and takes the fast
            path: no mask, no per-positive work (PML NT-Xent skips it in its second pass).
        fixed: force the bounded mode (every ``|S|`` small enough for plain ``exp``): PML
            NT-Xent then needs no running maximum.
        bound: the caller's promise that every ``|S| <= bound``; the planner picks the bounded
            mode where it is exact (:func:`~torch_contrastive.engine.fixed_scale_applies`).
        combine: ``(weights, total)``: return ``(total * sum_i sum_k weights[k]_i out_k,i,)``
            instead -- a loss's per-row combination and reduction inside the autograd function.
            ``weights`` holds one (R,) tensor (or float) per output, ``total`` a float or 0-dim
            tensor; none of them gets a gradient.
        backend: ``"torch"``, ``"triton"`` (fused pair kernels, :mod:`.triton_backend.pair_terms`:
            positives by ids or a partner; ``label_ranges`` are not needed there) or ``"auto"`` --
            the torch backend until the kernels are measured faster on a GPU.

    Memory: O((R + C) * D) plus a few tile-sized temporaries.
    """
    problem = Problem(anchors, candidates, scale, PairTerms(kernel, label_ranges, combine, fixed), positives=positives,
                      self_offset=positives.self_offset, bound=bound, options=Options(normalize, float(eps), chunk_size, backend))
    return solve(problem)


def sigmoid_rows(
    anchors: Tensor,
    candidates: Tensor,
    scale: Scale,
    bias: Scale,
    positives: Positives,
    *,
    diagonal_offset: int | None = None,
    normalize: bool = False,
    eps: float = 1e-12,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """Per-row ``sum_j softplus(-z_ij S_ij)`` with ``S = scale * anchors @ candidates.T + bias``.

    Args:
        anchors: (R, D) image embeddings; candidates: (C, D) text embeddings.
        scale: the logit scale (multiplier), float or 0-dim tensor (gets its gradient).
        bias: the logit bias, float or 0-dim tensor (gets its gradient).
        positives: a :class:`~torch_contrastive.positives.Positives` (R x C, no self
            pairs) giving ``z_ij = +1``.
        diagonal_offset: when the only positive of row i is column ``i + diagonal_offset``
            (no ids), positives are handled as a strided diagonal, without a mask.
        normalize, eps: L2-normalise both inputs inside the function.
        chunk_size: tile edge (see :func:`resolve_tile`).
        backend: ``"torch"``, ``"triton"`` (fused tile kernels, :mod:`.triton_backend.sigmoid_pairs`:
            positives on the diagonal, by ids or none) or ``"auto"`` -- the torch backend until
            the kernels are measured faster on a GPU.

    Returns:
        (R,) row sums in the compute dtype (fp32 for half inputs).

    Memory: O((R + C) * D) plus two tile buffers; a single tile is kept for backward.
    """
    problem = Problem(anchors, candidates, scale, SigmoidPairs(bias, diagonal_offset), positives=positives,
                      options=Options(normalize, float(eps), chunk_size, backend))
    return solve(problem)


def prefix_pass(form: str, anchors: Tensor, candidates: Tensor, dims: list[int] | tuple[int, ...],
                weights: list[float] | tuple[float, ...], scale: float, *arguments: Any, eps: float = 1e-12,
                chunk_size: int | None = None, mean: bool = True, per_row: bool = False, upper: bool = False) -> Tensor:
    """One of the prefix engine's passes (:class:`~.problem.Prefixes`: ``form`` over the prefix ends ``dims``,
    weighted ``weights``, every prefix normalised on its own) of ``anchors`` against ``candidates`` (the anchors
    themselves for one set) at the float ``scale``; ``arguments``: the pass's own, in its function's order."""
    stat = Prefixes(form, tuple(dims), tuple(float(w) for w in weights), arguments, mean, per_row, upper)
    return solve(Problem(anchors, candidates, float(scale), stat, options=Options(True, eps, chunk_size)))
