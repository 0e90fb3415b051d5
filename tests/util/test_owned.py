"""imglora.util.owned: tensors read from files live in aligned memory the process owns, so results do not
depend on where a file happened to put them; the test switch puts them at odd addresses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from imglora.util import owned


def _misaligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % owned.ALIGNMENT != 0


def test_unaligned_copy_sits_past_a_boundary_and_equals_the_input() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(5, 7).to(dtype)
        u = owned.unaligned_copy(t)
        assert u.data_ptr() % owned.ALIGNMENT == owned.UNALIGNED_OFFSET
        assert u.is_contiguous() and u.dtype == dtype and torch.equal(u, t)
        assert owned.is_aligned(owned.aligned_copy(u)) and not owned.is_aligned(u)


def test_the_switch_decides_where_read_tensors_go(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(16, 16), "b": torch.arange(9, dtype=torch.float32)}, str(path), metadata={"k": "v"})
    monkeypatch.delenv(owned.UNALIGNED_ENV, raising=False)
    tensors, meta = owned.read_file(path)
    assert meta == {"k": "v"} and all(owned.is_aligned(t) for t in tensors.values())
    monkeypatch.setenv(owned.UNALIGNED_ENV, "1")
    odd = owned.load_file(path)
    assert all(_misaligned(t) for t in odd.values())
    assert all(torch.equal(odd[k], tensors[k]) for k in tensors)
    monkeypatch.setenv(owned.UNALIGNED_ENV, "0")
    assert not owned.unaligned_reads()


def test_read_tensors_do_not_alias_the_file(tmp_path: Path) -> None:
    """A file rewritten while its tensors are in use does not change them (no memory map kept)."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(64)}, str(path))
    a = owned.load_file(path)["a"]
    save_file({"a": torch.zeros(64)}, str(path))
    assert torch.equal(a, torch.ones(64))


def test_own_module_moves_only_misaligned_tensors_and_keeps_values_and_flags() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    m[0].weight.requires_grad_(False)
    kept = m[0].bias.data.data_ptr()
    m[0].weight.data = owned.unaligned_copy(m[0].weight.data)
    m[1].running_mean = owned.unaligned_copy(torch.randn(8))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    owned.own_module(m)
    assert all(owned.is_aligned(t) for t in m.state_dict().values())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert m[0].bias.data.data_ptr() == kept  # an aligned tensor is not copied
    assert not m[0].weight.requires_grad and m[0].bias.requires_grad
    assert isinstance(m[0].weight, torch.nn.Parameter)


def test_own_module_reaches_inside_quantized_weights() -> None:
    quanto = pytest.importorskip("optimum.quanto")
    m = torch.nn.Sequential(torch.nn.Linear(64, 64))
    quanto.quantize(m, weights=quanto.qfloat8)
    quanto.freeze(m)
    x = torch.randn(3, 64)
    want = m(x)
    m[0].weight._data = owned.unaligned_copy(m[0].weight._data)
    owned.own_module(m)
    assert owned.is_aligned(m[0].weight._data) and owned.is_aligned(m[0].weight._scale)
    assert torch.equal(m(x), want)


def test_models_loaded_from_a_folder_are_aligned_even_though_the_library_maps_them(monkeypatch) -> None:
    """diffusers' from_pretrained leaves weights inside the memory-mapped file (at the file's
    offsets); imglora's loaders hand on models whose every CPU tensor is aligned, switch or not."""
    from diffusers import AutoencoderKL

    from imglora.models import tiny
    from imglora.families import registry
    from imglora.models.source import ModelSource

    family = registry.get("sdxl")
    folder = tiny.ensure_tiny(family)
    raw = AutoencoderKL.from_pretrained(folder, subfolder="vae")
    assert any(_misaligned(t) for t in raw.state_dict().values()), "diffusers no longer maps weights in place"
    src = ModelSource(root=Path(folder))
    for switch in ("0", "1"):
        monkeypatch.setenv(owned.UNALIGNED_ENV, switch)
        vae = family.load_vae(src, torch.device("cpu"), torch.float32)
        assert all(owned.is_aligned(t) for t in vae.state_dict().values())
