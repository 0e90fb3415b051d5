"""A diffusers transformer whose block lists the caller names (FLUX.1's, Chroma's, Qwen-Image's) read
block by block, from a single file (the family's reader: BFL's layout for FLUX.1) or a diffusers
folder's (sharded) safetensors alike, each block made ready as it is read: quantized to fp8 with
``memory.fp8`` (on the GPU when there is one: far faster than on the host), then kept on the device,
or on the host when it will be swapped. The host never holds the whole model in its load dtype,
whichever way the model is given (reading a diffusers folder whole and quantizing it afterwards
peaked at the full bf16 model, about 22 GiB for FLUX.1-dev).

With ``memory.fp8`` and ``cache.quantized_base`` the quantized model is also written, block by
block, to ``cache.dir/quantized/<key>/`` (``memory.quantized_cache``); the next run with the same
files and settings reads that instead of the source and skips quantizing.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ...runs import record
from ...util.devices import is_cuda
from ...errors import ModelSourceError
from ...memory.host import release_free_memory
from ...util.owned import own_module
from ...models.safefiles import diffusers_config, open_file

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout

log = logging.getLogger(__name__)

WEIGHTS = "diffusion_pytorch_model.safetensors"

OnBlock = Callable[[str, int, torch.nn.Module], None]  # (list, index, block): a block just read


def transformer_files(root: Path) -> dict[str, Path]:
    """{key: shard file} of a diffusers folder's transformer weights."""
    folder = root / "transformer"
    index = folder / f"{WEIGHTS}.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / f for k, f in weight_map.items()}
    single = folder / WEIGHTS
    if single.is_file():
        with open_file(single) as r:
            return {k: single for k in r.keys}
    raise ModelSourceError(f"{folder}: no {WEIGHTS} (or its .index.json); imglora reads the transformer's "
                           "safetensors weights only")


def load_folder_transformer(root: Path, dtype: torch.dtype, on_block: OnBlock | None = None, *,
                            model_class: str, blocks: Mapping[str, str]) -> Any:
    """FluxTransformer2DModel (or ``model_class``: Chroma's, or any diffusers transformer whose
    block lists ``blocks`` names, {kind: attribute}) from a diffusers folder, built block by block
    as :func:`~.singlefile.load_flux_transformer` builds it from a BFL file."""
    files = transformer_files(root)
    model = meta_model(root, model_class)
    model.requires_grad_(False)  # frozen before assign (assign keeps the meta parameters' flag)
    expected = set(model.state_dict())
    if set(files) != expected:
        missing, extra = sorted(expected - set(files)), sorted(set(files) - expected)
        raise ModelSourceError(f"{root / 'transformer'}: the weights do not match its config.json (missing "
                               f"{missing[:4]}, unexpected {extra[:4]})")
    block_keys = tuple(f"{name}." for name in blocks.values())
    with ExitStack() as stack:
        readers: dict[Path, Any] = {}

        def read(key: str) -> torch.Tensor:
            path = files[key]
            if path not in readers:
                readers[path] = stack.enter_context(open_file(path))
            return readers[path].get(key, dtype)

        model.load_state_dict({k: read(k) for k in files if not k.startswith(block_keys)}, strict=False, assign=True)
        own_module(model)
        for kind, name in blocks.items():
            for index, block in enumerate(getattr(model, name)):
                pre = f"{name}.{index}."
                block.load_state_dict({k[len(pre):]: read(k) for k in files if k.startswith(pre)}, strict=True,
                                      assign=True)
                own_module(block)  # (a no-op unless the test switch put the tensors read at odd addresses)
                if on_block is not None:
                    on_block(kind, index, block)
                release_free_memory()
    return model.eval()


def meta_model(root: Path, model_class: str) -> Any:
    import diffusers

    cls = getattr(diffusers, model_class)
    config = diffusers_config(cls, root, "transformer")
    with torch.device("meta"):
        return cls.from_config(config)


