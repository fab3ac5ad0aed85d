"""torch-contrastive: exact, tiled, distributed-correct contrastive losses for PyTorch.

Functional API: :func:`nt_xent_loss`, :func:`nt_bxent_loss`,
:func:`image_text_contrastive_loss` (alias :func:`clip_loss`), :func:`supcon_loss`,
:func:`siglip_loss`, :func:`info_nce_loss`; over embedding prefixes in one pass:
:func:`matryoshka_info_nce_loss` (any loss, per prefix: :func:`matryoshka_loss`).
Module twins: :class:`NTXentLoss`, :class:`NTBXentLoss`,
:class:`ImageTextContrastiveLoss` (alias :class:`ClipLoss`), :class:`SupConLoss`,
:class:`SigLipLoss`, :class:`InfoNCELoss`, :class:`DCLLoss`, :class:`DCLWLoss`. Candidates beyond the batch:
:class:`FeatureQueue` (MoCo queue / memory bank). Batches beyond activation memory:
:func:`grad_cache` (replay context: :class:`RngSnapshot`). What the engine will do with a call (backend, tiles, tensor-core products):
:func:`explain`.
"""

from .distributed import all_gather_with_grad
from .engine.planner import Decision
from .engine.recorded import explain
from .grad_cache import RngSnapshot, grad_cache
from .losses import (
    GlobalContrastiveLoss,
    clip_loss,
    global_contrastive_loss,
    image_text_contrastive_loss,
    info_nce_loss,
    matryoshka_info_nce_loss,
    matryoshka_loss,
    nt_bxent_loss,
    nt_xent_loss,
    pair_keys,
    siglip_loss,
    supcon_loss,
    text_ids,
)
from .modules import (
    ClipLoss,
    DCLLoss,
    DCLWLoss,
    ImageTextContrastiveLoss,
    InfoNCELoss,
    NTBXentLoss,
    NTXentLoss,
    SigLipLoss,
    SupConLoss,
)
from .positives import Positives
from .queue import FeatureQueue

__version__ = "0.1.0"

__all__ = [
    "ClipLoss",
    "DCLLoss",
    "DCLWLoss",
    "Decision",
    "FeatureQueue",
    "GlobalContrastiveLoss",
    "ImageTextContrastiveLoss",
    "InfoNCELoss",
    "NTBXentLoss",
    "NTXentLoss",
    "Positives",
    "RngSnapshot",
    "SigLipLoss",
    "SupConLoss",
    "all_gather_with_grad",
    "clip_loss",
    "explain",
    "global_contrastive_loss",
    "grad_cache",
    "image_text_contrastive_loss",
    "info_nce_loss",
    "matryoshka_info_nce_loss",
    "matryoshka_loss",
    "nt_bxent_loss",
    "nt_xent_loss",
    "pair_keys",
    "siglip_loss",
    "supcon_loss",
    "text_ids",
]
