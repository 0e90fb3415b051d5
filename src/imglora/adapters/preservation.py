"""Output preservation: the adapter also learns to leave the model's prediction as it was where the
trigger word is absent.

- Differential output preservation (``train.dop_weight``; ai-toolkit's ``diff_output_preservation``,
  kohya's and OneTrainer's prior preservation with the base model's own output): each image's
  caption with the trigger word replaced by ``train.dop_class`` is denoised too, from the same noisy
  latents at the same noise level, once with the adapter off (the target, no gradient) and once with
  it on; the mean squared difference of the two predictions, times the weight, joins the loss.
- Blank-prompt preservation (``train.blank_preservation_weight``; ai-toolkit's
  ``blank_prompt_preservation``): the same with the empty caption.

The other captions are cached text entries like any caption (``CachePlan.preserve``), batched under
``dop.`` / ``blank.`` keys (``Batcher``). This module wraps the family's trainable: its ``loss``
runs the family's own loss for the image, then the family's loss again on the other caption's batch
with the random draws replayed and a forward hook reading the denoiser's prediction, so every
family's objective (packing, masks, sources) is reused as it is. The loss logged is the sum.

Cost: per update, the family's forward and backward, plus one forward without gradient and one
forward and backward per preservation term (about 2.25x the compute with gradient checkpointing);
both terms' activations are alive until the backward (``imglora plan`` counts them by running this
wrapper on the meta device).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

PREFIXES = ("dop.", "blank.")


def wrap(trainable: Any, cfg: Any) -> Any:
    """``trainable`` with the preservation terms the config asks for (itself when none)."""
    terms = {name: w for name, w in (("dop.", cfg.train.dop_weight), ("blank.", cfg.train.blank_preservation_weight))
             if w}
    return Preserving(trainable, terms) if terms else trainable


def synthetic(batch: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A synthetic batch (plan, benchmarks) with the preservation batches the config asks for: the
    same tensors under each prefix (their captions are as long as the image's)."""
    out = dict(batch)
    for prefix, weight in (("dop.", cfg.train.dop_weight), ("blank.", cfg.train.blank_preservation_weight)):
        if weight:
            out |= {f"{prefix}{k}": v for k, v in batch.items()}
    return out


class Preserving:
    """The family's trainable with output-preservation terms: ``terms`` {batch prefix: weight}."""

    def __init__(self, inner: Any, terms: dict[str, float]):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "terms", terms)

    # The loop and the memory features read and replace the denoiser (``model``) and read the
    # family's facts: everything but ``loss`` is the inner trainable's.
    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def loss(self, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
        own = {k: v for k, v in batch.items() if not k.startswith(PREFIXES)}
        replay = snapshot(generator)
        total = self.inner.loss(own, generator)
        for prefix, weight in self.terms.items():
            other = {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}
            if not other:  # (a batch of held-out images, or images without a trigger word to replace)
                continue
            with torch.no_grad(), adapters_off(self.inner.model):
                target = prediction(self.inner, other, replay())
            pred = prediction(self.inner, other, replay())
            total = total + weight * torch.nn.functional.mse_loss(pred.float(), target.float())
        return total


def prediction(trainable: Any, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
    """The denoiser's output when the family's loss runs on ``batch`` (its first output tensor, read
    by a forward hook; the loss value itself is dropped)."""
    seen: list[torch.Tensor] = []

    def keep(module: Any, args: Any, output: Any) -> None:
        if not seen:
            seen.append(_first_tensor(output))

    handle = trainable.model.register_forward_hook(keep)
    try:
        trainable.loss(batch, generator)
    finally:
        handle.remove()
    return seen[0]


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return _first_tensor(output[0])
    return _first_tensor(output.sample if hasattr(output, "sample") else output[0])


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every adapter layer runs its base layer alone (peft's enable_adapters)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def snapshot(generator: Any) -> Any:
    """A function giving fresh copies of ``generator`` in its state now (a ``torch.Generator``, or
    imglora.util.rng.SampleRNG's generator per sample): the same draws again, as many times as asked."""
    from ..util.rng import SampleRNG

    def clone(g: torch.Generator) -> torch.Generator:
        copy = torch.Generator(device=g.device)
        copy.set_state(g.get_state())
        return copy

    if isinstance(generator, torch.Generator):
        state = clone(generator)
        return lambda: clone(state)
    if isinstance(generator, SampleRNG):
        states = [clone(g) for g in generator.gens]

        def again() -> SampleRNG:
            rng = SampleRNG.__new__(SampleRNG)
            rng.gens = [clone(g) for g in states]
            return rng

        return again
    raise TypeError(f"cannot replay the draws of a {type(generator).__name__}")
