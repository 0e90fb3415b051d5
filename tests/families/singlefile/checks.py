"""Assertions shared by the single-file tests."""

from __future__ import annotations

import torch


def assert_same_weights(got: torch.nn.Module, want: dict[str, torch.Tensor] | torch.nn.Module) -> None:
    """Same keys, and every tensor torch.equal (same dtype too)."""
    want_sd = want.state_dict() if isinstance(want, torch.nn.Module) else want
    got_sd = got.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    differ = [k for k in want_sd if got_sd[k].dtype != want_sd[k].dtype or not torch.equal(got_sd[k], want_sd[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:5]}"
