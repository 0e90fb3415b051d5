"""Deterministic bucketed batching: the order of an epoch is a pure function of (seed, epoch).

Because of that, resuming needs no saved iterator: micro-batch number ``m`` of a run is always
the same batch, whether the run was interrupted or not.

An epoch holds every training sample ``repeats`` times (sets with different repeats and
resolutions together; a batch is one bucket, whichever sets its images come from), plus
regularization samples: ``reg_ratio`` per training sample, as kohya sd-scripts interleaves them
(one each by default). Each bucket gets a fixed share of them, so every epoch has the same number
of batches, and within a bucket they rotate through a seeded order, so over the epochs every
regularization image is used evenly. Which cached variant (flip) and which caption variant (a
shuffled one, or the empty caption of caption dropout) a batch takes is drawn from the same seeds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

import torch

from ..util.devices import is_cuda
from .samples import Sample


@dataclass(frozen=True)
class Part:
    """One process's share of a micro-batch."""

    batch: dict[str, torch.Tensor] | None  # None: no sample of this micro-batch falls to this process
    positions: range  # the rows' positions in the whole micro-batch
    scale: float  # the share of the micro-batch's loss these rows carry


@dataclass(frozen=True)
class BatchRef:
    epoch: int
    indices: tuple[int, ...]  # into the sample list
    variants: tuple[int, ...]  # which cached variant (e.g. flipped) of each sample
    texts: tuple[int, ...] = ()  # which text variant of each sample; -1 = the empty caption (caption dropout)


def reg_per_epoch(train_samples: int, reg_ratio: float) -> int:
    """Regularization samples in an epoch of ``train_samples`` training samples (repeats counted)."""
    return max(1, round(reg_ratio * train_samples))


