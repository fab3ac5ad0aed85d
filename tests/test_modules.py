"""nn.Module twins: same numbers as the functions, the peers' call forms, learnable temperature."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc


def test_modules_equal_functions():
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randn(8, 5)
    labels = torch.tensor([0, 1, 0, 1, 2, 2, 3, 3])
    pos = torch.tensor([[0, 1], [2, 3]])
    assert tc.NTXentLoss(0.3, pairing="halves")(x).item() == tc.nt_xent_loss(x, 0.3, pairing="halves").item()
    assert tc.NTXentLoss(0.3)(x, labels).item() == tc.nt_xent_loss(x, 0.3, labels=labels).item()
    assert tc.NTBXentLoss(0.3)(x, pos).item() == tc.nt_bxent_loss(x, pos, 0.3).item()
    assert tc.NTBXentLoss(0.3)(x, labels=labels).item() == tc.nt_bxent_loss(x, labels=labels, temperature=0.3).item()
    assert tc.ClipLoss(0.1)(x, y, labels).item() == tc.clip_loss(x, y, 0.1, labels).item()
    feats = x.reshape(4, 2, 5)
    assert tc.SupConLoss(0.1, base_temperature=0.07)(feats, labels[:4]).item() == \
        tc.supcon_loss(feats, labels[:4], temperature=0.1, base_temperature=0.07).item()
    assert tc.SupConLoss(0.1)(feats, mask=torch.eye(4)).item() == tc.supcon_loss(feats, temperature=0.1).item()


@pytest.mark.parametrize("cls", [tc.NTXentLoss, tc.NTBXentLoss, tc.ImageTextContrastiveLoss, tc.SupConLoss])
def test_learnable_temperature_is_a_parameter(cls):
    m = cls(0.2, learnable_temperature=True)
    params = dict(m.named_parameters())
    assert list(params) == ["logit_scale"]
    assert float(torch.as_tensor(m.temperature).detach()) == pytest.approx(0.2, rel=1e-6)
    assert "logit_scale" in repr(m)
    fixed = cls(0.2)
    assert list(fixed.parameters()) == [] and "temperature=0.2" in repr(fixed)


@pytest.mark.parametrize("cls", [tc.NTXentLoss, tc.ClipLoss, tc.SupConLoss])
def test_a_learnable_temperature_starts_inside_its_clamp(cls):
    """The learnable logit scale is clamped at 100 (CLIP's): a start below temperature 0.01 would sit on
    the clamp with a zero gradient, so the constructor refuses it; 0.01 itself learns."""
    with pytest.raises(ValueError, match=r"temperature must be at least 0\.01 with learnable_temperature=True"):
        cls(0.001, learnable_temperature=True)
    m = cls(0.01, learnable_temperature=True)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    loss = m(x, x.flip(0)) if cls is tc.ClipLoss else m(x.reshape(4, 2, 4)) if cls is tc.SupConLoss else m(x)
    loss.backward()
    assert m.logit_scale.grad is not None and m.logit_scale.grad.abs().item() > 0
    assert cls(0.001)(x, x.flip(0)).item() > 0 if cls is tc.ClipLoss else True  # a fixed temperature has no clamp


def test_temperature_gradient_reaches_logit_scale():
    torch.manual_seed(1)
    m = tc.SupConLoss(0.2, learnable_temperature=True)
    x = torch.randn(10, 4)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    m(x, labels).backward()
    # d loss / d logit_scale = d loss / d tau * (-tau): check against a finite difference.
    h = 1e-3
    with torch.no_grad():
        up = tc.supcon_loss(x.double(), labels, temperature=0.2 * torch.exp(torch.tensor(-h)).item()).item()
        down = tc.supcon_loss(x.double(), labels, temperature=0.2 * torch.exp(torch.tensor(h)).item()).item()
    assert m.logit_scale.grad.item() == pytest.approx((up - down) / (2 * h), rel=1e-3)


@pytest.mark.parametrize("call,exc,word", [
    (lambda: tc.NTXentLoss()(torch.randn(7, 3)), ValueError, "even"),
    (lambda: tc.SupConLoss()(torch.randn(6, 3)), ValueError, "labels"),
    (lambda: tc.ClipLoss()(torch.randn(6, 3), torch.randn(5, 3)), ValueError, "batch size"),
    (lambda: tc.NTBXentLoss()(torch.randn(6, 3)), ValueError, "pos_indices"),
    (lambda: tc.NTXentLoss(reduction="median")(torch.randn(6, 3)), ValueError, "reduction"),
    (lambda: tc.SupConLoss(base_temperature=-1.0), ValueError, "base_temperature"),
])
def test_module_bad_input(call, exc, word):
    with pytest.raises(exc, match=word):
        call()


@pytest.mark.parametrize("fn,module", [("nt_xent_loss", "NTXentLoss"), ("nt_bxent_loss", "NTBXentLoss"),
                                       ("image_text_contrastive_loss", "ImageTextContrastiveLoss"),
                                       ("supcon_loss", "SupConLoss"), ("info_nce_loss", "InfoNCELoss"),
                                       ("siglip_loss", "SigLipLoss")])
def test_modules_have_explicit_signatures_covering_their_function(fn, module):
    """Every option of the function is a named parameter of the module's constructor or
    forward (no ``**options``), so ``ClipLoss(decoupled=True)`` and IDE completion work."""
    import inspect

    cls = getattr(tc, module)
    params = {**inspect.signature(cls.__init__).parameters, **inspect.signature(cls.forward).parameters}
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    inputs = {"image_feat", "text_feat", "logit_scale", "logit_bias"}  # forward's own names, or the module's parameters
    missing = [p for p in inspect.signature(getattr(tc, fn)).parameters if p not in params and p not in inputs]
    assert not missing


def test_module_options_reach_the_function():
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    assert tc.ClipLoss(decoupled=True)(x, y).item() == pytest.approx(tc.clip_loss(x, y, decoupled=True).item(), rel=1e-12)
    assert tc.ClipLoss(label_smoothing=0.1)(x, y).item() == pytest.approx(
        tc.clip_loss(x, y, label_smoothing=0.1).item(), rel=1e-12)
    assert tc.InfoNCELoss(0.1, decoupled=True)(x, y).item() == pytest.approx(
        tc.info_nce_loss(x, y, temperature=0.1, decoupled=True).item(), rel=1e-12)
    ids = torch.tensor([0, 0, 1, 2, 3, 4])
    assert tc.InfoNCELoss(0.1)(x, y, key_ids=ids).item() == pytest.approx(
        tc.info_nce_loss(x, y, temperature=0.1, key_ids=ids).item(), rel=1e-12)
    z = torch.randn(8, 4, dtype=torch.float64)
    assert tc.NTXentLoss(0.2, pairing="halves", decoupled=True)(z).item() == pytest.approx(
        tc.nt_xent_loss(z, 0.2, pairing="halves", decoupled=True).item(), rel=1e-12)
    with pytest.raises(TypeError, match="decoupled must be a bool"):
        tc.ClipLoss(decoupled=1)


@pytest.mark.parametrize("fn", ["nt_xent_loss", "nt_bxent_loss", "image_text_contrastive_loss", "supcon_loss", "info_nce_loss",
                                "siglip_loss"])
def test_every_loss_takes_the_shared_options_with_one_set_of_defaults(fn):
    """The shared options (torch_contrastive.options) are keyword arguments of every loss, with
    the defaults :func:`options.check` gives the modules, and each is documented there once."""
    import inspect

    from torch_contrastive import options

    params = inspect.signature(getattr(tc, fn)).parameters
    defaults = inspect.signature(options.check).parameters
    for name in options.SHARED:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == defaults[name].default, name
        assert f"\n{name} (" in options.__doc__, name


def test_shared_options_are_checked_once_at_construction():
    from torch_contrastive import options

    assert options.check(chunk_size=64)["chunk_size"] == 64
    with pytest.raises(ValueError, match="reduction"):
        tc.NTXentLoss(reduction="avg")
    with pytest.raises(ValueError, match="backend"):
        options.check(backend="gpu")
