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


# diffusers' and transformers' from_pretrained leave a folder's weights inside the memory-mapped
# file, at the file's (unaligned) offsets; on some CPUs (AVX-512 EPYCs among them) MKL/oneDNN round
# the last bits differently for unaligned operands. Outputs of such a reference agree with imglora's
# to float32 rounding accumulated over a few layers: measured below 1e-6 on the tiny models; 1e-5
# relative (and absolute, for values near 0) leaves room for other CPUs and stays far below any
# real difference (a wrong or missing weight moves outputs by 1e-2 or more).
RTOL = ATOL = 1e-5


def owned(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its weights in aligned memory, as imglora's loaders hand on a folder's model
    (``imglora.util.owned.own_module``): against this, imglora's single-file loaders promise identity."""
    from imglora.util.owned import own_module

    return own_module(module)


def assert_same_output(got: torch.Tensor, raw: torch.Tensor, owned_out: torch.Tensor) -> None:
    """``got`` equals the owned reference's output bit for bit, and the raw (memory-mapped)
    reference's within float32 rounding."""
    torch.testing.assert_close(got, raw, rtol=RTOL, atol=ATOL)
    assert torch.equal(got, owned_out)
