"""Triton kernels for the log-sum-exp engine (``backend="triton"``; optional extra ``gpu``).

Two schemes, chosen per call by :func:`fused`:

* **Fused** (the default on a GPU): one program per (row block, column block) tile in
  grouped order (``GROUP`` row blocks sweep the column blocks together, so their column
  operands are reused from L2); for a single set the programs below the diagonal return
  at once. Forward (:func:`tile_sums`, bounded regime): each program
  computes its logit tile once (GEMM loop over D, fp32 accumulation), takes ``exp`` and
  adds its row sums and its column sums into O(N) accumulators with atomics -- rows and
  columns in one pass; a triangle tile's column sums are the sums of its mirror rows.
  Backward (:func:`tile_grad`, both regimes): each program recomputes its tile, forms the
  gradient tile ``G`` once in registers and, over D in blocks, adds ``G @ B`` into its
  rows and ``G.T @ A`` into its columns (atomics). 4 GEMM-equivalents for a CLIP loss,
  2 for a single set, as the torch backend.
* **Row-owned** (``torch.use_deterministic_algorithms(True)``, and the forward of the
  online-maximum regime): one program per block of rows loops over the column blocks
  (online maximum, :func:`row_lse`; ``G @ Z`` in D blocks, :func:`grad_rows`); a column
  quantity is the same kernel on ``S.T``. No atomics, so bitwise reproducible; CLIP costs
  6 GEMM-equivalents (the logits are formed once per direction in each pass). SigLIP's and
  the mask-in-tile losses' kernels have the same two schemes: their row-owned forward sweeps
  the column blocks per row block, their backward has row blocks and column blocks own
  ``G @ Y`` and ``G.T @ Z`` (each tile formed in its own orientation, so the relation is never
  read transposed) and SigLIP's bias gradient is summed from per-row parts.

Both schemes apply the self pair and the engine's exclusions (false negatives) inside the
tile: equal ids (one or two key tensors), a partner relation (DCL's positives), a strided
diagonal, and a guide model's verdict ``<g_i, g_j> > t_i`` (a second small product per
tile, in registers). Exponentials in the gradient are shifted by the final log-sum-exps,
so both of the torch backend's regimes are exact here; the bounded forward sums plain
``exp(S)`` exactly as the torch backend's fixed path does.

One kernel per file (:mod:`.row_lse`, :mod:`.tile_sums`, :mod:`.grad_rows`,
:mod:`.tile_grad`; the in-tile pieces in :mod:`._tile`), each with a keyword launcher and
``triton.autotune`` over a small config list (:mod:`._configs`): the block sizes, warps and
pipeline stages are timed on the user's GPU the first time a (size bucket, D, dtype) is seen.
Every launcher sets up the same way (:func:`._host.launch_operands`: the device check and
contiguous operands, so a row's stride is its width; grids from :mod:`._configs`). Optional
inputs are None, never stand-in tensors: the kernels test them with ``is not None``, which
Triton folds at compile time, so a plain CLIP call compiles no exclusion code and passes no
exclusion code (the exclusion is one tuple argument, ``excl``, whose absent parts are None: :func:`._host.packed`);
the constexprs that follow from the arguments (accumulation dtype, ``tl.dot`` precision, whether
anything is excluded) come from ``triton.heuristics`` (:data:`._host.DERIVED`). An accumulator
the autotuner must reset between timed runs is one tensor (rows, then columns), split in views.

Precision: fp32 operands are multiplied in IEEE fp32 (TF32 only when
``torch.backends.cuda.matmul.allow_tf32`` is set), fp64 in fp64; half-precision inputs
reach ``tl.dot`` as the caller gave them, with the scale and the normalisation applied to
the fp32 logit tile as row and column factors (``factors=`` of the launchers) and folded
into the gradient tile before it is rounded to their dtype for its two products, fp32
accumulation -- the torch backend's tensor-core scheme (:mod:`..products`). Under
``TRITON_INTERPRET=1`` (the CPU tests) half operands are widened to fp32, because the
interpreter's bf16 ``tl.dot`` is inexact. SigLIP's sigmoid pairs have their own fused
kernels (:mod:`.sigmoid_pairs`), the mask-in-tile losses (PML NT-Xent with labels,
NT-BXent with labels or listed index pairs) theirs (:mod:`.pair_terms`). Not covered (no loss
builds them): soft-max exclusions by index pairs or sample masks.
"""

from __future__ import annotations

from ._host import check_device, check_exclusion, directions, exclusion, fused, interpreting, keys, per_index, triton

__all__ = ["bias_vector", "check_device", "check_exclusion", "directions", "epilogue_grad", "epilogue_pair_grad",
           "epilogue_pair_sums", "epilogue_pml_sums", "epilogue_sigmoid_grad", "epilogue_sigmoid_sums", "epilogue_sums", "exclusion",
           "fold_partials", "fused", "gemm_sigmoid_sums", "gemm_sums", "grad_rows", "interpreting", "keys", "pair_grad", "pair_sums", "partial_rows",
           "per_index", "positive_terms", "relation_args", "row_lse", "sigmoid_grad", "sigmoid_sums", "tile_grad",
           "tile_sums"]

if triton is not None:
    from .epilogue_grad import epilogue_grad, positive_terms
    from .epilogue_pair_grad import epilogue_pair_grad
    from .epilogue_pair_sums import epilogue_pair_sums
    from .epilogue_pml_sums import epilogue_pml_sums
    from .epilogue_sigmoid_grad import epilogue_sigmoid_grad
    from .epilogue_sigmoid_sums import epilogue_sigmoid_sums
    from .epilogue_sums import epilogue_sums, partial_rows
    from .fold_partials import fold_partials
    from .gemm_sigmoid_sums import gemm_sigmoid_sums
    from .gemm_sums import gemm_sums
    from .grad_rows import grad_rows
    from .pair_terms import pair_grad, pair_sums, relation_args
    from .row_lse import row_lse
    from .sigmoid_pairs import bias_vector, sigmoid_grad, sigmoid_sums
    from .tile_grad import tile_grad
    from .tile_sums import tile_sums
