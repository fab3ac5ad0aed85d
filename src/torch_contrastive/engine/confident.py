"""The confident regime: a row's single positive kept apart from its soft-max sum.

When a row's positive dominates, ``LSE_i - S_ip`` is a tiny difference of two large
numbers (``S ~ 1/tau``): in fp32 the plain ``log(sum) - S_ip`` loses all of it (loss 2e-6
at ``tau = 0.02`` carries an absolute rounding error of ~4e-6), and the positive entry of
the gradient, ``softmax_ip - 1``, cancels the same way.

Instead the tile passes sum only the *other* candidates (the positive entries of a tile
are cleared like the self pairs: strided views, no mask), and then

    ``d_i = LSE_i - S_ip = log1p(sum_{j != p} exp(S_ij - S_ip)) = softplus(log(excess_i) - S_ip)``

is accurate to the relative rounding of the excess itself. In backward the positive
entry's coefficient becomes ``u_i (exp(-d_i) - 1) + (u_i + c_i) = u_i expm1(-d_i) + (u_i + c_i)``
(``u`` the soft-max weight, ``c`` the positive part's; their sum is exactly 0 when the
loss weighs both alike), again without cancellation. This is what ``F.cross_entropy``
gets from shifting by the row maximum, but it costs no second pass and no extra ``exp``
per logit, so the bounded one-``exp`` path keeps its speed.

It applies to relations with one positive per row at a known strided place: a shifted
diagonal (CLIP, InfoNCE: column ``i + k``), or the NT-Xent pairing rules ("halves",
"adjacent"), for the torch tile loops and the epilogue kernels. Multi-positive relations (SupCon) do not cancel
this way: their loss stays at least ``log`` of the number of positives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..positives import PartnerPositives, Strided
from .precision import zero

if TYPE_CHECKING:
    from ..positives import Positives


#: The rule that keeps each row's one positive apart from the sums: where it lies
#: (:class:`~torch_contrastive.positives.Strided`, the layout's one definition).
Apart = Strided


def apart_rule(positives: Positives | None, exclude: Any, columns: bool, column_positives: bool,
               column_comm: Any, symmetric: bool, backend: str) -> Apart | None:
    """The :class:`Apart` rule for a call, or None where the positive stays in the sums.

    Needs one positive per row at a known strided place, the torch tile loops or the epilogue
    kernels (which leave the positives out as a strided diagonal or a partner, in registers), and
    an exclusion (false negatives) that keeps the positive. Column terms need the same entries as
    their positives (a square shifted diagonal) on one process.
    """
    if not isinstance(positives, PartnerPositives) or backend not in ("torch", "epilogue"):
        return None
    rule = positives.strided
    if rule is None:
        return None
    shift = rule.k if rule.kind == "shift" else None
    if symmetric and rule.kind == "shift":
        return None
    if exclude is not None and (shift is None or exclude.diagonal is not None or exclude.keep_diagonal != shift):
        return None
    if columns and (not column_positives or column_comm is not None or rule.kind != "shift"
                    or positives.num_rows != positives.num_cols):
        return None
    return rule


def margin(log_excess: Tensor, positive: Tensor) -> Tensor:
    """``d = LSE - S_p = log1p(excess * exp(-S_p))`` from ``log(excess)`` (``-inf``: none).

    ``logaddexp(x, 0)`` (``max(x, 0) + log1p(exp(-|x|))`` in one kernel) rather than
    ``F.softplus``, whose threshold (x > 20 returns x) drops a float64 term of up to 2e-9.
    """
    x = log_excess - positive
    return torch.logaddexp(x, x.new_zeros(()))


def coefficient(u: Tensor, c: Tensor | None, d: Tensor, alike: bool, w: Tensor | None = None) -> Tensor:
    """The positive entry's gradient coefficient ``u exp(-d) + c`` without cancellation;
    ``alike``: ``c == -u`` exactly (the loss weighs the soft-max and the positive alike).
    ``w`` (the row's soft-max weight) is not needed here: the signature is
    :func:`coefficient_from_sums`'s."""
    out = torch.expm1(d.neg()).mul_(u)
    return out if alike else out.add_(u + _given(c))


def coefficient_from_sums(u: Tensor, c: Tensor | None, excess: Tensor, alike: bool, w: Tensor) -> Tensor:
    """The same from the one tile's sums: ``exp(-d) - 1 = -excess / total``, with ``w = u / total``
    (the row's soft-max weight, which backward forms anyway): ``u (exp(-d) - 1) = -w * excess``,
    one fused op."""
    out = torch.addcmul(zero(w), w, excess, value=-1)
    return out if alike else out.add_(u + _given(c))



def _given(c: Tensor | None) -> Tensor:
    if c is None:  # only an alike loss may leave the positive coefficient unformed
        raise RuntimeError("internal: the positive coefficient is needed when the parts are weighed differently")
    return c
