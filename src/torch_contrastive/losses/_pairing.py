"""Relations of positives by pairing rules and ids, and their positive logits in O(N * D)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..distributed import Scope
from ..engine import Scale
from ..positives import Positives, Strided


def image_text_positives(image_id: Tensor | None, text_id: Tensor | None, n: int, num_cols: int, scope: Scope,
                         device: torch.device) -> Positives:
    """Positives of this rank's n image rows against all ``num_cols`` texts (CLIP's duplicate-id rule).

    With ids: ``image_id_i == image_id_j or text_id_i == text_id_j`` (ids gathered under
    ``gather=True``); without: image i's positive is text ``offset + i``. The relation is
    symmetric, so it serves both directions.
    """
    keys = [k for k in (image_id, text_id) if k is not None]
    offset = scope.offset
    if keys:
        global_keys = tuple(scope.ints(k) for k in keys)
        local_keys = tuple(k[offset : offset + n] for k in global_keys) if scope.distributed else global_keys
        return Positives.from_keys(local_keys, global_keys, self_offset=None)
    return partner_positives(n, "identity", offset, device, num_cols, None, None if scope.distributed else "identity")


def positive_logits(anchors: Tensor, candidates: Tensor, positives: Positives, scale: Scale) -> Tensor:
    """(R,) ``sum_{p in P(i)} s_ip``, in O(N * D) through the positive aggregate.

    An element-wise product and sum, not ``vecdot``: autocast would run that in half precision.
    """
    return (anchors * positives.aggregate(candidates)).sum(1) * scale


def safe_logsumexp(terms: Tensor) -> Tensor:
    """``logsumexp`` over dim 1 where a row of only ``-inf`` (no candidate left: every one
    excluded as a false negative) gives 0 and a zero gradient instead of ``-inf``/NaN."""
    empty = torch.isneginf(terms).all(1)
    safe = torch.where(empty[:, None], 0.0, terms)
    return torch.where(empty, 0.0, torch.logsumexp(safe, 1))


def pair_partner(n_rows: int, pairing: str, offset: int = 0, device: torch.device | None = None) -> Tensor:
    """Global index of each row's positive under a pairing rule (rows ``offset ...``).

    ``"adjacent"``: ``i ^ 1``; ``"halves"``: ``(i + n_rows / 2) mod n_rows`` with
    ``n_rows`` the size of the batch the rule applies to; ``"identity"``: ``i``. The
    index tensors are constants, built once per (size, rule, offset, device) and reused
    (a training loop calls with the same shapes every step). Treat them as read-only.
    """
    key = (n_rows, pairing, offset, torch.device(device) if device is not None else torch.device("cpu"))
    cached = _PARTNERS.get(key)
    if cached is None:
        cached = Strided.of(pairing, n_rows).columns(torch.arange(n_rows, device=device)) + offset
        if torch.compiler.is_compiling():  # a traced tensor kept in a module would outlive its trace
            return cached
        if len(_PARTNERS) > 256:  # many distinct shapes: keep the cache small
            _PARTNERS.clear()
        _PARTNERS[key] = cached
    return cached


_PARTNERS: dict[tuple[int, str, int, torch.device], Tensor] = {}


def partner_positives(n_rows: int, pairing: str, offset: int, device: torch.device, num_cols: int,
                      self_offset: int | None, layout: str | None) -> Positives:
    """``Positives.from_partner(pair_partner(...), ...)``, built once per shape and reused
    (like the partner indices themselves: a training loop asks for the same one every step)."""
    key = (n_rows, pairing, offset, torch.device(device), num_cols, self_offset, layout)
    cached = _PARTNER_POSITIVES.get(key)
    if cached is None:
        cached = Positives.from_partner(pair_partner(n_rows, pairing, offset, device), num_cols, self_offset=self_offset,
                                        layout=layout, shift=offset if pairing == "identity" else None)
        if torch.compiler.is_compiling():  # a traced tensor kept in a module would outlive its trace
            return cached
        if len(_PARTNER_POSITIVES) > 256:
            _PARTNER_POSITIVES.clear()
        _PARTNER_POSITIVES[key] = cached
    return cached


_PARTNER_POSITIVES: dict[tuple[int, str, int, torch.device, int, int | None, str | None], Positives] = {}


def pair_keys(n_rows: int, pairing: str, device: torch.device | None = None) -> Tensor:
    """Key of each row under a pairing rule: rows with equal keys are positives.

    Args:
        n_rows: 2N, the number of rows (even).
        pairing: ``"adjacent"`` pairs rows (0, 1), (2, 3), ... (two views stored row by row);
            ``"halves"`` pairs row i with i + N, as in ``torch.cat([view1, view2])``
            (the SimCLR and SupCon papers).
    """
    if isinstance(n_rows, bool) or not isinstance(n_rows, int) or n_rows < 0:
        raise TypeError(f"n_rows must be an int >= 0, got {n_rows!r}")
    if pairing not in ("adjacent", "halves"):
        raise ValueError(f"pairing must be 'adjacent' or 'halves', got {pairing!r}")
    if n_rows % 2:
        raise ValueError(f"n_rows must be even (2N views) for pairing={pairing!r}, got {n_rows}")
    return Strided.of(pairing, n_rows).keys(torch.arange(n_rows, device=device))
