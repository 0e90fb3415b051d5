"""imglora.util.rng: the loop's global seeding."""

from __future__ import annotations

import torch

from imglora.util import rng


def test_seed_global_draws_what_torch_manual_seed_draws() -> None:
    """The loop seeds the global RNG once per update (LoRA dropout draws from it) with
    ``seed_global``: the CPU generator's draws are those of ``torch.manual_seed`` (the same
    generator, the same seed), so resumed runs repeat earlier ones."""
    torch.manual_seed(123456789)
    expected = (torch.rand(7), torch.randn(3, 4), torch.randint(0, 1000, (5,)))
    torch.manual_seed(0)
    torch.rand(11)  # another state in between
    rng.seed_global(123456789)
    got = (torch.rand(7), torch.randn(3, 4), torch.randint(0, 1000, (5,)))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    rng.seed_global(987654321)
    assert not torch.equal(torch.rand(7), expected[0])


def test_seed_global_leaves_an_uninitialized_cuda_alone(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: calls.append(s))
    rng.seed_global(5)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    rng.seed_global(6)
    assert calls == [6]
