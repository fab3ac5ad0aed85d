"""Drop-in call forms of the losses other libraries' users already train with.

Each submodule mirrors one peer's classes (names, arguments, call forms) and computes
with this package, so a training script swaps an import and keeps the rest:

* :mod:`~torch_contrastive.integrations.sentence_transformers`: ``MultipleNegativesRankingLoss``
  (directions, partition modes, hardness weighting), ``CachedMultipleNegativesRankingLoss``
  (gradient caching, token budget) and ``GISTEmbedLoss``; usable as ``loss=`` of a
  sentence-transformers trainer.
* :mod:`~torch_contrastive.integrations.open_clip`: ``ClipLoss`` and ``SigLipLoss`` in
  open_clip's call form, with its distributed options.

lightly's memory bank is an option of :class:`~torch_contrastive.FeatureQueue`
(``fill="random"``, ``overflow="drop"``) and pytorch-metric-learning's conventions are
options of the losses (``single_class="zero"``, ``ref_emb``/``ref_labels``); see the docs'
"Peers" page. Nothing here imports a peer at ``import torch_contrastive``.
"""
