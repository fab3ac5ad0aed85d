"""``nn.Module`` twins of the functional losses: they only hold hyper-parameters.

Each module stores its options -- validated once, at construction -- and, optionally,
a learnable temperature in CLIP's parameterisation (``logit_scale = log(1 / tau)``,
initialised from ``temperature`` and clamped at ``log(100)`` when used, as OpenAI's
CLIP does; a start below temperature 0.01 is a ``ValueError``: the clamp would hold it there, without
a gradient). ``forward`` accepts the call forms of the peer libraries:
``loss(embeddings, labels)`` (pytorch-metric-learning), ``loss(features, labels)`` /
``loss(features, mask=...)`` (the SupCon authors), ``loss(image_features,
text_features)`` (open_clip).

Options shared by every module (keyword-only): ``normalize``, ``reduction``,
``chunk_size``, ``gather``, ``grad_reduction``, ``eps``, ``validate``, ``backend`` and
``learnable_temperature``; see :mod:`torch_contrastive.options` (checked there once).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from . import _validation as v
from . import options
from .losses import image_text_contrastive_loss, info_nce_loss, nt_bxent_loss, nt_xent_loss, siglip_loss, supcon_loss

__all__ = ["ClipLoss", "DCLLoss", "DCLWLoss", "ImageTextContrastiveLoss", "InfoNCELoss", "NTBXentLoss", "NTXentLoss", "SigLipLoss",
           "SupConLoss"]

#: CLIP clamps its logit scale at 100 (temperature 0.01).
MAX_LOGIT_SCALE = math.log(100.0)
#: The lowest start of a learnable temperature: the clamp's (a start below it would be clamped and
#: never move).
MIN_LEARNABLE_TEMPERATURE = 0.01


_shared_options = options.check  # the options every loss takes, checked once (at construction)

#: ``(fn, tensors, keywords)``: ``fn(*tensors, **keywords)`` -- one functional call.
FunctionalCall = tuple[Callable[..., Tensor], tuple[Tensor, ...], dict[str, Any]]


def _functional_call(module: nn.Module, fn: Callable[..., Tensor], positional: tuple[str, ...], keywords: dict[str, Any],
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> FunctionalCall | None:
    """``module(*args, **kwargs)`` as the one call of ``fn`` its ``forward`` makes: ``forward``'s arguments bound by
    name, those named in ``positional`` passed positionally (a tensor each, in that order), the rest as keywords
    after the module's own ``keywords``; keywords at ``fn``'s defaults are left out (a caller reading the call sees
    only what differs). None when the arguments do not bind to ``forward`` (the call itself says why)."""
    try:
        named = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    except TypeError:
        return None
    tensors = tuple(named.pop(name) for name in positional if name in named)
    if any(not isinstance(t, Tensor) for t in tensors):
        return None  # a missing or wrong positional input: the call itself says why
    defaults = {name: param.default for name, param in inspect.signature(fn).parameters.items()}
    given = {**keywords, **named}
    return fn, tensors, {name: value for name, value in given.items() if not _is_default(value, defaults.get(name, inspect.Parameter.empty))}


def _is_default(value: object, default: object) -> bool:
    if value is default:
        return True
    plain = (bool, int, float, str, type(None))
    return isinstance(value, plain) and isinstance(default, plain) and type(value) is type(default) and value == default


class _Loss(nn.Module):
    """Common state: a fixed temperature or a learnable ``logit_scale``, and the shared options."""

    def __init__(self, temperature: float, *,
                 learnable_temperature: bool = False, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean", eps: float = 1e-12,
                 validate: bool = True, backend: str = "auto") -> None:
        super().__init__()
        temperature = v.check_positive(temperature, "temperature")
        self.options = _shared_options(normalize=normalize, reduction=reduction, chunk_size=chunk_size, gather=gather,
                                       grad_reduction=grad_reduction, eps=eps, validate=validate, backend=backend)
        self.learnable = v.check_flag(learnable_temperature, "learnable_temperature")
        if self.learnable:
            # the clamp (CLIP's logit scale <= 100) would hide a start below 0.01 and give it no gradient
            if temperature < MIN_LEARNABLE_TEMPERATURE:
                raise ValueError(f"temperature must be at least {MIN_LEARNABLE_TEMPERATURE} with learnable_temperature=True "
                                 f"(the learnable logit scale is clamped at 100, as CLIP's), got {temperature}")
            self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / temperature)))
        else:
            self.fixed_temperature = temperature

    @property
    def temperature(self) -> float | Tensor:
        """The temperature in use: a float, or a 0-dim tensor with a gradient path."""
        if self.learnable:
            return torch.exp(-self.logit_scale.clamp(max=MAX_LOGIT_SCALE))
        return self.fixed_temperature

    def extra_repr(self) -> str:
        head = f"logit_scale={float(self.logit_scale.detach()):.4f}" if self.learnable else f"temperature={self.fixed_temperature}"
        return ", ".join([head, *(f"{k}={val!r}" for k, val in self._own_options().items()), f"reduction={self.options['reduction']!r}"])

    def _own_options(self) -> dict[str, Any]:
        return {}

    #: The functional loss ``forward`` calls, and ``forward``'s inputs it passes positionally (in that order).
    _function: ClassVar[Callable[..., Tensor]]
    _positional: ClassVar[tuple[str, ...]] = ()

    def _keywords(self) -> dict[str, Any]:
        """The module's own options, as keywords of :attr:`_function` (the shared options aside)."""
        return {}

    def functional(self, *args: Any, **kwargs: Any) -> FunctionalCall | None:
        """The one functional call ``self(*args, **kwargs)`` makes, as ``(fn, tensors, keywords)``:
        ``fn(*tensors, **keywords)`` is the same loss, with the module's temperature (a learnable one
        as a tensor with its gradient path) and options; keywords at ``fn``'s defaults are left out.
        None when the arguments do not bind to ``forward`` or ``forward`` does more than that one call.
        :func:`~torch_contrastive.matryoshka_loss` reads it to run a module's loss in one pass."""
        return _functional_call(self, type(self)._function, self._positional,
                                {"temperature": self.temperature, **self._keywords(), **self.options}, args, kwargs)


