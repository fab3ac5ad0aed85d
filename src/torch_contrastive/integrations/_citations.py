"""The papers behind the sentence-transformers drop-ins, as BibTeX: each loss's ``citation``, which the trainer's
model card prints as the peer's does."""

from __future__ import annotations

__all__ = ["GIST", "GRADCACHE", "GTE", "MATRYOSHKA", "SMART_REPLY"]

#: MultipleNegativesRankingLoss: in-batch negatives for response selection
SMART_REPLY = """@article{henderson2017efficient,
    title = {Efficient Natural Language Response Suggestion for Smart Reply},
    author = {Matthew Henderson and Rami Al-Rfou and Brian Strope and Yun-Hsuan Sung and L{\\'a}szl{\\'o} Luk{\\'a}cs and Ruiqi Guo
              and Sanjiv Kumar and Balint Miklos and Ray Kurzweil},
    journal = {arXiv preprint arXiv:1705.00652},
    year = {2017}
}"""

#: every direction in one soft-max (the improved contrastive loss of GTE)
GTE = """@article{li2023towards,
    title = {Towards General Text Embeddings with Multi-stage Contrastive Learning},
    author = {Zehan Li and Xin Zhang and Yanzhao Zhang and Dingkun Long and Pengjun Xie and Meishan Zhang},
    journal = {arXiv preprint arXiv:2308.03281},
    year = {2023}
}"""

#: gradient caching
GRADCACHE = """@inproceedings{gao2021scaling,
    title = {Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author = {Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    booktitle = {Proceedings of the 6th Workshop on Representation Learning for NLP},
    year = {2021},
    eprint = {2101.06983}
}"""

#: the guided in-sample selection of negatives
GIST = """@article{solatorio2024gistembed,
    title = {GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning},
    author = {Aivin V. Solatorio},
    journal = {arXiv preprint arXiv:2402.16829},
    year = {2024}
}"""

#: nested (prefix) embeddings
MATRYOSHKA = """@inproceedings{kusupati2022matryoshka,
    title = {Matryoshka Representation Learning},
    author = {Aditya Kusupati and Gantavya Bhatt and Aniket Rege and Matthew Wallingford and Aditya Sinha and Vivek Ramanujan
              and William Howard-Snyder and Kaifeng Chen and Sham Kakade and Prateek Jain and Ali Farhadi},
    booktitle = {Advances in Neural Information Processing Systems},
    year = {2022},
    eprint = {2205.13147}
}"""
