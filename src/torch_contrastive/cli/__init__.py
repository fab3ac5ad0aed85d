"""The ``torch-contrastive`` command line: ``explain``, ``train``, ``embed``, ``bench``.

The core library never imports this package; ``train``, ``embed`` and ``bench`` import
their optional dependencies (scikit-learn, tqdm, matplotlib, Pillow: the ``cli`` extra)
lazily, and say which extra to install when one is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch

from .. import losses
from ..positives import Positives
from ._argtypes import int_list, positive_float, positive_int

LOSS_CHOICES = ("all", "nt_xent", "nt_xent_halves", "nt_xent_pml", "supcon", "nt_bxent")
SEED000_POS = [(0, 0), (0, 2), (0, 4), (1, 4), (1, 6), (1, 1), (2, 3), (3, 7), (4, 3), (7, 6)]


def _matrix(name: str, m: torch.Tensor, fmt: str = "{:7.4f}") -> str:
    lines = [name]
    for row in m.tolist():
        lines.append("  " + " ".join(fmt.format(v) if isinstance(v, float) else f"{int(v):>2d}" for v in row))
    return "\n".join(lines)


def _mask(keys: torch.Tensor) -> torch.Tensor:
    n = keys.numel()
    return Positives.from_keys(keys).tile(0, n, 0, n).int()


def explain(args: argparse.Namespace) -> int:
    """Print the similarity matrix, positive masks and the loss under each convention."""
    torch.manual_seed(args.seed)
    x = torch.randn(args.rows, args.dim).double()  # float32 draw, as the NT-BXent write-up printed it
    n = x.shape[0]
    labels = torch.tensor(args.labels) if args.labels is not None else torch.arange(n) // 2 % max(1, n // 4)
    if labels.numel() != n:
        print(f"error: --labels needs {n} values (one per row), got {labels.numel()}", file=sys.stderr)
        return 2
    tau = args.temperature
    xn = torch.nn.functional.normalize(x, dim=1)
    print(f"Batch: {n} rows x {x.shape[1]} dims (torch.manual_seed({args.seed}); torch.randn), temperature {tau}")
    print(_matrix("Cosine similarity s_ij (self pairs are excluded from every sum):", xn @ xn.T))
    want = set(LOSS_CHOICES[1:]) if args.loss == "all" else {args.loss}
    rows: list[tuple[str, float, str]] = []
    if "nt_xent" in want:
        print(_matrix("\nNT-Xent, pairing='adjacent' (rows stored view by view): positive of row i is i^1", _mask(losses.pair_keys(n, "adjacent"))))
        rows.append(("nt_xent_loss(pairing='adjacent')", losses.nt_xent_loss(x, tau).item(), "two views stored row by row"))
    if "nt_xent_halves" in want:
        print(_matrix("\nNT-Xent, pairing='halves' (SimCLR/SupCon papers): positive of i is i+N", _mask(losses.pair_keys(n, "halves"))))
        halves = losses.nt_xent_loss(x, tau, pairing="halves").item()
        rows.append(("nt_xent_loss(pairing='halves')", halves, "SimCLR paper, SupCon authors' code without labels, lightly"))
    if "nt_xent_pml" in want or "supcon" in want:
        print(_matrix(f"\nSame-label positives for labels {labels.tolist()} (SupCon and PML NT-Xent):", _mask(labels)))
    if "nt_xent_pml" in want:
        rows.append(("nt_xent_loss(labels=...)", losses.nt_xent_loss(x, tau, labels=labels).item(),
                     "pytorch-metric-learning NTXentLoss: one term per positive pair, other positives left out of its denominator"))
    if "supcon" in want:
        rows.append(("supcon_loss(x, labels)", losses.supcon_loss(x, labels, temperature=tau).item(),
                     "SupCon paper / PML SupConLoss: every other row in the denominator"))
    if "nt_bxent" in want:
        pos = torch.tensor([p for p in SEED000_POS if p[0] < n and p[1] < n] or [(0, 0)])
        rows.append(("nt_bxent_loss(pos_indices)", losses.nt_bxent_loss(x, pos, tau).item(),
                     "binary cross-entropy, diagonal counted as a positive"))
        rows.append(("nt_bxent_loss(labels=...)", losses.nt_bxent_loss(x, labels=labels, temperature=tau).item(), "same-label positives"))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'loss':<{width}}  {'value':>10}  convention")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10.6f}  {note}")
    print("\nWhy they differ: with one positive per row NT-Xent and SupCon agree; with several positives SupCon keeps\n"
          "all of them in every denominator while PML's NT-Xent builds one soft-max per positive pair over that\n"
          "positive plus the negatives only (pytorch-metric-learning). NT-BXent scores each pair independently with a sigmoid.")
    return 0


#: Modules of the ``cli`` extra (import name, distribution name).
CLI_EXTRA = (("sklearn", "scikit-learn"), ("tqdm", "tqdm"), ("matplotlib", "matplotlib"), ("PIL", "Pillow"), ("numpy", "numpy"))


def missing_cli_extra() -> list[str]:
    """Distributions of the ``cli`` extra that are not installed."""
    return [dist for module, dist in CLI_EXTRA if importlib.util.find_spec(module) is None]


class _Parser(argparse.ArgumentParser):
    """An argument error is one line (``prog: error: argument --x: expected ...``) and exit
    status 2, without argparse's usage block above it (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torch-contrastive", description="Exact, tiled, distributed contrastive losses.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("explain", help="show the similarity matrix, positive masks and each convention's loss")
    p.add_argument("--rows", type=positive_int, default=8,
                   help="batch rows (default 8: the NT-BXent write-up's batch; even for the NT-Xent pairing rules)")
    p.add_argument("--dim", type=positive_int, default=2, help="embedding size (default 2)")
    p.add_argument("--seed", type=int, default=21, help="torch.manual_seed (default 21 reproduces the NT-BXent write-up's batch)")
    p.add_argument("--labels", type=int_list, default=None, help="comma-separated labels, one per row")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="tau (default 1.0)")
    p.add_argument("--loss", choices=LOSS_CHOICES, default="all", help="which convention(s) to show")
    p.set_defaults(func=explain)

    from .bench import add_bench_parser
    from .embed import add_embed_parser
    from .train_command import add_train_parser

    add_train_parser(sub)
    add_embed_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "explain":
        if args.rows < 2:
            parser.error("--rows must be at least 2")
        if args.rows % 2 and args.loss in ("all", "nt_xent", "nt_xent_halves"):
            parser.error(f"--rows must be even for the NT-Xent pairing rules (2N views), got {args.rows}; "
                         "or choose --loss supcon, nt_xent_pml or nt_bxent")
    missing = missing_cli_extra() if args.command in ("train", "embed", "bench") else []
    if missing:
        print(f"error: torch-contrastive {args.command} needs the 'cli' extra ({', '.join(missing)} not installed): "
              "pip install 'torch-contrastive[cli]'", file=sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
