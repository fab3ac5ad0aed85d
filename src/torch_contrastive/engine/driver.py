"""The engine's one autograd driver: what every kernel shares around its own forward and backward.

A kernel (the soft-max terms, the pairwise softplus/binary terms, the sigmoid pairs) is an
object with two methods:

* ``forward(ctx, plan, ops, extras) -> (outputs, keep)``: ``ops`` holds the caller's raw
  inputs and their compute-dtype copies (normalised when the plan says so); ``keep`` holds the
  tensors its backward needs besides the operands, by name: a dict whose values are tensors,
  tuples of tensors or None (:func:`pack` / :func:`unpack`: backward gets the same dict).
* ``backward(ctx, plan, saved, grads) -> Gradients``: the unscaled accumulators ``G @ B``
  and ``G.T @ A`` and the gradients of its extra inputs.

:class:`_EngineCall` does the rest once: it switches an ambient autocast off (the engine
chooses its own precision: fp32 logits for half inputs, fp64 for fp64), prepares the
operands, saves them (``B`` only when it is not ``A``; a float scale on ``ctx``), restores
them, and turns the accumulators into the gradients of the raw inputs, the scale and --
through the normalisation inside -- the caller's un-normalised tensors
(:func:`finish_gradients`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import Tensor

from .._tensors import as_dtype, save_for_backward
from .normalization import KERNEL_DTYPES, l2_normalize, l2_normalize_backward
from .planner import rows_by_kernel
from .precision import Scale, autocast_enabled, compute_dtype


# ---------------------------------------------------------------------------------
# Inputs, saved state and gradients: what every kernel shares around its own passes
# ---------------------------------------------------------------------------------
def to_compute(a: Tensor, b: Tensor | None, scale: Scale) -> tuple[Tensor, Tensor, Scale]:
    """Inputs in the compute dtype (fp32 for fp16/bf16; no copy when already there).

    ``b=None`` (a single set) returns ``a`` itself as the candidates. A float scale stays
    a Python float: turning it into a device tensor would be a host-to-device copy on
    every call.
    """
    cdtype = compute_dtype(a.dtype)
    scale = _compute_scale(scale, a.device, cdtype)
    a_c = a if a.dtype == cdtype else a.to(cdtype)
    if b is None:
        return a_c, a_c, scale
    return a_c, (b if b.dtype == cdtype else b.to(cdtype)), scale


def _compute_scale(scale: Scale, device: torch.device, cdtype: torch.dtype) -> Scale:
    """A tensor scale detached, on the rows' device, in the compute dtype; a float as it is."""
    return scale.detach().to(device=device, dtype=cdtype) if isinstance(scale, Tensor) else scale


def by_kernel(plan: Any, a: Tensor, b: Tensor | None = None) -> bool:
    """Whether the rows are normalised (and their gradients finished) by the Triton row kernels: the planner's one
    rule (:func:`~.planner.rows_by_kernel`) for the plan's strategy and both sets' dtypes."""
    return rows_by_kernel(a.device, a.dtype, plan.backend) and (b is None or b.dtype in KERNEL_DTYPES)


