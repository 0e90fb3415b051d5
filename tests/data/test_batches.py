"""The batcher on its own: deterministic order, one bucket per batch, repeats, variants."""

from __future__ import annotations

import torch

from imglora.data.batches import Batcher
from imglora.data.samples import Sample


def samples() -> list[Sample]:
    def s(i: int, bucket: tuple[int, int], repeats: int, variants: int = 1) -> Sample:
        return Sample(bucket, repeats, tuple({"x": torch.full((2,), float(10 * i + v))} for v in range(variants)))

    return [s(0, (64, 64), 1), s(1, (64, 64), 3), s(2, (96, 64), 2, variants=2), s(3, (96, 64), 1)]


def test_an_epoch_is_every_repeat_once_and_each_batch_is_one_bucket() -> None:
    b = Batcher(samples(), batch_size=2, seed=5)
    refs = [b.ref(i) for i in range(b.per_epoch)]
    counts = [0] * 4
    for r in refs:
        for i in r.indices:
            counts[i] += 1
        assert len({samples()[i].bucket for i in r.indices}) == 1
    assert counts == [1, 3, 2, 1] and b.per_epoch == 4  # 4 + 3 repeats, in batches of at most 2 per bucket


def test_the_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a, b, c = Batcher(samples(), 2, seed=5), Batcher(samples(), 2, seed=5), Batcher(samples(), 2, seed=6)
    run = [a.ref(i) for i in range(3 * a.per_epoch)]
    assert run == [b.ref(i) for i in range(3 * b.per_epoch)]  # what a resumed run sees
    assert [b.ref(i) for i in reversed(range(3 * b.per_epoch))][::-1] == run  # in any order of asking
    assert run != [c.ref(i) for i in range(3 * c.per_epoch)]
    assert run[: a.per_epoch] != run[a.per_epoch: 2 * a.per_epoch]  # epochs are shuffled apart


def test_batches_stack_the_chosen_variant_on_the_device() -> None:
    b = Batcher(samples(), 1, seed=0)
    seen = {float(b.batch(i, torch.device("cpu"))["x"][0, 0]) for i in range(4 * b.per_epoch)}
    assert {20.0, 21.0} <= seen  # both variants (e.g. flipped) of sample 2 are drawn
