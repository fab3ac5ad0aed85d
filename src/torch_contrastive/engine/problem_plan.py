"""The one complete plan of a problem: :func:`plan`.

A loss describes its problem (:class:`~.problem.Problem`); :func:`plan` asks the planner's device decisions
(:func:`~.planner.decide`: the device's policy, asking each strategy whether it serves the problem,
:data:`~.strategies.STRATEGIES`) and adds what follows from the problem itself -- the strategy's form (the torch
loops' lean one-tile form), label-sorted tiles, the triangle walk, stacked rows -- into one frozen typed plan,
kept per key so a training loop's repeated call costs one dictionary look-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..positives import KeyPositives, PartnerPositives, Positives
from .confident import apart_rule
from .one_tile import lean_pairs, lean_softmax
from .planner import EPILOGUE_BACKWARD, KERNEL_STRATEGIES, Decision, Target, Traits, choose_backend, decide, target, tf32
from .plans import AnyPlan, PairPlan, PrefixesPlan, SigmoidPlan, SoftmaxPlan
from .precision import compute_dtype
from .prefix_lse import upper_strip
from .prefixes import prefix_plan
from .problem import PairTerms, Prefixes, Problem, SigmoidPairs, Softmax
from .recorded import amend, name_executor, quiet, record_plan
from .softmax_tiles import flat_places
from .strategies import STRATEGIES

__all__ = ["label_sort_tile", "plan", "plan_key", "serves"]


def plan(problem: Problem) -> AnyPlan:
    """The one complete plan of a :class:`~.problem.Problem` on its inputs' device -- the one
    planning function every engine call goes through. Nothing runs: ``plan(problem)`` says what
    :func:`~torch_contrastive.engine.solve` would do (``str(plan)`` in words) and is a frozen
    :class:`~.plans.SoftmaxPlan`, :class:`~.plans.PairPlan` or :class:`~.plans.SigmoidPlan`.

    The statistic's traits: the soft-max and pair terms take tensor-core products; which strategy runs is the
    device's policy's first rule that covers the call and whose strategy serves it (:func:`serves`), or the
    caller's explicit ``backend=``, refused with a ``ValueError`` that says why when its strategy does not serve.

    A soft-max or pair plan is kept per key (:func:`plan_key`): a training loop asks the same question
    every step, and the answer costs one dictionary look-up instead of a decision and a plan.
    """
    stat = problem.statistic
    on = target(problem.anchors.device)
    key = plan_key(problem, on)
    if key is not None:
        found = _PLANS.get(key)
        if found is not None:
            if problem.options.backend in KERNEL_STRATEGIES:  # an explicit kernel backend: still its refusal
                choose_backend(problem.options.backend, serves(problem, on))
            relation = problem.positives
            if found.positives is relation:  # (a partner's key holds its id(): the kept plan holds it, so it is its own)
                record_plan(found)
                return found
            if found.positives is None and isinstance(relation, KeyPositives):  # the plan of its shape, kept without it
                record_plan(found)
                return found.with_relation(relation)
    if isinstance(stat, Prefixes):
        return _prefixes_plan(problem, stat, on)
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


def _prefixes_plan(problem: Problem, stat: Prefixes, on: Target) -> PrefixesPlan:
    """The prefix engine's plan (the strip height: the caller's ``chunk_size``, else as many rows as keep one
    strip's tiles near 64 MiB on every device; one set's upper triangle in about eight strips) beside the device's
    decision, whose tile is the strip -- what :func:`~.recorded.explain` shows."""
    rows, cols = problem.shape
    opts = problem.options
    scale = problem.scale
    if not isinstance(scale, float):  # the passes take a tensor scale as one of their own arguments
        raise TypeError(f"Prefixes needs a float scale (a tensor one is the pass's argument), got {type(scale).__name__}")
    prefix = prefix_plan(list(stat.dims), list(stat.weights), int(problem.anchors.shape[-1]), scale, opts.normalize,
                         float(opts.eps), rows, cols, opts.chunk_size, stat.mean, stat.per_row)
    if stat.upper:
        prefix = replace(prefix, strip=upper_strip(rows, prefix.strip, opts.chunk_size))
    decision = _decision(problem, stat, on)
    one = prefix.strip >= rows
    strips = replace(decision, tile=0 if one else prefix.strip, tile_cols=0 if one else cols, executor=decision.backend)
    amend(strips)
    return PrefixesPlan(decision=strips, prefix=prefix)


def _decision(problem: Problem, stat: Softmax | PairTerms | SigmoidPairs | Prefixes, on: Target) -> Decision:
    """:func:`decide` asked about ``problem`` planned for ``on``."""
    rows, cols = problem.shape
    anchors, opts = problem.anchors, problem.options
    kernel = _KERNELS[type(stat)]
    fixed = stat.fixed if isinstance(stat, (Softmax, PairTerms)) else False
    return decide(kernel=kernel, rows=rows, cols=cols, device=anchors.device, dtype=anchors.dtype,
                  other_dtype=problem.candidates.dtype, chunk_size=opts.chunk_size, backend=opts.backend, fixed=fixed,
                  bound=problem.bound if isinstance(stat, (Softmax, PairTerms)) else None,
                  half_ok=isinstance(stat, (Softmax, PairTerms)),
                  traits=Traits(int(anchors.shape[-1]), isinstance(stat, Softmax) and stat.columns, problem.symmetric,
                                stat.kernel if isinstance(stat, PairTerms) else None),
                  serves=serves(problem, on), on=on)


#: The planner's name of each statistic (what :class:`~.planner.Decision` and a policy's rules call it).
_KERNELS: dict[type, str] = {Softmax: "softmax", PairTerms: "pairwise", SigmoidPairs: "sigmoid", Prefixes: "prefixes"}


def serves(problem: Problem, on: Target) -> Callable[[str], str | None]:
    """The question the policy asks of each strategy it names: ``serves(problem, on)(name)`` is None when the
    strategy ``name`` can run ``problem`` planned for ``on``, else why not."""
    return lambda name: STRATEGIES[name].serves(problem, on)


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
        fold_positives=tile_positives or (decision.backend in EPILOGUE_BACKWARD and isinstance(positives, (KeyPositives, PartnerPositives))),
        shared_alpha=stat.columns_share_alpha and stat.row_weights[0] is not None,
        column_comm=stat.column_comm if columns else None,
        grad_columns=n_cols if problem.grad_columns is None else max(0, min(int(problem.grad_columns), n_cols)),
        exclude=stat.exclude,
        apart=apart_rule(positives, stat.exclude, columns, stat.column_positives, stat.column_comm, problem.symmetric,
                         decision.backend),
        places=places,
        weighted=any(w is not None for w in (*stat.row_weights, *stat.col_weights)),
        stack_rows=_stacks(decision, problem))
    return replace(chosen, one_tile=True) if lean_softmax(chosen, problem) else chosen


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
    one_tile = lean_pairs(problem, decision)
    return PairPlan(decision=decision, kernel=stat.kernel, positives=positives, normalize=problem.options.normalize,
                    eps=float(problem.options.eps), mixed=mixed, symmetric=symmetric, one_tile=one_tile)