class NTXentLoss(_Loss):
    """Module form of :func:`~torch_contrastive.nt_xent_loss`.

    Example:
        >>> loss_fn = NTXentLoss(temperature=0.5, pairing="halves")
        >>> loss = loss_fn(torch.cat([view1, view2]))          # SimCLR
        >>> loss = loss_fn(embeddings, labels)                 # pytorch-metric-learning form
    """

    def __init__(self, temperature: float = 0.5, *, pairing: str = "adjacent", decoupled: bool = False,
                 learnable_temperature: bool = False, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean", eps: float = 1e-12,
                 validate: bool = True, backend: str = "auto") -> None:
        super().__init__(temperature, learnable_temperature=learnable_temperature, normalize=normalize, reduction=reduction,
                         chunk_size=chunk_size, gather=gather, grad_reduction=grad_reduction, eps=eps, validate=validate,
                         backend=backend)
        self.pairing = v.check_choice(pairing, "pairing", v.PAIRINGS)
        self.decoupled = v.check_flag(decoupled, "decoupled")

    _function = staticmethod(nt_xent_loss)
    _positional = ("embeddings",)

    def forward(self, embeddings: Tensor, labels: Tensor | None = None, memory_emb: Tensor | None = None,
                memory_labels: Tensor | None = None, positive_weight: Tensor | None = None, ref_emb: Tensor | None = None,
                ref_labels: Tensor | None = None) -> Tensor:
        return nt_xent_loss(embeddings, self.temperature, labels=labels, memory_emb=memory_emb, memory_labels=memory_labels,
                            positive_weight=positive_weight, ref_emb=ref_emb, ref_labels=ref_labels, **self._keywords(),
                            **self.options)

    def _keywords(self) -> dict[str, Any]:
        return {"pairing": self.pairing, "decoupled": self.decoupled}

    def _own_options(self) -> dict[str, Any]:
        return self._keywords()


