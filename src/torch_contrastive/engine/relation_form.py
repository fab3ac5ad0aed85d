"""The form of a label relation -- a dense mask or grouped by key -- as the problem that reads it will price it.

A relation of ``R x C`` label pairs is held as a dense 0/1 mask (one byte an entry; read by GEMMs on the torch
backend's one tile) or grouped by key (O(R + C): the sums per key by index-adds, the keys compared in registers by
the kernel backends). On a CPU the mask is kept up to a measured size; on a GPU the cost model (:mod:`.cost`)
prices the two forms inside the call that reads the relation (:class:`Reader`), with the planner's live settings
(:mod:`.planner`: the simulated device and size, the scratch budget, the product scheme). The positives
(:mod:`torch_contrastive.positives`) ask :func:`dense_relation` when they build a relation.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from . import planner
from .cost import PAIR_RELATION_FORMS, RELATION_FORMS, dense_relation_pays, path_terms, predict_path, tile_mask_pays
from .planner import WIDE, Traits, _bytes_per_logit, _priced, _wide_pays, half_products, resolve_tile

__all__ = ["Reader", "counts_from_values", "dense_relation", "mask_on_tensor_cores", "reader_wants_mask"]


class Reader(NamedTuple):
    """The problem a label relation is built for, as the planner will price it (what :func:`dense_relation`
    asks of it): its dtypes, the caller's ``chunk_size`` and ``backend``, and its :class:`~.planner.Traits` -- the
    feature size, whether one set's triangle, the pair kernel (``None``: soft-max terms) -- kept flat (a label
    call builds one every step: one tuple, not two)."""

    dtype: torch.dtype
    other_dtype: torch.dtype
    chunk_size: int | None
    backend: str
    dim: int
    symmetric: bool
    pairs: str | None


def dense_relation(rows: int, cols: int, device: torch.device, cpu_limit: int, reader: Reader | None = None) -> bool:
    """Whether a label relation of ``R x C`` entries is held as a dense mask (else grouped by key):
    on a CPU up to ``cpu_limit`` entries (measured there). On a GPU -- also one :func:`~.planner.simulate` d -- while the
    mask fits the scratch budget: where the cost model prices the mask's extra passes over strips below the
    grouped form's extra launches (:func:`~.cost.dense_relation_pays`, the H100's constants for any CUDA device
    until others are measured), or where the problem it is built for (``reader``) wants it
    (:func:`reader_wants_mask`: the torch backend's one tile, whose lean executor reads the mask by GEMMs, or
    host-bound torch strips). The kernel backends compare the keys themselves: a mask only adds its passes there."""
    entries = rows * cols * planner._SIMULATED_AREA  # a problem counted small stands for its full size
    if (planner._SIMULATED or device).type != "cuda":
        return entries <= cpu_limit
    if entries > planner.GPU_BUDGET:
        return False
    # the strips' rule first: it holds for every small relation; its answer kept per shape (a training loop asks
    # the same every step, and a host-bound call pays each bytecode)
    if reader is not None and reader_wants_mask(rows, cols, reader):  # (the reader first: a small call's mask)
        return True
    key = (rows, cols, planner._SIMULATED_AREA)
    pays = _RELATION_PAYS.get(key)
    if pays is None:
        if len(_RELATION_PAYS) > 512:
            _RELATION_PAYS.clear()
        pays = _RELATION_PAYS[key] = dense_relation_pays(rows, cols * planner._SIMULATED_AREA)
    return pays


#: :func:`~.cost.dense_relation_pays`'s answers by ``(rows, cols, simulated area)`` (:func:`dense_relation`).
_RELATION_PAYS: dict[tuple[int, int, float], bool] = {}


#: :func:`reader_wants_mask`'s answers by their key (a training loop asks the same question every step).
_READER_MASKS: dict[tuple[Any, ...], bool] = {}


def reader_wants_mask(rows: int, cols: int, reader: Reader) -> bool:
    """Whether a label relation of ``R x C`` entries is cheaper as a dense mask for the problem that reads it
    (``reader``), priced at the size it stands for: when that problem runs on the torch backend's one tile
    (:func:`_torch_tile_reads`), or on the torch loops' strips where the mask costs their call less
    (:func:`_mask_pays_in_call`). The backend is the caller's, or under ``"auto"`` the one the cost model prices
    fastest among every backend with counts (one the call cannot use makes the answer False, the grouped form's
    safe side). Kept per key."""
    key = (rows, cols, reader, planner.GPU_BUDGET, planner.PRODUCTS, planner._tf32(), planner._SIMULATED_AREA)
    found = _READER_MASKS.get(key)
    if found is None:
        if len(_READER_MASKS) > 512:
            _READER_MASKS.clear()
        found = _READER_MASKS[key] = _reader_wants_mask(rows, cols, reader)
    return found


def _reader_wants_mask(rows: int, cols: int, reader: Reader) -> bool:
    """:func:`reader_wants_mask` without its cache: the reader's problem priced once, then asked both ways."""
    side = math.sqrt(planner._SIMULATED_AREA)  # a problem counted small is priced at the size it stands for
    rows, cols = round(rows * side), round(cols * side)
    chunk = None if reader.chunk_size is None else round(reader.chunk_size * side)
    traits = Traits(reader.dim, False, reader.symmetric, reader.pairs)  # a label relation's problem: no column terms
    priced = dict(_priced(rows, cols, reader.dtype, reader.other_dtype, chunk, traits)) if reader.dim > 0 else {}
    predicted = tuple((name, predict_path(*args)) for name, args in priced.items())
    label = reader.backend if reader.backend != "auto" else min((t, name) for name, t in predicted)[1] if predicted else None
    if _torch_tile_reads(rows, cols, chunk, reader, label, predicted):
        return _tile_mask_pays(rows, cols, reader, label, priced, predicted)
    return _mask_pays_in_call(rows, cols, label, priced, reader.pairs)


