"""The loss weighting every image family shares: per-element masks and per-sample weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imglora.families._shared.weighting import batch_loss, per_item_mse
from imglora.memory.wrap import resolve_swap

REPO = Path(__file__).resolve().parents[2]


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


def test_min_snr_weight_is_finite_at_zero_snr_and_the_usual_form_elsewhere() -> None:
    from imglora.families._shared.weighting import min_snr_weight

    snr = torch.tensor([0.0, 1e-6, 0.5, 5.0, 7.5, 1e4])
    eps = min_snr_weight(snr, 5.0, "epsilon")
    assert eps[0] == 1.0  # the limit of min(snr, 5)/snr as snr -> 0, not 0/0
    assert torch.equal(eps[1:], (torch.clamp(snr, max=5.0) / snr)[1:])  # the usual form, bit for bit
    v = min_snr_weight(snr, 5.0, "v_prediction")
    assert torch.equal(v, torch.clamp(snr, max=5.0) / (snr + 1)) and v[0] == 0.0


def test_a_zero_terminal_snr_epsilon_model_trains_at_t_999_without_nan(monkeypatch) -> None:
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from imglora.commands.common import load_config
    from imglora.families import registry
    from imglora.families.sdxl import model as sdxl_model
    from imglora.models.resolve import resolve_model
    from imglora.util.rng import draws

    root = resolve_model("tiny:sdxl", registry.get("sdxl")).root
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml", ["sdxl.min_snr_gamma=5", 'sdxl.prediction_type="epsilon"'])
    scheduler = DDPMScheduler.from_pretrained(root, subfolder="scheduler", rescale_betas_zero_snr=True)
    assert scheduler.alphas_cumprod[999] == 0  # SNR 0 at the last step
    trainable = sdxl_model.SdxlTrainable(UNet2DConditionModel.from_pretrained(root, subfolder="unet"), scheduler,
                                         cfg.family)

    class Last:
        def __init__(self, generator):
            self.inner = draws(generator)

        def randn(self, *a, **k):
            return self.inner.randn(*a, **k)

        def randint(self, low, high, shape, device=None):
            return torch.full(shape, high - 1, device=device)  # t = 999 for every sample

    monkeypatch.setattr(sdxl_model, "draws", Last)
    batch = registry.get("sdxl").synthetic_batch(trainable, 64, cfg.replace(train={"batch_size": 2}),
                                                 torch.device("cpu"))
    with torch.no_grad():
        loss = trainable.loss(batch, torch.Generator().manual_seed(1))
    assert torch.isfinite(loss) and loss > 0


def test_the_eval_sampler_of_a_zero_terminal_snr_model_starts_from_pure_noise(tmp_path: Path) -> None:
    import json
    import shutil

    from imglora.commands.common import load_config
    from imglora.families import registry
    from imglora.models.resolve import resolve_model

    family = registry.get("sdxl")
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml", ["eval.sample_steps=4"])
    plain = resolve_model("tiny:sdxl", family)
    ztsnr = tmp_path / "ztsnr"
    shutil.copytree(plain.root, ztsnr)
    config = ztsnr / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rescale_betas_zero_snr": True,
                                  "prediction_type": "v_prediction"}))
    swap = resolve_swap(family, cfg, plain)
    unet = family.load_trainable(plain, cfg, torch.device("cpu"), torch.float32, swap).model
    leading = family.load_sampler(plain, unet, cfg, torch.device("cpu"), torch.float32).settings
    trailing = family.load_sampler(resolve_model(str(ztsnr), family), unet, cfg, torch.device("cpu"),
                                   torch.float32).settings
    assert leading["timestep_spacing"] == "leading" and leading["first_timestep"] < 999
    assert trailing["timestep_spacing"] == "trailing" and trailing["first_timestep"] == 999


class Train:
    def __init__(self, loss_type: str, schedule: str = "snr", c: float = 0.1, scale: float = 1.0):
        self.loss_type, self.huber_schedule, self.huber_c, self.huber_scale = loss_type, schedule, c, scale


def kohya_conditional_loss(pred, target, loss_type, c):
    """kohya sd-scripts' conditional_loss with reduction "none" (library/train_util.py), written out."""
    if loss_type == "l1":
        return torch.nn.functional.l1_loss(pred, target, reduction="none")
    c = c.view(-1, 1, 1, 1)
    root = torch.sqrt((pred - target) ** 2 + c**2) - c
    return 2 * c * root if loss_type == "huber" else 2 * root


