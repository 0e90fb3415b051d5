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


def test_edit_pairs_with_other_numbers_of_sources_never_share_a_batch() -> None:
    # Their source tokens are concatenated after the target's: a batch needs the same count in each sample.
    def s(sources: int) -> Sample:
        return Sample((64, 64), 2, ({"control_latents": torch.zeros(sources, 4, 8, 8)},), sources=sources)

    pool = [s(1), s(2), s(1), s(2), s(3)]
    b = Batcher(pool, batch_size=4, seed=0)
    refs = [b.ref(i) for i in range(b.per_epoch)]
    assert all(len({pool[i].sources for i in r.indices}) == 1 for r in refs)
    assert sorted(len(r.indices) for r in refs) == [2, 4, 4]  # 2 + 2 + 1 images of each count, repeats 2
    assert all(b.batch(i, torch.device("cpu"))["control_latents"].shape[1] == pool[refs[i].indices[0]].sources
               for i in range(len(refs)))
    # One source (or none) keeps the plain bucket as the key: the draws of existing runs are unchanged.
    assert s(1).batch_key == (64, 64) and s(0).batch_key == (64, 64) and s(2).batch_key == (64, 64, 2)


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


# -- several sets, regularization, caption variants ----------------------------------------------


def entry(v: float) -> dict[str, torch.Tensor]:
    return {"latents": torch.full((4, 2, 2), v)}


def text(v: float) -> dict[str, torch.Tensor]:
    return {"prompt_embeds": torch.full((3,), v)}


def test_two_sets_with_repeats_1_and_3_are_drawn_1_and_3_times_per_epoch() -> None:
    one = [Sample((64, 64), 1, (entry(i),)) for i in range(4)]
    three = [Sample((64, 96), 3, (entry(10 + i),)) for i in range(2)]
    b = Batcher(one + three, batch_size=2, seed=1)
    for epoch in range(3):
        counts = [0] * 6
        for pos in range(b.per_epoch):
            for i in b.ref(epoch * b.per_epoch + pos).indices:
                counts[i] += 1
        assert counts == [1, 1, 1, 1, 3, 3]
    assert b.per_epoch == 2 + 3  # 4 in batches of 2, 6 in batches of 2


def test_regularization_images_are_interleaved_one_per_training_sample_and_rotate() -> None:
    train = [Sample((64, 64), 2, (entry(i),)) for i in range(3)]  # 6 training samples per epoch
    reg = [Sample((64, 64), 1, (entry(100 + i),), regularization=True) for i in range(4)]
    reg += [Sample((96, 64), 1, (entry(200 + i),), regularization=True) for i in range(4)]
    b = Batcher(train + reg, batch_size=2, seed=3)
    per_epoch_reg, seen = [], [0] * 11
    for epoch in range(4):
        refs = [b.ref(epoch * b.per_epoch + p) for p in range(b.per_epoch)]
        idx = [i for r in refs for i in r.indices]
        assert sorted(i for i in idx if i < 3) == [0, 0, 1, 1, 2, 2]  # training samples: their repeats
        per_epoch_reg.append(len([i for i in idx if i >= 3]))
        for i in idx:
            seen[i] += 1
        assert all(len({(b.samples[i].bucket) for i in r.indices}) == 1 for r in refs)  # one bucket per batch
    assert per_epoch_reg == [6] * 4  # reg_ratio 1: one per training sample, every epoch
    assert all(seen[i] == 3 for i in range(3, 11))  # 24 over 4 epochs: each regularization image 3 times
    half = Batcher(train + reg, batch_size=2, seed=3, reg_ratio=0.5)
    assert sum(i >= 3 for p in range(half.per_epoch) for i in half.ref(p).indices) == 3
    assert Batcher(train, 2, seed=3).per_epoch == 3  # without regularization: as before


def test_caption_dropout_and_text_variants_are_drawn_per_step_from_their_own_seed() -> None:
    plain = [Sample((64, 64), 4, (entry(i),), texts=(text(i),)) for i in range(4)]
    varied = [Sample((64, 64), 4, (entry(i),), texts=tuple(text(10 * i + k) for k in range(3)),
                     caption_dropout=0.25, empty_text=text(-1.0)) for i in range(4)]
    a, b = Batcher(plain, 2, seed=9), Batcher(varied, 2, seed=9)
    n = 40 * a.per_epoch
    refs_a, refs_b = [a.ref(m) for m in range(n)], [b.ref(m) for m in range(n)]
    # The options change which text is used and nothing else: the same images, variants and order.
    assert [(r.indices, r.variants) for r in refs_a] == [(r.indices, r.variants) for r in refs_b]
    assert all(t == 0 for r in refs_a for t in r.texts)
    drawn = [t for r in refs_b for t in r.texts]
    assert set(drawn) == {-1, 0, 1, 2}
    assert abs(drawn.count(-1) / len(drawn) - 0.25) < 0.05
    batch = b.batch(next(m for m, r in enumerate(refs_b) if -1 in r.texts), torch.device("cpu"))
    assert (batch["prompt_embeds"] == -1.0).all(dim=1).any()  # the empty caption's tensors
    values = {float(v) for m in range(2 * b.per_epoch) for v in b.batch(m, torch.device("cpu"))["prompt_embeds"][:, 0]}
    assert values <= {-1.0} | {float(10 * i + k) for i in range(4) for k in range(3)}  # only what was cached


def test_collate_fills_the_loss_mask_and_weight_of_samples_without_one() -> None:
    from imglora.data.batches import stack

    masked = {**entry(1.0), "loss_mask": torch.zeros(1, 2, 2)}
    weighted = {**entry(2.0), "loss_weight": torch.tensor(0.5)}
    out = stack([masked, weighted, entry(3.0)])
    assert out["loss_mask"].shape == (3, 1, 2, 2) and out["loss_mask"][1:].eq(1).all() and out["loss_mask"][0].eq(0).all()
    assert out["loss_weight"].tolist() == [1.0, 0.5, 1.0]
    assert set(stack([entry(1.0), entry(2.0)])) == {"latents"}  # nothing added when no sample has one