def _tile_mask_pays(rows: int, cols: int, reader: Reader, label: str | None, priced: dict[str, Any],
                    predicted: tuple[tuple[str, float], ...]) -> bool:
    """Whether the torch backend's one tile reads the relation as a mask: always, but for a single set's soft-max
    terms on bf16 rows (SupCon's lean executor, which sums the positives by key in the grouped form), where
    the mask's products and passes are priced against the grouped form's launches inside the call
    (:func:`~.cost.tile_mask_pays`)."""
    if reader.pairs is not None or not reader.symmetric or reader.dtype != torch.bfloat16 or label not in priced:
        return True
    wide = label == WIDE or (planner.PRODUCTS == "auto" and _wide_pays(predicted))
    terms = path_terms(*(priced[WIDE] if wide and WIDE in priced else priced[label]))
    return tile_mask_pays(rows, cols, reader.dim, "wide" if wide else "half", terms)


def _torch_tile_reads(rows: int, cols: int, chunk: int | None, reader: Reader, label: str | None,
                      predicted: tuple[tuple[str, float], ...]) -> bool:
    """Whether the reader's problem runs on the torch backend's one tile, as :func:`~.planner.decide` will choose it: its
    backend (``label``; None: ``"auto"`` without prices) the torch loops, and one tile at the scratch budget."""
    if label not in (None, "torch", WIDE) or (chunk is not None and chunk < max(rows, cols)):
        return False
    # the tile's scratch as _decide sizes it: the half gradient copies unless the widened products are chosen
    half = half_products(torch.device("cuda"), reader.dtype, reader.other_dtype) \
        and not (planner.PRODUCTS == "auto" and _wide_pays(predicted))
    return resolve_tile(None, rows, cols, "cuda", _bytes_per_logit("torch", reader.dtype, reader.other_dtype, half)) \
        >= max(rows, cols)


def _mask_pays_in_call(rows: int, cols: int, label: str | None, priced: dict[str, Any], pairs: str | None) -> bool:
    """Whether the dense mask is the cheaper form inside the torch loops' call that reads it (backend ``label``):
    that call's device and host times (:func:`~.cost.path_terms`) against the grouped form's
    (:func:`~.cost.dense_relation_pays` with ``call``), by the forms of the terms that read it (``pairs``: the pair
    kernel's, whose strips compare the keys of every tile again; None: the soft-max terms'). A host-bound call keeps the
    mask, whose passes the device hides, where the device alone would choose the grouped form's launches."""
    # the forms' constants were counted on the torch loops' strips; the kernel backends compare the keys in
    # registers, where a mask only adds bytes (the epilogue holds to its byte budget, issue 34: at most 6 passes)
    if label not in priced or priced[label][1] != "torch":
        return False
    return dense_relation_pays(rows, cols, call=path_terms(*priced[label]), forms=RELATION_FORMS if pairs is None else PAIR_RELATION_FORMS[pairs])


def counts_from_values(device: torch.device) -> bool:
    """Whether a dense label relation's counts are summed from its 0/1 values in the compute dtype: on a
    CPU, where a bool reduction takes a slow path and the one tile reads those values anyway; on a GPU
    (also one :func:`~.planner.simulate` d) the bools are summed, one byte an entry, and no values are formed for it."""
    return (planner._SIMULATED or device).type == "cpu"


def mask_on_tensor_cores(device: torch.device) -> bool:
    """Whether a dense 0/1 relation multiplies fp32 rows as a bf16 mask against the rows split in three bf16 parts
    (:func:`~torch_contrastive.positives._mask_product`): on a GPU (also one :func:`~.planner.simulate` d), where that is one
    half-width read of the mask by a tensor-core GEMM; on a CPU the fp32 product."""
    return (planner._SIMULATED or device).type == "cuda"