def test_each_loss_type_is_kohyas_and_l2_is_the_mse_as_before() -> None:
    from imglora.families._shared.weighting import huber_threshold, per_item_loss

    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g) * 3
    t = torch.tensor([0.05, 0.5, 0.999])
    abar = torch.tensor([0.9, 0.3, 0.0])  # the last: SNR 0
    ratio = ((1 - abar) / abar).sqrt()
    assert torch.equal(per_item_loss(pred, target, None, Train("l2"), lambda: 1 / 0), per_item_mse(pred, target))
    for kind in ("l1", "huber", "smooth_l1"):
        for schedule in ("snr", "exponential", "constant"):
            train = Train(kind, schedule, c=0.2, scale=1.5)
            c = huber_threshold(train, t, ratio)
            assert torch.isfinite(c).all()
            want = kohya_conditional_loss(pred, target, kind, c).mean(dim=(1, 2, 3))
            torch.testing.assert_close(per_item_loss(pred, target, None, train, lambda: (t, ratio)), want,
                                       rtol=1e-6, atol=0)
    # kohya's schedules at their own timesteps T = 1000 t (huber_c 0.2, huber_scale 1.5):
    T = t * 1000
    exp_kohya = torch.exp(-(-torch.log(torch.tensor(0.2)) / 1000) * T) * 1.5
    torch.testing.assert_close(huber_threshold(Train("huber", "exponential", 0.2, 1.5), t, ratio), exp_kohya)
    snr_kohya = (1 - 0.2) / (1 + ratio) ** 2 + 0.2
    assert torch.equal(huber_threshold(Train("huber", "snr", 0.2, 1.5), t, ratio), snr_kohya)
    assert huber_threshold(Train("huber", "snr", 0.2), t, ratio)[2] == 0.2  # infinite ratio: c = huber_c
    # Huber is quadratic near 0 and linear far out: large errors weigh less than in l2.
    small, large = torch.full((1, 1, 1, 1), 0.01), torch.full((1, 1, 1, 1), 10.0)
    one = lambda: (torch.tensor([0.5]), torch.tensor([1.0]))  # noqa: E731
    h = Train("huber", "constant", 0.1)
    assert per_item_loss(small, torch.zeros_like(small), None, h, one) < 0.01**2
    assert per_item_loss(large, torch.zeros_like(large), None, h, one) < 0.21 * 10


def test_huber_trains_every_image_family_and_is_refused_for_the_llm() -> None:
    from imglora.commands.common import load_config
    from imglora.errors import ConfigError
    from imglora.families import registry
    from imglora.models.resolve import resolve_model

    for name in ("sdxl", "flux", "chroma"):
        cfg = load_config(REPO / "presets" / f"tiny-{name}.toml", ['train.loss_type="huber"', "memory.fp8=false",
                                                                    "memory.blocks_to_swap=0"])
        family = registry.get(name)
        src = resolve_model(cfg.model.path, family)
        trainable = family.load_trainable(src, cfg, torch.device("cpu"), torch.float32, resolve_swap(family, cfg, src))
        batch = family.synthetic_batch(trainable, 64, cfg, torch.device("cpu"))
        with torch.no_grad():
            huber = trainable.loss(batch, torch.Generator().manual_seed(0))
            trainable.train = cfg.replace(train={"loss_type": "l2"}).train
            l2 = trainable.loss(batch, torch.Generator().manual_seed(0))
        assert torch.isfinite(huber) and 0 < huber < l2, name  # c = 0.1..1: huber below the squared error
    with pytest.raises(ConfigError, match=r"train.loss_type: the llm family trains on the answers' cross-entropy"):
        load_config(REPO / "presets" / "tiny-llm.toml", ['train.loss_type="huber"'])
