"""Which strategy ``backend="auto"`` runs, per device: one ordered list of rules, the first that covers the call and
whose strategy serves it wins (:data:`~.strategies.STRATEGIES`, each strategy's ``serves``).

A rule names a strategy and the calls it takes (the statistic, the dtype, the smallest size); its crossover comes from a
measured row -- the device, the commit and the command that measured it, in docs/gpu.md -- never from a model's
prediction. A strategy that no GPU has run is not in the CUDA list; an explicit ``backend=`` still reaches every
strategy the engine has (refused with the strategy's reason when it does not serve the call).

The CUDA list, read against docs/gpu.md ("Measured: one H100, 2026-11-24", commit 04b01f4): every call below about
8,192 rows is host-bound there, and the torch loops (no Triton launch) beat the epilogue at 1,024 and 4,096 rows
(CLIP 3.6 against 6.2 ms, 3.8 against 5.0; NT-Xent 4,096: 3.1 against 4.1); at 8,192 the epilogue is ahead (CLIP 4.9
against 5.3 ms, NT-Xent 3.2 against 3.7, SupCon 5.5 against 7.0) and from 16,384 rows it is the measured default
(CLIP 16,384 x 768: 7.6 ms; 65,536 x 768: 77 ms against the torch loops' 226 ms on 2026-11-23). Only bf16 soft-max
terms were measured on the epilogue; the pair and sigmoid terms, fp32 and fp16 stay on the torch loops, the CPU's
default, which issue only device-agnostic ATen ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["CPU", "CUDA", "Rule", "choose"]


@dataclass(frozen=True)
class Rule:
    """One entry of a device's policy.

    Attributes:
        strategy: the strategy the rule runs, by name (:data:`~.strategies.STRATEGIES`: ``"torch"``, ``"epilogue"``).
        kernel: the statistic it takes (``"softmax"``, ``"pairwise"``, ``"sigmoid"``); None: any.
        dtypes: the input dtypes it takes (both sides); empty: any.
        from_rows: the smallest size it takes: the measured crossover, in rows of a square problem. A call of ``R x C``
            logits is placed by the side of the square with as many, ``sqrt(R C)`` (the measured rows were square;
            the work and the host's share scale with the logits, not with the longer side).
        measured: where the crossover comes from (device, commit, date, the docs' table).
    """

    strategy: str
    kernel: str | None = None
    dtypes: tuple[torch.dtype, ...] = ()
    from_rows: int = 0
    measured: str = ""

    def takes(self, kernel: str, side: int, dtype: torch.dtype, other_dtype: torch.dtype) -> bool:
        """Whether the call is one this rule covers (not yet whether its backend serves it)."""
        return ((self.kernel is None or self.kernel == kernel) and side >= self.from_rows
                and (not self.dtypes or (dtype in self.dtypes and other_dtype == dtype)))

    def reason(self) -> str:
        """The rule in words, for :func:`~.recorded.explain`."""
        what = [self.kernel or "any statistic"]
        if self.dtypes:
            what.append("/".join(str(d).removeprefix("torch.") for d in self.dtypes))
        if self.from_rows:
            what.append(f"from {self.from_rows:,} rows")
        source = f" (measured: {self.measured})" if self.measured else ""
        return f"policy: {self.strategy} for {', '.join(what)}{source}"


_H100 = "H100, commit 04b01f4, 2026-11-24, docs/gpu.md"

#: The GPU's rules in order.
CUDA: tuple[Rule, ...] = (
    Rule("epilogue", kernel="softmax", dtypes=(torch.bfloat16,), from_rows=8192, measured=_H100),
    Rule("torch", measured=_H100 + ": host-bound below 8,192 rows, where no Triton launch wins"),
)
#: The CPU's: the torch loops.
CPU: tuple[Rule, ...] = (Rule("torch"),)


def choose(device: str, kernel: str, side: int, dtype: torch.dtype, other_dtype: torch.dtype,
           serves: Callable[[str], str | None]) -> tuple[str, str]:
    """``(strategy, reason)``: the first rule of ``device``'s policy that covers the call and whose strategy serves
    it (``serves(name)`` is None; asked only of the rules that cover the call). Every policy ends with the torch
    loops, which serve every call."""
    for rule in CUDA if device == "cuda" else CPU:
        if rule.takes(kernel, side, dtype, other_dtype) and serves(rule.strategy) is None:
            return rule.strategy, rule.reason()
    raise RuntimeError(f"no rule of the {device!r} policy served the call")  # the last rule takes every call