def prepare_inputs(a: Tensor, b: Tensor | None, scale: Scale, normalize: bool,
                   eps: float, kernel: bool = False, stacked: bool = False) -> tuple[Tensor, Tensor, Scale, list[Tensor]]:
    """Compute-dtype inputs, L2-normalised inside the autograd function when asked (``kernel``:
    by the Triton row kernel, which reads half rows as given -- one launch per input; ``stacked``:
    two sets normalised as one stack of rows, each op once for both).

    Returns ``(a, b, scale, norms)``: ``b`` is ``a`` for a single set (``b=None``), and
    ``norms`` the (denominator, norm) of ``a`` -- then of ``b`` unless it is ``a`` -- for
    :func:`finish_gradients`; stacked, the (denominator, norm, rows) of the stack (``a`` and ``b``
    are its two parts).
    """
    if normalize and kernel:
        from .triton_backend.normalize_rows import normalize_rows

        a_c, denom, norm = normalize_rows(a, eps)
        kept = [denom, cast(Tensor, norm)]
        if b is not None:
            b_c, denom, norm = normalize_rows(b, eps)
            kept += [denom, cast(Tensor, norm)]
        return a_c, a_c if b is None else b_c, _compute_scale(scale, a.device, a_c.dtype), kept
    if normalize and stacked and b is not None:
        # one stack of the rows, widened once when they share a dtype (half rows: one copy instead of two)
        pair = (a, b) if a.dtype == b.dtype else to_compute(a, b, scale)[:2]
        both, _, scale_c = to_compute(torch.cat(pair), None, scale)
        rows, denom, norm = l2_normalize(both, eps)
        return rows[: a.shape[0]], rows[a.shape[0] :], scale_c, [denom, norm, rows]
    a_c, b_c, scale_c = to_compute(a, b, scale)
    norms: list[Tensor] = []
    if normalize:
        a_c, *norm_a = l2_normalize(a_c, eps)
        norms += norm_a
        if b is None:
            b_c = a_c
        else:
            b_c, *norm_b = l2_normalize(b_c, eps)
            norms += norm_b
    return a_c, b_c, scale_c, norms


def save(ctx: Any, scale: Scale, a: Tensor, b: Tensor, *tensors: Tensor | None) -> None:
    """Save tensors for backward: ``b`` only when it is not ``a`` (a single set), a float
    scale on ``ctx`` (it is not a tensor)."""
    ctx.float_scale = None if isinstance(scale, Tensor) else scale
    ctx.single = b is a
    save_for_backward(ctx, a, *(() if ctx.single else (b,)), *tensors, *((scale,) if isinstance(scale, Tensor) else ()))


def saved(ctx: Any) -> tuple[Tensor, Tensor, list[Tensor], Scale]:
    """``(a, b, other saved tensors, scale)`` as given to :func:`save`."""
    stored = list(ctx.saved_tensors)
    scale: Scale = ctx.float_scale if ctx.float_scale is not None else stored.pop()
    a = stored.pop(0)
    b = a if ctx.single else stored.pop(0)
    return a, b, stored, scale