class Batcher:
    def __init__(self, samples: list[Sample], batch_size: int, seed: int,
                 collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]] | None = None,
                 reg_ratio: float = 1.0):
        if not samples:
            raise ValueError("no training samples")
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed
        self.collate = collate or stack
        self._reg_pool: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(samples):
            if s.regularization:
                self._reg_pool.setdefault(s.batch_key, []).extend([i] * s.repeats)
        if self._reg_pool:
            n_train = sum(s.repeats for s in samples if not s.regularization)
            if not n_train:
                raise ValueError("only regularization samples")
            self._reg_share = _shares(reg_per_epoch(n_train, reg_ratio),
                                      {b: len(p) for b, p in self._reg_pool.items()})
        self.per_epoch = len(self._epoch(0))

    def _epoch(self, epoch: int) -> list[BatchRef]:
        rng = random.Random(f"{self.seed}/{epoch}")
        by_bucket: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(self.samples):
            if not s.regularization:
                by_bucket.setdefault(s.batch_key, []).extend([i] * s.repeats)
        for bucket, chosen in self._regularization(epoch).items():
            by_bucket.setdefault(bucket, []).extend(chosen)
        batches = []
        for bucket in sorted(by_bucket):
            idx = by_bucket[bucket]
            rng.shuffle(idx)
            batches += [idx[j:j + self.batch_size] for j in range(0, len(idx), self.batch_size)]
        rng.shuffle(batches)
        refs = [BatchRef(epoch, tuple(b), tuple(rng.randrange(len(self.samples[i].variants)) for i in b))
                for b in batches]
        return self._captions(refs, epoch)

    def _regularization(self, epoch: int) -> dict[tuple[int, int], list[int]]:
        """This epoch's regularization samples per bucket: the next ``share`` of an endless stream
        that goes through the bucket's pool in a fresh seeded order each round."""
        out: dict[tuple[int, int], list[int]] = {}
        for bucket, pool in self._reg_pool.items():
            share = self._reg_share[bucket]
            orders: dict[int, list[int]] = {}
            chosen = []
            for pos in range(epoch * share, (epoch + 1) * share):
                round_, at = divmod(pos, len(pool))
                if round_ not in orders:
                    orders[round_] = list(pool)
                    random.Random(f"{self.seed}/reg/{bucket}/{round_}").shuffle(orders[round_])
                chosen.append(orders[round_][at])
            out[bucket] = chosen
        return out

    def _captions(self, refs: list[BatchRef], epoch: int) -> list[BatchRef]:
        """Each sample's text variant; a generator of its own, so runs without caption options draw
        exactly what they drew before these options existed."""
        rng = random.Random(f"{self.seed}/{epoch}/captions")
        out = []
        for ref in refs:
            texts = []
            for i in ref.indices:
                s = self.samples[i]
                dropped = s.caption_dropout > 0 and rng.random() < s.caption_dropout
                texts.append(-1 if dropped else rng.randrange(len(s.texts)) if len(s.texts) > 1 else 0)
            out.append(BatchRef(ref.epoch, ref.indices, ref.variants, tuple(texts)))
        return out

    def ref(self, micro_index: int) -> BatchRef:
        """The batch for the ``micro_index``-th micro-batch of the run (0-based)."""
        epoch, pos = divmod(micro_index, self.per_epoch)
        if getattr(self, "_cached_epoch", None) != epoch:
            self._cached, self._cached_epoch = self._epoch(epoch), epoch
        return self._cached[pos]

    def batch(self, micro_index: int, device: torch.device) -> dict[str, torch.Tensor]:
        ref = self.ref(micro_index)
        return self._to(self._collated(ref, range(len(ref.indices)), micro_index), device)

    def _collated(self, ref: BatchRef, rows: range, micro_index: int) -> dict[str, torch.Tensor]:
        """The rows' batch; with output preservation, the same rows with each preservation caption
        too, collated on their own (a family may pad captions) under ``<name>.`` keys."""
        entries = self._entries(ref, rows)
        batch = self._sampled(self.collate(entries), micro_index, rows)
        samples = [self.samples[ref.indices[j]] for j in rows]
        for name in samples[0].preserve if samples else ():
            if all(name in s.preserve for s in samples):
                other = self._sampled(self.collate([{**e, **s.preserve[name]} for e, s in zip(entries, samples)]),
                                      micro_index, rows)
                batch |= {f"{name}.{k}": v for k, v in other.items()}
        return batch

    def _sampled(self, batch: dict[str, torch.Tensor], micro_index: int, rows: range) -> dict[str, torch.Tensor]:
        """cache.latents = "sample": each row's latents drawn from the VAE posterior, ``mean + std *
        noise``, with noise of a generator seeded by (run seed, micro-batch, row): a fresh draw every
        time an image is used, the same draw for that micro-batch in a resumed run or on any number
        of processes (and for its preservation captions' batch)."""
        std = batch.pop("latents_std", None)
        if std is None:
            return batch
        noise = torch.stack([torch.randn(std.shape[1:], generator=torch.Generator().manual_seed(
            _row_seed(self.seed, micro_index, r)), dtype=std.dtype) for r in rows])
        return {**batch, "latents": batch["latents"] + std * noise}

    def part(self, micro_index: int, device: torch.device, rank: int, world: int,
             units: Callable[[list[dict[str, torch.Tensor]]], float] | None = None) -> "Part":
        """Process ``rank``'s share of micro-batch ``micro_index`` (of ``world`` processes, which
        share each batch, see ``distributed.share``): its rows, their positions in the whole batch,
        and the share of the batch's loss they carry -- samples, or what ``units`` counts (tokens)."""
        from ..util.distributed import share

        ref = self.ref(micro_index)
        rows = range(len(ref.indices))[share(len(ref.indices), rank, world)]
        if world == 1:
            return Part(self.batch(micro_index, device), rows, 1.0)
        if not rows:
            return Part(None, rows, 0.0)
        mine = self._entries(ref, rows)
        count = units or len
        scale = count(mine) / count(self._entries(ref, range(len(ref.indices))))
        return Part(self._to(self._collated(ref, rows, micro_index), device), rows, scale)

    def _entries(self, ref: BatchRef, rows: range) -> list[dict[str, torch.Tensor]]:
        return [self.samples[ref.indices[j]].entry(ref.variants[j], ref.texts[j]) for j in rows]

    @staticmethod
    def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        if is_cuda(device):  # only a copy from page-locked memory is truly asynchronous
            batch = {k: t.pin_memory() for k, t in batch.items()}
        return {k: t.to(device, non_blocking=True) for k, t in batch.items()}


def _row_seed(seed: int, micro_index: int, row: int) -> int:
    """A 63-bit seed for one row of one micro-batch of a run."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}/latents/{micro_index}/{row}".encode()).digest()[:8], "big") >> 1


def _shares(total: int, sizes: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """``total`` split over the buckets in proportion to ``sizes`` (largest remainders, ties to the
    smaller bucket key): the same split in every epoch."""
    whole = sum(sizes.values())
    exact = {b: total * n / whole for b, n in sizes.items()}
    out = {b: math.floor(x) for b, x in exact.items()}
    for b in sorted(exact, key=lambda b: (out[b] - exact[b], b))[:total - sum(out.values())]:
        out[b] += 1
    return out


# Per-sample tensors that only some samples carry; the others get the neutral value.
_NEUTRAL: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "loss_mask": lambda e: torch.ones((1, *e["latents"].shape[-2:])),  # train every latent pixel
    "loss_weight": lambda e: torch.ones(()),
}


def stack(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch same-shaped entries (one bucket) by stacking each tensor; a loss mask or weight that
    only some entries carry is filled in for the others (ones: every pixel, full weight)."""
    keys = list(entries[0]) + [k for k in _NEUTRAL if k not in entries[0] and any(k in e for e in entries)]
    return {k: torch.stack([e[k] if k in e else _NEUTRAL[k](e) for e in entries]) for k in keys}
