"""The one complete plan of a problem: :func:`plan`.

A loss describes its problem (:class:`~.problem.Problem`); :func:`plan` asks the planner's device decisions
(:func:`~.planner.decide`) and adds what follows from the problem itself -- which executor runs it (the lean
one-tile executors, label-sorted tiles, the triangle walk, stacked rows) and whether the kernel backends can
serve it at all (:func:`triton_refusal`, :func:`epilogue_refusal`) -- into one frozen typed plan, kept per key
so a training loop's repeated call costs one dictionary look-up.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..positives import KeyPositives, PairPositives, PartnerPositives, Positives
from .confident import apart_rule
from .planner import Decision, Target, Traits, choose_backend, decide, target, tf32
from .plans import AnyPlan, PairPlan, SigmoidPlan, SoftmaxPlan
from .precision import compute_dtype
from .problem import PairTerms, Problem, SigmoidPairs, Softmax
from .recorded import name_executor, quiet, record_plan
from .softmax_tiles import flat_places

__all__ = ["epilogue_refusal", "label_sort_tile", "one_tile", "plan", "triton_refusal"]


def plan(problem: Problem) -> AnyPlan:
    """The one complete plan of a :class:`~.problem.Problem` on its inputs' device -- the one
    planning function every engine call goes through. Nothing runs: ``plan(problem)`` says what
    :func:`~torch_contrastive.engine.solve` would do (``str(plan)`` in words) and is a frozen
    :class:`~.plans.SoftmaxPlan`, :class:`~.plans.PairPlan` or :class:`~.plans.SigmoidPlan`.

    The statistic's traits: the soft-max and pair terms take tensor-core products; the soft-max
    terms may move to the Triton kernels under ``"auto"``, the pair and sigmoid kernels stay on
    torch under ``"auto"`` until measured faster on a GPU. :func:`triton_refusal` says whether the Triton
    kernels serve the problem.

    A soft-max or pair plan is kept per key (:func:`plan_key`): a training loop asks the same question
    every step, and the answer costs one dictionary look-up instead of a decision and a plan.
    """
    stat = problem.statistic
    on = target(problem.anchors.device)
    key = plan_key(problem, on)
    if key is not None:
        found = _PLANS.get(key)
        if found is not None:
            if problem.options.backend in ("triton", "epilogue"):  # an explicit kernel backend: still its refusal
                choose_backend(problem.options.backend, lambda: triton_refusal(problem), lambda: epilogue_refusal(problem))
            relation = problem.positives
            if found.positives is relation:  # (a partner's key holds its id(): the kept plan holds it, so it is its own)
                record_plan(found)
                return found
            if found.positives is None and isinstance(relation, KeyPositives):  # the plan of its shape, kept without it
                record_plan(found)
                return found.with_relation(relation)
    decision = _decision(problem, stat, on)
    if isinstance(stat, (Softmax, PairTerms)):
        chosen = _softmax_plan(problem, stat, decision) if isinstance(stat, Softmax) else _pair_plan(problem, stat, decision)
        if key is not None:
            if len(_PLANS) > 256:  # many distinct problems: keep the cache small
                _PLANS.clear()
            # a label relation is not held (its dense mask can be large on a GPU): the plan is kept without it
            _PLANS[key] = chosen.with_relation(None) if isinstance(problem.positives, KeyPositives) else chosen
        name_executor(chosen.executor)
        return chosen
    if problem.positives is None:  # Problem refuses it when built
        raise ValueError("SigmoidPairs needs positives")
    sigmoid = SigmoidPlan(decision=decision, positives=problem.positives, diagonal_offset=stat.diagonal_offset,
                          normalize=problem.options.normalize, eps=float(problem.options.eps),
                          stack_rows=_stacks(decision, problem))
    name_executor(sigmoid.executor)
    return sigmoid


def label_sort_tile(problem: Problem) -> int:
    """The tile of the torch loops that ``problem``'s plan walks when it spans several tiles, else 0 (one tile, or the
    Triton kernels, which form every tile's mask in registers): sorted by label, its rows' blocks of this many rows
    are what the plan's skipped tiles are read from (:class:`~.problem.LabelRanges`). Not logged by
    :func:`~.recorded.explain`: the call that follows is."""
    with quiet():
        chosen = plan(problem)
    rows = problem.shape[0]
    return chosen.tile if chosen.backend == "torch" and 0 < chosen.tile < rows else 0


def _decision(problem: Problem, stat: Softmax | PairTerms | SigmoidPairs, on: Target) -> Decision:
    """:func:`decide` asked about ``problem`` planned for ``on``."""
    rows, cols = problem.shape
    anchors, opts = problem.anchors, problem.options
    kernel = "softmax" if isinstance(stat, Softmax) else "pairwise" if isinstance(stat, PairTerms) else "sigmoid"
    fixed = stat.fixed if isinstance(stat, (Softmax, PairTerms)) else False
    return decide(kernel=kernel, rows=rows, cols=cols, device=anchors.device, dtype=anchors.dtype,
                  other_dtype=problem.candidates.dtype, chunk_size=opts.chunk_size, backend=opts.backend, fixed=fixed,
                  bound=None if isinstance(stat, SigmoidPairs) else problem.bound,
                  half_ok=not isinstance(stat, SigmoidPairs), auto_triton=not isinstance(stat, SigmoidPairs),
                  traits=Traits(int(anchors.shape[-1]), isinstance(stat, Softmax) and stat.columns, problem.symmetric,
                                stat.kernel if isinstance(stat, PairTerms) else None),
                  triton_serves=lambda: triton_refusal(problem),
                  epilogue_serves=lambda: epilogue_refusal(problem), on=on)


def plan_key(problem: Problem, on: Target) -> tuple[Any, ...] | None:
    """Everything a plan is decided from, as one dictionary key: the shape, the dtypes, the device and the
    :class:`~.planner.Target` planned for (a simulated device, its budget, products and area), the TF32 switch, the
    options, the relation by :func:`_relation_key` and the statistic's own fields. None for a problem planned afresh
    every call: the sigmoid terms (a plan of a few fields), a per-call object in it (an exclusion, a distributed
    column reduction, label ranges, a relation listed pair by pair or by a sample mask) or a traced call (under
    ``torch.compile`` the plan is traced once anyway, and an ``id()`` of a traced object is not its own). An explicit
    kernel backend's plan is kept too, and its refusal asked again at every look-up (it reads more of the problem
    than the key)."""
    if torch.compiler.is_compiling():  # (no id() of a traced object)
        return None
    stat = problem.statistic
    kind = type(stat)
    if kind is Softmax:
        if stat.exclude is not None or stat.column_comm is not None:
            return None
        own: tuple[Any, ...] = (problem.grad_columns, stat.columns, stat.column_positives, stat.columns_share_alpha,
                                *(w is not None for w in (*stat.row_weights, *stat.col_weights)))
    elif kind is PairTerms:
        if stat.label_ranges is not None:
            return None
        own = (stat.kernel,)
    else:
        return None
    relation = _relation_key(problem.positives)
    if relation is None:
        return None
    a, c, opts = problem.anchors, problem.candidates, problem.options
    return (kind, a.shape[0], c.shape[0], a.shape[-1], a.device, on, a.dtype, c.dtype, tf32(), opts.chunk_size,
            opts.backend, opts.normalize, opts.eps, stat.fixed, problem.bound, relation, problem.self_offset,
            problem.symmetric, problem.single, *own)


def _relation_key(positives: Positives | None) -> Any:
    """What a plan reads of a relation, as part of a key: a partner relation (kept by its loss, one
    object per shape) by its ``id()``; a label relation (new every call) by its shape -- the plan
    reads its kind, size, self offset and dense form, never its labels; the plan is kept without it and
    :meth:`~.plans.SoftmaxPlan.with_relation` puts each call's relation in); None: a relation whose plan is
    built afresh."""
    if positives is None:
        return ()
    if isinstance(positives, PartnerPositives):
        return id(positives)
    if isinstance(positives, KeyPositives):
        return ("keys", positives.num_rows, positives.num_cols, positives.self_offset, len(positives.row_keys),
                positives.dense is not None)
    return None


#: :func:`plan`'s soft-max and pair plans by :func:`plan_key`: the engine's one plan cache.
_PLANS: dict[tuple[Any, ...], SoftmaxPlan | PairPlan] = {}


def _softmax_plan(problem: Problem, stat: Softmax, decision: Decision) -> SoftmaxPlan:
    """The soft-max choices: where the positive part is read, shared weights, kept-apart positives, gradient columns."""
    positives, columns, n_cols = problem.positives, stat.columns, problem.shape[1]
    tile_positives = decision.backend == "torch" and decision.tile == 0 and positives is not None \
        and (not isinstance(positives, KeyPositives) or positives.dense is not None)
    # the one torch tile reads, clears and updates a strided relation's entries by flat places
    places = flat_places(positives, problem.self_offset, compute_dtype(problem.anchors.dtype)) \
        if tile_positives and isinstance(positives, PartnerPositives) and positives.layout is not None else None
    chosen = SoftmaxPlan(
        decision=decision, self_offset=problem.self_offset, columns=columns, symmetric=problem.symmetric,
        normalize=problem.options.normalize, eps=float(problem.options.eps), positives=positives,
        column_positives=columns and stat.column_positives,
        tile_positives=tile_positives,
        fold_positives=tile_positives or (decision.backend == "epilogue" and isinstance(positives, (KeyPositives, PartnerPositives))),
        shared_alpha=stat.columns_share_alpha and stat.row_weights[0] is not None,
        column_comm=stat.column_comm if columns else None,
        grad_columns=n_cols if problem.grad_columns is None else max(0, min(int(problem.grad_columns), n_cols)),
        exclude=stat.exclude,
        apart=apart_rule(positives, stat.exclude, columns, stat.column_positives, stat.column_comm, problem.symmetric,
                         decision.backend),
        places=places,
        weighted=any(w is not None for w in (*stat.row_weights, *stat.col_weights)),
        stack_rows=_stacks(decision, problem))
    return replace(chosen, one_tile=True) if one_tile(chosen, problem) else chosen


def one_tile(plan: SoftmaxPlan, problem: Problem) -> bool:
    """Whether the lean one-tile executor (:mod:`.one_tile`) serves ``plan``: the torch backend's one
    bounded tile (the compute dtype, or bf16 on tensor cores), rows normalised inside, nothing excluded, one process; and either an
    unweighted strided relation kept apart -- a single set visited as its symmetric triangle (the self pair
    left out, no column terms), or two sets of one dtype on the identity layout (no self pair; the column
    terms with their positives, or none) whose candidates all take a gradient -- or a single set's dense
    label relation read off the tile, rows weighted, no column terms (SupCon). (Per call, :mod:`.one_tile` also
    sends a reduction outside the engine, a tensor scale and an ambient autocast to the general executor.)"""
    places, n_cols = plan.places, problem.shape[1]
    if places is None:  # a dense label relation read off the tile (SupCon), rows weighted, no column terms
        stat = problem.statistic
        # (two rows or more: every row's sum of exp then holds a candidate, so backward divides by it)
        positives = plan.positives
        read = plan.tile_positives
        masked = problem.single and n_cols >= 2 and plan.symmetric and plan.self_offset == 0 and not plan.columns and read \
            and isinstance(positives, KeyPositives) and isinstance(stat, Softmax) and stat.col_weights == (None, None)
        return bool(masked and _one_bounded_tile(plan, problem))
    if problem.single:
        shape = plan.symmetric and plan.self_offset == 0 and not plan.columns
    else:
        shape = (not plan.symmetric and plan.self_offset is None and problem.anchors.dtype == problem.candidates.dtype
                 and (plan.column_positives or not plan.columns) and getattr(plan.positives, "layout", None) == "identity")
    return bool(shape and plan.grad_columns == n_cols and plan.apart is not None and not plan.weighted
                and _one_bounded_tile(plan, problem))


def _one_bounded_tile(plan: SoftmaxPlan, problem: Problem) -> bool:
    """The torch backend's one bounded tile, rows normalised inside, nothing excluded, one process, in the compute
    dtype (tensor-core products take the general executor, the form a GPU has measured)."""
    return (plan.backend == "torch" and plan.single_tile and plan.fixed and plan.operand_dtype is None
            and not plan.half
            and plan.normalize and plan.exclude is None and plan.column_comm is None)


def _stacks(decision: Decision, problem: Problem) -> bool:
    """Two sets normalised as one stack of rows (half the normalisation ops, forward and backward; the
    stack's one copy of the rows is small beside the logits): the torch backend, rows normalised inside
    (tensor-core products read each set's part of the stack's norms)."""
    return decision.backend == "torch" and problem.options.normalize and not problem.single


def _pair_plan(problem: Problem, stat: PairTerms, decision: Decision) -> PairPlan:
    """The pair choices: which tiles can hold a positive (label-sorted rows), and the symmetric walk."""
    positives = problem.positives
    if positives is None:  # Problem refuses it when built
        raise ValueError("PairTerms needs positives")
    mixed = None
    # The Triton kernels form every tile's mask in registers: no skipped tiles, no triangle walk.
    # The ranges are read at the plan's tile whatever step the loss read them at (LabelRanges.over).
    if stat.label_ranges is not None and decision.tile != 0 and decision.backend == "torch":
        mixed = stat.label_ranges.over(decision.tile, *problem.shape)
    # PML's one exp for both blocks of a tile needs the bounded regime
    symmetric = (mixed is not None and problem.single and positives.self_offset == 0
                 and (stat.kernel == "binary" or decision.fixed))
    # the lean one-tile executor: one set's label relation on the torch backend's one bounded tile, rows normalised inside
    # (in the compute dtype: tensor-core products take the general executor)
    one_tile = (problem.single and isinstance(positives, KeyPositives) and positives.self_offset == 0
                and decision.backend == "torch" and decision.tile == 0 and decision.fixed
                and not decision.half
                and decision.operand_dtype is None and problem.options.normalize)
    return PairPlan(decision=decision, kernel=stat.kernel, positives=positives, normalize=problem.options.normalize,
                    eps=float(problem.options.eps), mixed=mixed, symmetric=symmetric, one_tile=one_tile)


def triton_refusal(problem: Problem) -> str | None:
    """None when the Triton kernels can run ``problem``, else why not (in words, for the error
    of an explicit ``backend="triton"``)."""
    from . import triton_backend

    try:
        triton_backend.check_device(problem.anchors)
    except ValueError as err:
        return str(err)
    stat, positives = problem.statistic, problem.positives
    if isinstance(stat, Softmax):
        try:
            triton_backend.check_exclusion(stat.exclude)
        except ValueError as err:
            return str(err)
        return None
    if positives is None:  # Problem refuses pair and sigmoid terms without positives when built
        return f"{type(stat).__name__} needs positives"
    kind = positives.kind
    by_ids = isinstance(positives, KeyPositives)  # one or two keys: the kernels compare both
    if isinstance(stat, PairTerms):
        if isinstance(positives, (PartnerPositives, PairPositives)) or by_ids:
            return None
        return f"the pair kernels take positives by ids, a partner or index pairs, not a {kind!r} relation"
    covered = (isinstance(positives, PartnerPositives) and stat.diagonal_offset is not None) \
        or (by_ids and positives.self_offset is None) \
        or (isinstance(positives, PairPositives) and positives.pairs.shape[0] == 0)
    return None if covered else f"the SigLIP kernels take positives on a diagonal, by ids or none, not a {kind!r} relation"


def epilogue_refusal(problem: Problem) -> str | None:
    """None when the epilogue kernels can run ``problem`` (a problem the Triton kernels cover, without
    fp16 inputs), else why not."""
    why = triton_refusal(problem)
    if why is not None:
        return why.replace("backend='triton'", "backend='epilogue'")
    if torch.float16 in (problem.anchors.dtype, problem.candidates.dtype):
        return "fp16 gradient tiles need a tile-wide rescale; use backend='torch' or 'triton' (or bf16 inputs)"
    return None
