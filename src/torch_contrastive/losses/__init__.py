"""The contrastive losses, functional form: one module per loss family.

* :mod:`.nt_xent` -- NT-Xent (SimCLR, Chen et al. 2020; pytorch-metric-learning's labelled form)
* :mod:`.nt_bxent` -- NT-BXent (multi-positive binary cross-entropy)
* :mod:`.image_text` -- the CLIP/ALIGN image-text loss with duplicate ids (Radford et al. 2021, Jia et al. 2021)
* :mod:`.supcon` -- SupCon (Khosla et al. 2020)
* :mod:`.siglip` -- SigLIP, the sigmoid image-text loss (Zhai et al. 2023)
* :mod:`.info_nce` -- InfoNCE with hard negatives and queues (MNRL, info-nce-pytorch, MoCo)
* :mod:`.global_contrastive` -- global contrastive losses with per-sample state (SogCLR, FastCLIP's GCL)
* :mod:`.matryoshka` -- InfoNCE summed over embedding prefixes in one pass (Matryoshka, Kusupati et al. 2022)

Shared pieces: every call's set-up and finish (options, scope, checks, reduction) in
:mod:`._prologue`, relations by pairing rules and ids in :mod:`._pairing`, the labelled losses'
memory, reference set and label-sorted tiles in :mod:`._labelled`;
the tiled math in :mod:`torch_contrastive.engine`; positives in
:mod:`torch_contrastive.positives`.
"""

from ._pairing import pair_keys
from .global_contrastive import GlobalContrastiveLoss, global_contrastive_loss
from .image_text import clip_loss, image_text_contrastive_loss, text_ids
from .info_nce import info_nce_loss
from .matryoshka import matryoshka_info_nce_loss, matryoshka_loss
from .nt_bxent import nt_bxent_loss
from .nt_xent import nt_xent_loss
from .siglip import siglip_loss
from .supcon import supcon_loss

__all__ = [
    "GlobalContrastiveLoss",
    "clip_loss",
    "global_contrastive_loss",
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