def finish_gradients(ctx: Any, a: Tensor, scale: Scale, gb_acc: Tensor, ga_acc: Tensor | None, symmetric: bool,
                     norm_a: tuple[Tensor, Tensor] | None, norm_b: tuple[Tensor, Tensor] | None,
                     b: Tensor, eps: float = 0.0,
                     stack: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """From ``G @ B`` and ``G.T @ A`` (unscaled) to the gradients of the raw inputs and scale.

    ``dscale = sum_ij G_ij a_i . b_j = sum_i a_i . (G @ B)_i``; when ``symmetric`` the
    accumulator holds ``H @ Z`` with ``H = G + G.T``, which counts every pair twice. For
    a single set (B is A, not symmetric) both accumulators are A's gradient. ``norm_a``
    / ``norm_b`` are the ``(denom, state)`` of a normalisation done inside the function,
    whose backward is applied last (with floor ``eps``); ``stack``: the ``(denom, state, rows)`` of two
    sets normalised as one stack (:func:`prepare_inputs`), whose backward runs once for both. A float
    scale gets no gradient.
    """
    gscale = None
    if isinstance(scale, Tensor):
        gscale = torch.linalg.vecdot(gb_acc, a).sum()
        if symmetric:
            gscale = gscale / 2
    if stack is not None:
        return (*_stacked_gradients(stack, gb_acc, ga_acc, eps, scale, ctx.in_dtypes), gscale)
    kernel = norm_a is not None and ctx.by_kernel
    extra = None
    if ctx.single and ga_acc is not None:
        if kernel:  # the row kernel adds the two accumulators as it reads them
            extra = ga_acc
        else:
            gb_acc = gb_acc + ga_acc
        ga_acc = None
    ga = _raw_gradient(gb_acc, a, norm_a, eps, scale, ctx.in_dtypes[0], kernel, extra)
    gb = None if ga_acc is None else _raw_gradient(ga_acc, b, norm_b, eps, scale, ctx.in_dtypes[1], kernel)
    return ga, gb, gscale


def _stacked_gradients(stack: tuple[Tensor, Tensor, Tensor], g_a: Tensor, g_b: Tensor | None, eps: float, scale: Scale,
                       dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[Tensor, Tensor | None]:
    """The two sets' gradients through their stacked normalisation: one backward for both (the
    caller's rows get the two parts, views of one tensor); only the first set's part when the
    second needs none."""
    denom, norm, rows = stack
    n = g_a.shape[0]
    if g_b is None:
        return as_dtype(l2_normalize_backward(g_a, rows[:n], denom[:n], norm[:n], eps, scale), dtypes[0]), None
    both = l2_normalize_backward(torch.cat([g_a, g_b]), rows, denom, norm, eps, scale)
    if dtypes[0] == dtypes[1]:
        both = as_dtype(both, dtypes[0])
        return both[:n], both[n:]
    return as_dtype(both[:n], dtypes[0]), as_dtype(both[n:], dtypes[1])


def _raw_gradient(g: Tensor, y: Tensor, norm: tuple[Tensor, Tensor] | None, eps: float, scale: Scale, dtype: torch.dtype,
                  kernel: bool, g2: Tensor | None = None) -> Tensor:
    """The gradient of the caller's rows, in their dtype, from the upstream ``scale * (g + g2)`` of
    the rows ``y`` the engine multiplied (normalised inside when ``norm`` is given)."""
    if norm is None:
        return as_dtype(g * scale, dtype)
    if kernel:
        from .triton_backend.normalize_rows_grad import normalize_rows_grad

        return normalize_rows_grad(g, y, norm[0], norm[1], eps, scale, dtype, g2)
    return as_dtype(l2_normalize_backward(g, y, *norm, eps, scale), dtype)


class Operands(NamedTuple):
    """A call's inputs: raw (``b`` None for a single set) and in the compute dtype (``b_c``
    is ``a_c`` for a single set), the compute-dtype scale and the normalisation state."""

    a: Tensor
    b: Tensor | None
    a_c: Tensor
    b_c: Tensor
    scale: Scale
    norms: list[Tensor]


class Saved(NamedTuple):
    """What backward gets back: the compute-dtype operands and scale, the kernel's own
    tensors by name (``keep``, as the kernel's forward returned them) and the normalisation state."""

    a: Tensor
    b: Tensor
    scale: Scale
    keep: dict[str, Any]
    norms: list[Tensor]


#: how one named entry of ``keep`` was stored: None, one tensor, or a tuple of this many
_NONE, _ONE = -1, -2


def pack(keep: dict[str, Any]) -> tuple[tuple[tuple[str, ...], tuple[int, ...] | None], list[Tensor | None]]:
    """A dict of tensors, tuples of tensors and None as (layout, flat entries) for ``save_for_backward``
    (which takes None). A dict of tensors and None only -- the soft-max executor's, on every small
    call -- is saved as it is: no entry is looked at in Python."""
    names = tuple(keep)
    values = list(keep.values())
    if tuple not in map(type, values):
        return (names, None), values
    sizes: list[int] = []
    flat: list[Tensor | None] = []
    for value in values:
        if value is None:
            sizes.append(_NONE)
        elif isinstance(value, Tensor):
            sizes.append(_ONE)
            flat.append(value)
        else:
            sizes.append(len(value))
            flat.extend(value)
    return (names, tuple(sizes)), flat


def unpack(layout: tuple[tuple[str, ...], tuple[int, ...] | None], flat: Sequence[Tensor | None]) -> dict[str, Any]:
    """The dict :func:`pack` took apart."""
    names, sizes = layout
    if sizes is None:
        return dict(zip(names, flat))
    out: dict[str, Any] = {}
    at = 0
    for name, size in zip(names, sizes):
        if size == _NONE:
            out[name] = None
        elif size == _ONE:
            out[name], at = flat[at], at + 1
        else:
            out[name], at = tuple(flat[at : at + size]), at + size
    return out


class Gradients(NamedTuple):
    """A kernel's backward result.

    Attributes:
        rows: ``G @ B`` (R, D), unscaled.
        cols: ``G.T @ A`` (C, D) or None (a single set, or no candidate needs a gradient).
        both_roles: ``rows`` holds ``(G + G.T) @ A`` -- every pair counted twice (single set).
        extras: gradients of the kernel's extra inputs, in order (missing ones are None).
    """

    rows: Tensor
    cols: Tensor | None
    both_roles: bool = False
    extras: tuple[Tensor | None, ...] = ()


class Kernel(Protocol):
    def forward(self, ctx: Any, plan: Any, ops: Operands, extras: tuple[Any, ...]) -> tuple[Any, dict[str, Any]]: ...

    def backward(self, ctx: Any, plan: Any, saved: Saved, grads: tuple[Tensor | None, ...]) -> Gradients: ...


class _EngineCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: Kernel, plan: Any, a: Tensor, b: Tensor | None, scale: Scale, *extras: Any):  # type: ignore[override]
        if autocast_enabled(a.device.type):
            with torch.autocast(a.device.type, enabled=False):
                outputs, named, a_c, b_c, scale_c, norms = _forward(ctx, kernel, plan, a, b, scale, extras)
        else:  # no context to enter: the common call pays nothing for autocast
            outputs, named, a_c, b_c, scale_c, norms = _forward(ctx, kernel, plan, a, b, scale, extras)
        ctx.kernel, ctx.plan = kernel, plan
        ctx.in_dtypes = (a.dtype, a.dtype if b is None else b.dtype)
        ctx.keep_layout, keep = pack(named)
        ctx.counts = (len(keep), len(extras))
        # Kernels that multiply the caller's half rows as given (Triton, fp16/bf16) keep those for
        # backward, not the fp32 normalised copies: 2 bytes per element instead of 2 + 4 (the copies
        # are rebuilt in backward, bit for bit, where the normalisation backward needs them) -- except
        # a plan that is one tile, which keeps its R x C logit tile from forward: its rows (R + C) x D
        # are kept beside it, and backward launches no row kernel to rebuild them (a host-bound call's
        # launches are its time).
        ctx.lean = getattr(plan, "operand_dtype", None) is not None and not (plan.single_tile and ONE_TILE_KEEPS_ROWS)
        if ctx.lean:
            save(ctx, scale_c, a, a if b is None else b, *keep, *norms)
        else:
            save(ctx, scale_c, a_c, b_c, *keep, *norms)
        return outputs

    @staticmethod
    def backward(ctx, *grads: Tensor | None):  # type: ignore[override]
        first_order_only()
        return _backward(ctx, *grads)


#: A kernel backend's one tile keeps its fp32 unit rows for backward (``_EngineCall.forward``). Since 2026-11-28;
#: the cost model's calibration counts the rows measured before that day with it off, as they ran.
ONE_TILE_KEEPS_ROWS = True


def first_order_only() -> None:
    """Refuse ``create_graph=True`` in a backward: the gradient would come back without a graph of
    its own, so anything differentiated through it (a gradient penalty) would silently miss this
    loss's part. (The autograd engine runs a first-order backward without grad mode.)"""
    if torch.is_grad_enabled():
        raise RuntimeError("torch-contrastive losses have first-order gradients only: backward with create_graph=True "
                           "(a second derivative, e.g. a gradient penalty through this loss) is not supported")


def _forward(ctx: Any, kernel: Kernel, plan: Any, a: Tensor, b: Tensor | None, scale: Scale,
             extras: tuple[Any, ...]) -> tuple[Any, dict[str, Any], Tensor, Tensor, Scale, list[Tensor]]:
    ctx.by_kernel = by_kernel(plan, a, b)
    ctx.stacked = b is not None and getattr(plan, "stack_rows", False)
    a_c, b_c, scale_c, norms = prepare_inputs(a, b, scale, plan.normalize, plan.eps, ctx.by_kernel, ctx.stacked)
    per_set = _per_set(norms, a_c.shape[0]) if ctx.stacked else norms
    outputs, named = kernel.forward(ctx, plan, Operands(a, b, a_c, b_c, scale_c, per_set), extras)
    return outputs, named, a_c, b_c, scale_c, norms


def _per_set(stack: list[Tensor], n: int) -> list[Tensor]:
    """A stack's ``(denominator, norm, rows)`` as each set's own ``(denominator, norm)``, views: what the executors
    read (tensor-core products take each set's inverse norms)."""
    denom, norm = stack[0], stack[1]
    return [denom[:n], norm[:n], denom[n:], norm[n:]]


def _backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
    """The engine node's backward (first order: the autograd engine runs it without grad mode)."""
    a, b, rest, scale = saved(ctx)
    n_keep, n_extras = ctx.counts
    norms = rest[n_keep:]
    if ctx.lean:
        a, b = _rebuild(a, b, norms, ctx.plan.normalize, ctx.single)
    ctx.operands_need_grad = tuple(ctx.needs_input_grad[2:4])  # (a, b) as given to run()
    plan = ctx.plan
    keep = unpack(ctx.keep_layout, rest[:n_keep])
    out: Gradients = ctx.kernel.backward(ctx, plan, Saved(a, b, scale, keep, _per_set(norms, a.shape[0]) if ctx.stacked else norms),
                                         grads)
    stack = (norms[0], norms[1], norms[2]) if ctx.stacked else None
    norm_a = (norms[0], norms[1]) if plan.normalize and stack is None else None
    norm_b = None if not plan.normalize or ctx.single or stack is not None else (norms[2], norms[3])
    ga, gb, gscale = finish_gradients(ctx, a, scale, out.rows, out.cols, out.both_roles, norm_a, norm_b, b, plan.eps, stack)
    extras = tuple(out.extras) + (None,) * (n_extras - len(out.extras))
    return (None, None, ga, gb, gscale, *extras)


def _rebuild(a: Tensor, b: Tensor, norms: list[Tensor], normalize: bool, single: bool) -> tuple[Tensor, Tensor]:
    """The compute-dtype (normalised) operands from the caller's rows and the saved denominators: the same
    operations as :func:`prepare_inputs`, so the same bits. A lean call (half rows kept) is on a kernel strategy, so
    its rows are normalised by the row kernels (:func:`by_kernel` holds for half rows there)."""
    if not normalize:
        a_c, b_c, _ = to_compute(a, None if single else b, 1.0)
        return a_c, b_c
    from .triton_backend.normalize_rows import normalize_rows

    a_c = normalize_rows(a, 0.0, norms[0])[0]
    return a_c, a_c if single else normalize_rows(b, 0.0, norms[2])[0]


def run(kernel: Kernel, plan: Any, a: Tensor, b: Tensor | None, scale: Scale, *extras: Any) -> Any:
    """One engine call as one autograd node: ``kernel`` under ``plan`` on anchors ``a``,
    candidates ``b`` (None: ``a`` itself), ``scale`` (float or 0-dim tensor) and the
    kernel's extra inputs (tensors get the gradients the kernel returns, others none)."""
    return _EngineCall.apply(kernel, plan, a, b, scale, *extras)