def _read_source(src: Any, dtype: torch.dtype, on_block: OnBlock, model_class: str,
                 file_reader: Callable[..., Any], blocks: Mapping[str, str]) -> Any:
    if src.files:  # a BFL-layout file: FLUX.1's, or (file_reader) another family's single file
        return file_reader(src.files["transformer"], src.root, dtype=dtype, on_block=on_block)
    return load_folder_transformer(src.root, dtype, on_block, model_class=model_class, blocks=blocks)


def _source_checksums(src: Any) -> dict[str, str]:
    if src.files:
        return {"transformer": record.cached_sha256(src.files["transformer"])}
    return {p.name: record.cached_sha256(p) for p in sorted(set(transformer_files(src.root).values()))}


def load_transformer(src: Any, cfg: Any, dtype: torch.dtype, device: torch.device, layout: "SwapLayout",
                     exclude: tuple[str, ...], *, model_class: str, file_reader: Callable[..., Any],
                     blocks: Mapping[str, str]) -> tuple[Any, dict[str, Any]]:
    """The transformer of ``src`` (files or a folder), each block quantized (``memory.fp8``) and
    placed as it is read (``layout``: the swap layout the command computed, whose blocks stay on the host); the quantized
    model cached as the module docstring says. Returns the model and facts for the run record.
    ``model_class``: the diffusers class; ``blocks``: its block lists, {kind: attribute} (FLUX.1's
    ``{"double": "transformer_blocks", "single": "single_transformer_blocks"}``); ``file_reader``:
    how the family's single file is read, block by block (``on_block`` called for each)."""
    from ...memory import quantized_cache
    from ...memory.fp8 import quantize_fp8, to_device

    gpu = is_cuda(device)

    def swapped(kind: str, index: int) -> bool:
        return layout.swaps(blocks[kind], index)

    def place(kind: str, index: int, block: torch.nn.Module) -> None:
        if gpu and not swapped(kind, index):
            to_device(block, device)

    if not cfg.memory.fp8:
        return _read_source(src, dtype, place, model_class, file_reader, blocks), {}
    facts: dict[str, Any] = {}
    entry = None
    if cfg.cache.quantized_base:
        import diffusers

        config = diffusers_config(getattr(diffusers, model_class), src.root, "transformer")
        settings = {"kind": "fp8", "dtype": str(dtype), "exclude": list(exclude),
                    "config": {k: v for k, v in config.items() if not k.startswith("_")}}
        sources = _source_checksums(src)
        entry = Path(cfg.cache.dir).expanduser() / "quantized" / quantized_cache.key(sources, settings)
        facts["quantized_cache"] = {"entry": str(entry)}
        if (entry / "entry.json").is_file():
            model = meta_model(src.root, model_class)
            parts = [(f"{name}.{i}.", block) for kind, name in blocks.items()
                     for i, block in enumerate(getattr(model, name))]
            kinds = {f"{name}.{i}.": (kind, i) for kind, name in blocks.items()
                     for i in range(len(getattr(model, name)))}
            try:
                quantized_cache.load(entry, model, parts, dtype, lambda p, block: place(*kinds[p], block))
                facts["quantized_cache"]["hit"] = True
                log.info(f"fp8: read the quantized transformer from {entry} (no quantization this run)")
                return model.eval(), facts
            except quantized_cache.DamagedEntry as e:
                log.warning(f"the quantized-model cache entry is damaged and is rebuilt: {e}")
        writer = quantized_cache.Writer(entry, {**settings, "sources": sources})

    def ready(kind: str, index: int, block: torch.nn.Module) -> None:
        if gpu:
            to_device(block, device)
        quantize_fp8(block, exclude, prefix=f"{blocks[kind]}.{index}.")
        if entry is not None:
            writer.add(f"{blocks[kind]}.{index}.", block)
        if gpu and swapped(kind, index):
            to_device(block, "cpu")

    try:
        model = _read_source(src, dtype, ready, model_class, file_reader, blocks)
        if entry is not None:
            writer.finish(model)
            facts["quantized_cache"].update(hit=False, bytes=writer.bytes)
            log.info(f"fp8: quantized transformer kept in {entry} ({writer.bytes / 2**30:.2f} GiB) for the next run")
    except BaseException:
        if entry is not None:
            writer.abandon()
        raise
    return model, facts