class NTBXentLoss(_Loss):
    """Module form of :func:`~torch_contrastive.nt_bxent_loss`: ``loss(embeddings, pos_indices)``
    or ``loss(embeddings, labels=labels)``."""

    def __init__(self, temperature: float = 0.5, *,
                 learnable_temperature: bool = False, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean", eps: float = 1e-12,
                 validate: bool = True, backend: str = "auto") -> None:
        super().__init__(temperature, learnable_temperature=learnable_temperature, normalize=normalize, reduction=reduction,
                         chunk_size=chunk_size, gather=gather, grad_reduction=grad_reduction, eps=eps, validate=validate,
                         backend=backend)

    _function = staticmethod(nt_bxent_loss)
    _positional = ("embeddings",)

    def forward(self, embeddings: Tensor, pos_indices: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        return nt_bxent_loss(embeddings, pos_indices, self.temperature, labels=labels, **self.options)


class ImageTextContrastiveLoss(_Loss):
    """Module form of :func:`~torch_contrastive.image_text_contrastive_loss` (alias ``ClipLoss``).

    ``learnable_temperature=True`` owns CLIP's ``logit_scale`` (init ``log(1/0.07)``,
    clamped at ``log(100)``); put the module's parameters in the optimiser.

    Example:
        >>> loss_fn = ClipLoss(learnable_temperature=True)
        >>> loss = loss_fn(image_features, text_features, text_id=text_ids(captions))
    """

    def __init__(self, temperature: float = 0.07, *, decoupled: bool = False, label_smoothing: float = 0.0,
                 learnable_temperature: bool = False, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean", eps: float = 1e-12,
                 validate: bool = True, backend: str = "auto") -> None:
        super().__init__(temperature, learnable_temperature=learnable_temperature, normalize=normalize, reduction=reduction,
                         chunk_size=chunk_size, gather=gather, grad_reduction=grad_reduction, eps=eps, validate=validate,
                         backend=backend)
        self.decoupled = v.check_flag(decoupled, "decoupled")
        self.label_smoothing = v.check_fraction(label_smoothing, "label_smoothing")

    _function = staticmethod(image_text_contrastive_loss)
    _positional = ("image_features", "text_features")

    @v.in_callers_words(image_feat="image_features", text_feat="text_features")
    def forward(self, image_features: Tensor, text_features: Tensor, image_id: Tensor | None = None,
                text_id: Tensor | None = None) -> Tensor:
        return image_text_contrastive_loss(image_features, text_features, self.temperature, image_id, text_id,
                                           **self._keywords(), **self.options)

    def _keywords(self) -> dict[str, Any]:
        return {"decoupled": self.decoupled, "label_smoothing": self.label_smoothing}

    def _own_options(self) -> dict[str, Any]:
        return self._keywords()


ClipLoss = ImageTextContrastiveLoss


class SupConLoss(_Loss):
    """Module form of :func:`~torch_contrastive.supcon_loss`.

    ``loss(features, labels)`` with (bsz, n_views, D) features as in the authors' code,
    or (N, D) embeddings as in pytorch-metric-learning; ``loss(features)`` is SimCLR.
    """

    def __init__(self, temperature: float = 0.07, *, base_temperature: float | None = None,
                 contrast_mode: str = "all", single_class: str = "keep",
                 learnable_temperature: bool = False, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean", eps: float = 1e-12,
                 validate: bool = True, backend: str = "auto") -> None:
        super().__init__(temperature, learnable_temperature=learnable_temperature, normalize=normalize, reduction=reduction,
                         chunk_size=chunk_size, gather=gather, grad_reduction=grad_reduction, eps=eps, validate=validate,
                         backend=backend)
        self.base_temperature = None if base_temperature is None else v.check_positive(base_temperature, "base_temperature")
        self.contrast_mode = v.check_choice(contrast_mode, "contrast_mode", v.CONTRAST_MODES)
        self.single_class = v.check_choice(single_class, "single_class", ("keep", "zero"))

    _function = staticmethod(supcon_loss)
    _positional = ("features",)

    def forward(self, features: Tensor, labels: Tensor | None = None, mask: Tensor | None = None,
                memory_emb: Tensor | None = None, memory_labels: Tensor | None = None, ref_emb: Tensor | None = None,
                ref_labels: Tensor | None = None) -> Tensor:
        return supcon_loss(features, labels, mask, self.temperature, memory_emb=memory_emb, memory_labels=memory_labels,
                           ref_emb=ref_emb, ref_labels=ref_labels, **self._keywords(), **self.options)

    def _keywords(self) -> dict[str, Any]:
        return {"base_temperature": self.base_temperature, "contrast_mode": self.contrast_mode, "single_class": self.single_class}

    def _own_options(self) -> dict[str, Any]:
        return self._keywords()


class InfoNCELoss(_Loss):
    """Module form of :func:`~torch_contrastive.info_nce_loss`: ``loss(query, key)`` or
    ``loss(query, key, negatives)`` (info-nce-pytorch's call form); per-batch ids and guide
    embeddings go to ``forward``.

    Example:
        >>> loss_fn = InfoNCELoss(0.07, in_batch_negatives=False)      # MoCo
        >>> loss = loss_fn(q, k, queue.features)
        >>> queue.push(k)
    """

    def __init__(self, temperature: float = 0.07, *, negative_mode: str = "unpaired", in_batch_negatives: bool = True,
                 gather_negatives: bool | None = None, guide_margin: float = 0.0, guide_margin_mode: str = "absolute",
                 decoupled: bool = False, label_smoothing: float = 0.0,
                 learnable_temperature: bool = False, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean", eps: float = 1e-12,
                 validate: bool = True, backend: str = "auto") -> None:
        super().__init__(temperature, learnable_temperature=learnable_temperature, normalize=normalize, reduction=reduction,
                         chunk_size=chunk_size, gather=gather, grad_reduction=grad_reduction, eps=eps, validate=validate,
                         backend=backend)
        self.negative_mode = v.check_choice(negative_mode, "negative_mode", v.NEGATIVE_MODES)
        self.in_batch_negatives = v.check_flag(in_batch_negatives, "in_batch_negatives")
        if gather_negatives is not None and not isinstance(gather_negatives, bool):
            raise TypeError(f"gather_negatives must be None or a bool, got {type(gather_negatives).__name__}")
        self.gather_negatives = gather_negatives
        self.guide_margin = guide_margin
        self.guide_margin_mode = guide_margin_mode
        self.decoupled = v.check_flag(decoupled, "decoupled")
        self.label_smoothing = v.check_fraction(label_smoothing, "label_smoothing")

    _function = staticmethod(info_nce_loss)
    _positional = ("query", "key", "negatives")

    def forward(self, query: Tensor, key: Tensor, negatives: Tensor | None = None, key_ids: Tensor | None = None,
                negative_ids: Tensor | None = None, guide: tuple[Tensor, ...] | None = None) -> Tensor:
        return info_nce_loss(query, key, negatives, self.temperature, key_ids=key_ids, negative_ids=negative_ids, guide=guide,
                             **self._keywords(), **self.options)

    def _keywords(self) -> dict[str, Any]:
        return {"negative_mode": self.negative_mode, "in_batch_negatives": self.in_batch_negatives,
                "gather_negatives": self.gather_negatives, "guide_margin": self.guide_margin,
                "guide_margin_mode": self.guide_margin_mode, "decoupled": self.decoupled, "label_smoothing": self.label_smoothing}

    def _own_options(self) -> dict[str, Any]:
        return {"negative_mode": self.negative_mode, "in_batch_negatives": self.in_batch_negatives,
                **({"decoupled": True} if self.decoupled else {})}


class DCLLoss(_Loss):
    """Decoupled contrastive loss (Yeh et al. 2021) in lightly's call form ``loss(out0, out1)``.

    NT-Xent over ``torch.cat([out0, out1])`` (``pairing="halves"``) with each row's positive
    left out of its denominator: ``nt_xent_loss(..., decoupled=True)``. ``gather=True`` is
    lightly's ``gather_distributed``.

    Args:
        weight_fn: lightly's optional ``weight_fn(out0, out1) -> (N,)``: the positive term
            of the rows of ``out0`` is multiplied by ``weight_fn(out0, out1)`` and that of
            the rows of ``out1`` by ``weight_fn(out1, out0)``, both called on the
            L2-normalised outputs (``normalize=True``). Gradients flow through the weights
            as in lightly (not combined with ``gather``).
    """

    def __init__(self, temperature: float = 0.1, weight_fn: Callable[[Tensor, Tensor], Tensor] | None = None, *,
                 learnable_temperature: bool = False, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean", eps: float = 1e-12,
                 validate: bool = True, backend: str = "auto") -> None:
        super().__init__(temperature, learnable_temperature=learnable_temperature, normalize=normalize, reduction=reduction,
                         chunk_size=chunk_size, gather=gather, grad_reduction=grad_reduction, eps=eps, validate=validate,
                         backend=backend)
        if weight_fn is not None and not callable(weight_fn):
            raise TypeError(f"weight_fn must be callable or None, got {type(weight_fn).__name__}")
        if weight_fn is not None and gather:
            raise ValueError("weight_fn is not combined with gather=True")
        self.weight_fn = weight_fn

    def positive_weight(self, out0: Tensor, out1: Tensor) -> Tensor | None:
        """(2N,) weights of the positive terms (rows of out0, then of out1), or None."""
        if self.weight_fn is None:
            return None
        a, b = self._unit(out0), self._unit(out1)
        weights = [self.weight_fn(a, b), self.weight_fn(b, a)]
        for w in weights:
            if not isinstance(w, Tensor) or w.shape != (out0.shape[0],):
                raise ValueError(f"weight_fn must return a ({out0.shape[0]},) tensor, got {getattr(w, 'shape', type(w).__name__)}")
        return torch.cat(weights)

    def _unit(self, x: Tensor) -> Tensor:
        x = x if x.dtype == torch.float64 else x.float()
        return torch.nn.functional.normalize(x, dim=1, eps=self.options["eps"]) if self.options["normalize"] else x

    def functional(self, *args: Any, **kwargs: Any) -> FunctionalCall | None:
        """NT-Xent with ``decoupled=True`` over ``torch.cat([out0, out1])`` (``pairing="halves"``); weights read
        off the outputs (``weight_fn``, DCLW) as a ``positive_weight`` of each prefix's own (a ``PerPrefix``:
        :meth:`positive_weight` of the outputs cut to the prefix and normalised, as one call per prefix sees them)."""
        from .losses.prefix_calls import shrink
        from .losses.prefix_weights import PerPrefix

        call = _functional_call(self, nt_xent_loss, ("out0", "out1"), {"temperature": self.temperature, "pairing": "halves",
                                                                       "decoupled": True, **self.options}, args, kwargs)
        if call is None or len(call[1]) != 2 or call[1][0].shape != call[1][1].shape:
            return None  # the call itself says what is wrong
        fn, (out0, out1), keywords = call
        if self.positive_weight_depends_on_inputs():
            keywords["positive_weight"] = PerPrefix(lambda d: _must(self.positive_weight(shrink(out0, d), shrink(out1, d))))
        return fn, (torch.cat([out0, out1.to(out0.dtype)]),), keywords

    def positive_weight_depends_on_inputs(self) -> bool:
        """Whether the positive terms are weighted by a function of the outputs."""
        return self.weight_fn is not None

    def forward(self, out0: Tensor, out1: Tensor) -> Tensor:
        v.check_embeddings(out0, "out0")
        v.check_embeddings(out1, "out1")
        v.check_same_rows(out0, "out0", out1, "out1")
        # a weight that requires grad (lightly's weight_fn) gets its gradient from the loss itself
        try:
            return nt_xent_loss(torch.cat([out0, out1.to(out0.dtype)]), self.temperature, pairing="halves", decoupled=True,
                                positive_weight=self.positive_weight(out0, out1), **self.options)
        except ValueError as err:  # the loss sees one stacked tensor: a non-finite row is named in out0 or out1
            named = v.named_non_finite(err, (("out0", out0), ("out1", out1)))  # a non-finite input first: the weights follow it
            if named is err and "positive_weight" in str(err):  # the caller never passed one: the weights are weight_fn's
                raise ValueError(str(err).replace("positive_weight", "the weights weight_fn returned")) from None
            raise named from None


def _must(weight: Tensor | None) -> Tensor:
    if weight is None:
        raise RuntimeError("internal: a weighted DCL gives its weights")
    return weight


class DCLWLoss(DCLLoss):
    """Weighted DCL: the positive term of pair i is weighted by the von Mises-Fisher factor
    ``w_i = 2 - N * softmax_i(<o0_i, o1_i> / sigma)`` on L2-normalised outputs, detached (as
    lightly's ``DCLWLoss``; the softmax runs over this rank's N pairs)."""

    def __init__(self, temperature: float = 0.1, sigma: float = 0.5, *,
                 learnable_temperature: bool = False, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean", eps: float = 1e-12,
                 validate: bool = True, backend: str = "auto") -> None:
        super().__init__(temperature, None, learnable_temperature=learnable_temperature, normalize=normalize, reduction=reduction,
                         chunk_size=chunk_size, gather=gather, grad_reduction=grad_reduction, eps=eps, validate=validate,
                         backend=backend)
        self.sigma = v.check_positive(sigma, "sigma")

    def positive_weight_depends_on_inputs(self) -> bool:
        return True

    def positive_weight(self, out0: Tensor, out1: Tensor) -> Tensor | None:
        with torch.no_grad():
            a = torch.nn.functional.normalize(out0.detach().float() if out0.dtype != torch.float64 else out0.detach(), dim=1)
            b = torch.nn.functional.normalize(out1.detach().to(a.dtype), dim=1)
            w = 2 - out0.shape[0] * torch.softmax((a * b).sum(1) / self.sigma, dim=0)
            return torch.cat([w, w])

    def _own_options(self) -> dict[str, Any]:
        return {"sigma": self.sigma}


class SigLipLoss(nn.Module):
    """Module form of :func:`~torch_contrastive.siglip_loss` with its own scale and bias.

    ``logit_scale`` holds ``log t`` (used as ``exp(logit_scale)``) and ``logit_bias`` holds
    ``b``, initialised as in the SigLIP paper (``t = 10``, ``b = -10``); with
    ``learnable=False`` both are fixed buffers. Options as for the other modules.

    Example:
        >>> loss_fn = SigLipLoss()
        >>> loss = loss_fn(image_features, text_features)          # put loss_fn's parameters in the optimiser
    """

    def __init__(self, init_logit_scale: float = 10.0, init_logit_bias: float = -10.0, *, learnable: bool = True,
                 normalize: bool = True, reduction: str = "mean", chunk_size: int | None = None, gather: bool = False,
                 grad_reduction: str = "mean", eps: float = 1e-12,
                 validate: bool = True, backend: str = "auto") -> None:
        super().__init__()
        scale = v.check_positive(init_logit_scale, "init_logit_scale")
        if isinstance(init_logit_bias, bool) or not isinstance(init_logit_bias, (int, float)) or not math.isfinite(init_logit_bias):
            raise ValueError(f"init_logit_bias must be a finite float, got {init_logit_bias!r}")
        self.options = _shared_options(normalize=normalize, reduction=reduction, chunk_size=chunk_size, gather=gather,
                                       grad_reduction=grad_reduction, eps=eps, validate=validate, backend=backend)
        self.learnable = v.check_flag(learnable, "learnable")
        log_scale = torch.tensor(math.log(scale))
        bias = torch.tensor(float(init_logit_bias))
        if self.learnable:
            self.logit_scale = nn.Parameter(log_scale)
            self.logit_bias = nn.Parameter(bias)
        else:
            self.register_buffer("logit_scale", log_scale)
            self.register_buffer("logit_bias", bias)

    def functional(self, *args: Any, **kwargs: Any) -> FunctionalCall | None:
        """The one :func:`~torch_contrastive.siglip_loss` call ``self(*args, **kwargs)`` makes (see
        :meth:`ImageTextContrastiveLoss.functional`): the scale ``exp(logit_scale)`` and the bias as tensors."""
        return _functional_call(self, siglip_loss, ("image_features", "text_features"),
                                {"logit_scale": self.logit_scale.exp(), "logit_bias": self.logit_bias, **self.options}, args, kwargs)

    @v.in_callers_words(image_feat="image_features", text_feat="text_features")
    def forward(self, image_features: Tensor, text_features: Tensor, image_id: Tensor | None = None,
                text_id: Tensor | None = None, negative_only: bool = False) -> Tensor:
        return siglip_loss(image_features, text_features, self.logit_scale.exp(), self.logit_bias, image_id, text_id,
                           negative_only=negative_only, **self.options)

    def extra_repr(self) -> str:
        return (f"logit_scale=exp({float(self.logit_scale.detach()):.4f}), logit_bias={float(self.logit_bias.detach()):.4f}, "
                f"learnable={self.learnable}, reduction={self.options['reduction']!r}")
