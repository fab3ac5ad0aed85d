"""Helpers shared by the test modules: float64 comparisons and per-dtype tolerances.

Every value test compares the library on the suite's device (:data:`device.DEVICE`) with an
independent float64 reference (``reference.py``) through :func:`compare`.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from device import DEVICE

__all__ = ["DTYPES", "TAU_TOLS", "compare", "count_applies", "queue_problem", "rand_rows", "softmax_cases", "two_set_problem"]


def count_applies(monkeypatch, functions):
    """How many calls the autograd ``functions`` served, all together (a list with one counter, which their
    ``apply``, wrapped for the test, advances)."""
    count = [0]

    def counting(real):
        def counted(*args):
            count[0] += 1
            return real(*args)
        return counted

    for fn in functions:
        monkeypatch.setattr(fn, "apply", counting(fn.apply))
    return count


def rand_rows(n, d=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)


#: On a GPU the half inputs' products run on tensor cores and the gradient tile is rounded to the input
#: dtype for the two backward products (docs/gpu.md): its rounding adds to the gradients' own, twice
#: the CPU's bound for bf16 (seen on an H100: 1.02e-2 against 1e-2 at an entry whose terms cancel).
_GPU_ROUNDING = 2.0 if DEVICE.type == "cuda" else 1.0

TAU_TOLS = {torch.bfloat16: 2e-3 * _GPU_ROUNDING, torch.float16: 5e-4 * _GPU_ROUNDING}


def compare(fn_ours, fn_ref, inputs, tau, dtype, tols):
    """Value and gradients (inputs and temperature) of ours vs the float64 reference.

    Inputs are rounded to ``dtype`` first and the reference runs on those rounded values,
    so the difference is the library's own arithmetic (ours on the suite's device, the
    reference on the CPU): ``tols = (value, gradient)``
    relative tolerances (gradients relative to the largest reference gradient; half
    precision gradients are rounded to the input dtype).
    """
    rtol, grad_tol = tols
    rounded = [x.detach().to(dtype) for x in inputs]
    ref_in = [x.double().clone().requires_grad_() for x in rounded]
    ref_tau = torch.tensor(tau, dtype=torch.float64, requires_grad=True)
    ref = fn_ref(*ref_in, ref_tau)
    ref.backward()
    our_in = [x.clone().detach().to(DEVICE).requires_grad_() for x in rounded]
    our_tau = torch.tensor(tau, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=DEVICE, requires_grad=True)
    ours = fn_ours(*our_in, our_tau)
    ours.backward()
    assert ours.device.type == DEVICE.type
    assert ours.item() == pytest.approx(ref.item(), rel=rtol, abs=rtol)
    for a, b in zip(our_in, ref_in):
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad.double().cpu(), b.grad, rtol=grad_tol, atol=grad_tol * max(1.0, b.grad.abs().max().item()))
    # d tau sums the gradient tile against the logits: on a GPU the tile is rounded to the input's
    # half dtype for the tensor-core products (2^-9 relative for bf16, 2^-12 for fp16)
    tau_tol = TAU_TOLS.get(dtype, 10 * rtol)
    assert our_tau.grad.item() == pytest.approx(ref_tau.grad.item(), rel=tau_tol, abs=tau_tol * max(1.0, abs(ref_tau.grad.item())))


DTYPES = [
    (torch.float64, (1e-9, 1e-9)),
    (torch.float32, (1e-5, 1e-5)),
    (torch.float16, (2e-5, 2e-3 * _GPU_ROUNDING)),  # computed in fp32; gradients rounded to fp16
    (torch.bfloat16, (2e-5, 1e-2 * _GPU_ROUNDING)),  # computed in fp32; gradients rounded to bf16
]


def two_set_problem(rows, cols, relation, dtype=torch.float64):
    """A two-set soft-max problem for the kernel backends (on the suite's device, in ``dtype``): anchors,
    candidates, a learnable scale, the relation (``"partner"``, ``"keys"`` or ``"none"``) and per-row
    ``(alpha, beta)`` weights."""
    from torch_contrastive.positives import Positives

    g = torch.Generator().manual_seed(rows * 100 + cols)
    a = torch.randn(rows, 20, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    b = torch.randn(cols, 20, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    scale = torch.tensor(3.0, dtype=dtype, device=DEVICE, requires_grad=True)
    pos = None
    if relation == "partner":
        pos = Positives.from_partner(torch.arange(rows, device=DEVICE) % cols, cols, self_offset=None)
    elif relation == "keys":
        pos = Positives.from_keys(torch.arange(rows, device=DEVICE) % 3, torch.arange(cols, device=DEVICE) % 4, self_offset=None)
    weights = (torch.linspace(0.5, 2, rows, dtype=dtype, device=DEVICE), torch.linspace(1, 3, rows, dtype=dtype, device=DEVICE))
    return a, b, scale, pos, weights


def queue_problem():
    """11 queries and keys with a queue of 40 constant candidates behind the keys (float64, the
    suite's device): ``(q, k, queue, positives)``, query i's positive key i."""
    from torch_contrastive.positives import Positives

    g = torch.Generator().manual_seed(5)
    q = torch.randn(11, 6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    k = torch.randn(11, 6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    queue = torch.randn(40, 6, generator=g, dtype=torch.float64).to(DEVICE)
    return q, k, queue, Positives.from_partner(torch.arange(11, device=DEVICE), 51, self_offset=None)


#: The repository root (tools/, examples/).
ROOT = Path(__file__).resolve().parent.parent


def load_file(name: str, path: Path) -> types.ModuleType:
    """A script that is not a package module (``tools/*.py``, a peer's single file) imported by path as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class OpNames(TorchDispatchMode):
    """Records the name of every ATen op run inside it (``with OpNames() as ops: ...; ops.names``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def softmax_cases(labels):
    """The soft-max losses on the torch backend at temperature 0.07 or 0.1 beside their float64 formulas: ``(name,
    ours(a, b, chunk), formula(a, b), which of a and b take a gradient)`` (SupCon on ``labels``)."""
    import reference as ref
    import torch_contrastive as tc

    return [
        ("clip", lambda a, b, chunk: tc.image_text_contrastive_loss(a, b, 0.07, chunk_size=chunk, backend="torch"),
         lambda a, b: ref.image_text(a, b, 0.07), (True, True)),
        ("clip constant texts", lambda a, b, chunk: tc.image_text_contrastive_loss(a, b, 0.1, chunk_size=chunk, backend="torch"),
         lambda a, b: ref.image_text(a, b, 0.1), (True, False)),
        ("nt_xent", lambda a, b, chunk: tc.nt_xent_loss(a, 0.1, pairing="halves", chunk_size=chunk, backend="torch"),
         lambda a, b: ref.nt_xent(a, 0.1, pairing="halves"), (True, False)),
        ("supcon", lambda a, b, chunk: tc.supcon_loss(a, labels, temperature=0.1, chunk_size=chunk, backend="torch"),
         lambda a, b: ref.supcon(a, 0.1, labels=labels.cpu()), (True, False)),
    ]


def assert_pml_memory(value, a, m, x, mem, labels, mem_labels, tau=0.2):
    """PML NT-Xent with a labelled memory: ``value`` and the gradients in ``a.grad`` (the batch) and ``m.grad`` (the
    memory), from the float64 inputs ``x`` and ``mem``, against the float64 loops (``reference.nt_xent_pml_memory``)."""
    import reference as ref

    b, n = x.clone().requires_grad_(), mem.clone().requires_grad_()
    want = ref.nt_xent_pml_memory(b, labels, n, mem_labels, tau)
    want.backward()
    assert value.item() == pytest.approx(want.item(), rel=1e-10)
    torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(m.grad.cpu(), n.grad, rtol=1e-9, atol=1e-12)


#: The digits' class names, as ``make_digit_files`` names its folders.
DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def make_digit_files(root: Path, per_class: int = 12, classes: int = 10, mode: str = "RGB") -> tuple[Path, Path]:
    """``root/folder/<name>/<k>.png`` and ``root/captions.csv`` (two caption rows per image), from scikit-learn's
    digits with Pillow (the CLI's own data tests and its path checks share them)."""
    import csv

    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = []
    for c in range(classes):
        folder = root / "folder" / DIGIT_NAMES[c]
        folder.mkdir(parents=True, exist_ok=True)
        for k, i in enumerate((digits.target == c).nonzero()[0][:per_class]):
            pixels = (digits.images[i] * 255 / 16).astype("uint8")
            Image.fromarray(pixels, mode="L").convert(mode).save(folder / f"{k}.png")
            for template in ("a handwritten {}", "the digit {}"):
                rows.append({"image": f"folder/{DIGIT_NAMES[c]}/{k}.png", "caption": template.format(DIGIT_NAMES[c])})
    with open(root / "captions.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["image", "caption"])
        writer.writeheader()
        writer.writerows(rows)
    return root / "folder", root / "captions.csv"


def bf16_siglip_matches_float64(loss) -> None:
    """SigLIP with bf16 rows, ids and a learnable scale and bias: ``loss(rows, texts, scale, bias, ids)`` (on the
    suite's device; it returns the loss and may plan as it likes) against the float64 formula -- the value, the rows'
    gradients at bf16 accuracy, the scale's and the bias's at fp32 accuracy (the row tile's rounding remainder kept)."""
    from reference import siglip

    g = torch.Generator().manual_seed(4)
    iid = torch.randint(0, 30, (45,), generator=g)
    a, b = (torch.randn(45, 20, generator=g).to(torch.bfloat16) for _ in range(2))
    ref_in = [a.double().requires_grad_(), b.double().requires_grad_()]
    ref_p = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (10.0, -10.0)]
    ref = siglip(*ref_in, *ref_p, iid)
    ref_grads = torch.autograd.grad(ref, [*ref_in, *ref_p])
    our_in = [t.to(DEVICE).requires_grad_() for t in (a, b)]
    our_p = [torch.tensor(v, device=DEVICE, requires_grad=True) for v in (10.0, -10.0)]
    ours = loss(*our_in, *our_p, iid.to(DEVICE))
    grads = torch.autograd.grad(ours, [*our_in, *our_p])
    assert ours.item() == pytest.approx(ref.item(), rel=2e-5)
    for got, want in zip(grads[:2], ref_grads[:2]):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    for got, want in zip(grads[2:], ref_grads[2:]):
        assert got.item() == pytest.approx(want.item(), rel=1e-4, abs=1e-6)
