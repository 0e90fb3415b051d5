"""The loss weighting every image family shares: per-element masks and per-sample weights."""

from __future__ import annotations

import torch

from imglora.weighting import batch_loss, per_item_mse


def test_a_mask_zeroing_the_right_half_gives_no_gradient_there() -> None:
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(2, 4, 8, 8, generator=g, requires_grad=True)
    target = torch.randn(2, 4, 8, 8, generator=g)
    mask = torch.ones(2, 1, 8, 8)
    mask[..., 4:] = 0
    batch_loss(per_item_mse(pred, target, mask), {}).backward()
    assert pred.grad[..., 4:].abs().max() == 0
    assert pred.grad[..., :4].abs().min() > 0


def test_no_mask_and_no_weight_is_the_plain_mean_bit_for_bit_and_weights_scale_items() -> None:
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    plain = (pred.float() - target.float()).pow(2).mean(dim=(1, 2, 3))
    assert torch.equal(per_item_mse(pred, target), plain)
    assert torch.equal(per_item_mse(pred, target, torch.ones(3, 1, 8, 8)), plain)
    grey = per_item_mse(pred, target, torch.full((3, 1, 8, 8), 0.5))
    torch.testing.assert_close(grey, plain * 0.5)  # grey = half weight, as kohya's masked loss
    weight = torch.tensor([1.0, 2.0, 0.0])
    torch.testing.assert_close(batch_loss(plain, {"loss_weight": weight}), (plain * weight).mean())
    assert torch.equal(batch_loss(plain, {}), plain.mean())
