"""FLUX.1 transformer from a BFL-layout file (flux1-dev.safetensors, its fp8 variants, or the
``model.diffusion_model.`` part of a ComfyUI checkpoint), streamed block by block.

The bf16 transformer is 24 GB; a machine that can train FLUX with block swapping or quantization
often cannot hold a second full copy while converting. So the model is built on the meta device,
and each block is read (through the memory map), converted and materialized on its own, then
handed to ``on_block`` (to quantize it, pin it, move it to the GPU) before the next one is read.
Host memory in use stays at what the caller keeps plus about one block.

diffusers' ``convert_flux_transformer_checkpoint_to_diffusers`` is not used: it converts a full
in-memory dict, hard-codes the FLUX.1 width (3072), and ignores fp8 scale keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from ...errors import ModelSourceError
from ...memory.host import release_free_memory
from ...util.owned import own_module
from ...models.safefiles import PathLike, Reader, diffusers_config, open_file
from .._shared.singlefile.inspect import expect
from .._shared.stream import OnBlock

# A diffusers key's source: (BFL key without prefix, rows of it or None for all, op). op "copy";
# or "swap": the two halves exchanged (BFL's final adaLN is [shift; scale], diffusers' [scale; shift]).
Source = tuple[str, tuple[int, int] | None, Literal["copy", "swap"]]

MLP_RATIO = 4.0  # FluxTransformer2DModel's blocks (and BFL's) use 4x width, not configurable
BLOCKS = {"double": "transformer_blocks", "single": "single_transformer_blocks"}
# FluxTransformer2DModel's defaults (its __init__), for configs that leave keys out.
_DEFAULTS = {"num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
             "guidance_embeds": False}


def flux_plan(config: Mapping[str, Any]) -> dict[str, Source]:
    """Every key of ``FluxTransformer2DModel(**config)`` -> where it is in a BFL file.

    The fused BFL tensors are split by rows: ``img_attn.qkv`` / ``txt_attn.qkv`` into q, k, v and
    a single block's ``linear1`` into q, k, v and the MLP input (H, H, H, 4H rows). RMSNorm
    ``.scale`` becomes ``.weight``. (ComfyUI ``comfy/utils.py::flux_to_diffusers``, kohya
    ``flux_utils.BFL_TO_DIFFUSERS_MAP``.)
    """
    c = {**_DEFAULTS, **config}
    hidden = c["num_attention_heads"] * c["attention_head_dim"]
    mlp = int(hidden * MLP_RATIO)
    plan: dict[str, Source] = {}

    def linear(d: str, b: str, rows: tuple[int, int] | None = None, op: Literal["copy", "swap"] = "copy") -> None:
        for e in ("weight", "bias"):
            plan[f"{d}.{e}"] = (f"{b}.{e}", rows, op)

    def norm(d: str, b: str) -> None:
        plan[f"{d}.weight"] = (f"{b}.scale", None, "copy")

    linear("x_embedder", "img_in")
    linear("context_embedder", "txt_in")
    embedders = [("timestep_embedder", "time_in"), ("text_embedder", "vector_in")]
    if c["guidance_embeds"]:
        embedders.append(("guidance_embedder", "guidance_in"))
    for d, b in embedders:
        linear(f"time_text_embed.{d}.linear_1", f"{b}.in_layer")
        linear(f"time_text_embed.{d}.linear_2", f"{b}.out_layer")
    linear("proj_out", "final_layer.linear")
    linear("norm_out.linear", "final_layer.adaLN_modulation.1", op="swap")

    thirds = [(n * hidden, (n + 1) * hidden) for n in range(3)]
    for i in range(c["num_layers"]):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for rows, img, txt in zip(thirds, ("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj")):
            linear(d + "attn." + img, b + "img_attn.qkv", rows)
            linear(d + "attn." + txt, b + "txt_attn.qkv", rows)
        for dn, bn in (("norm1.linear", "img_mod.lin"), ("norm1_context.linear", "txt_mod.lin"),
                       ("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"),
                       ("ff.net.0.proj", "img_mlp.0"), ("ff.net.2", "img_mlp.2"),
                       ("ff_context.net.0.proj", "txt_mlp.0"), ("ff_context.net.2", "txt_mlp.2")):
            linear(d + dn, b + bn)
        for dn, bn in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                       ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):
            norm(d + "attn." + dn, b + bn)
    for i in range(c["num_single_layers"]):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        parts = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
        for rows, dn in zip([*thirds, (3 * hidden, 3 * hidden + mlp)], parts):
            linear(d + dn, b + "linear1", rows)
        linear(d + "proj_out", b + "linear2")
        linear(d + "norm.linear", b + "modulation.lin")
        norm(d + "attn.norm_q", b + "norm.query_norm")
        norm(d + "attn.norm_k", b + "norm.key_norm")
    return plan


def load_flux_transformer(path: PathLike, config: Mapping[str, Any] | PathLike, *, dtype: torch.dtype,
                          device: torch.device | str = "cpu", on_block: OnBlock | None = None,
                          model_class: str = "FluxTransformer2DModel", kind: str = "flux-transformer",
                          planner: Callable[[Mapping[str, Any]], dict[str, Source]] | None = None) -> Any:
    """FluxTransformer2DModel from the BFL file ``path``, built block by block.

    ``config``: the transformer config dict (``FluxTransformer2DModel.load_config(folder)``, the
    contents of a FLUX.1 transformer/config.json), or that folder / a diffusers FLUX folder. Weights are created directly on ``device`` in
    ``dtype``; fp8 sources are upcast tensor by tensor (times their ``scale_weight`` /
    ``weight_scale`` if the file has them). ``on_block(kind, index, block)`` is called with kind
    "double" or "single" as soon as a block is complete, before the next one is read.

    The whole file header is checked against the model before any weight is read, so a wrong file
    (schnell for dev, another width, missing blocks) fails at once, naming the keys.

    ``model_class``, ``kind`` and ``planner``: another transformer in BFL's layout with FLUX.1's
    blocks (Chroma's: its diffusers class, its file kind, its key plan).
    """
    import diffusers

    cls = getattr(diffusers, model_class)
    layout = expect(path, kind)
    config = diffusers_config(cls, config, "transformer")
    with torch.device("meta"):
        model = cls.from_config(config)
    # A base model's weights are frozen; load_state_dict(assign=True) keeps this flag of the meta
    # parameters it replaces, and quantize_fp8 leaves trainable weights alone.
    model.requires_grad_(False)
    plan = (planner or flux_plan)(dict(model.config))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if set(plan) != set(shapes):  # a diffusers change, not a user error
        raise RuntimeError(f"the key plan does not cover {model_class}: {sorted(set(shapes) ^ set(plan))[:8]}")
    block_keys = tuple(f"{name}." for name in BLOCKS.values())
    with open_file(path) as r:
        _check_header(r, layout.prefix, plan, shapes, layout.variant,
                      bool(getattr(model.config, "guidance_embeds", False)))
        rest = {k: _read(r, layout.prefix + src, rows, op, dtype, device)
                for k, (src, rows, op) in plan.items() if not k.startswith(block_keys)}
        missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
        assert not unexpected and all(k.startswith(block_keys) for k in missing)
        del rest
        own_module(model)
        for kind, name in BLOCKS.items():
            for index, block in enumerate(getattr(model, name)):
                pre = f"{name}.{index}."
                state = {k[len(pre):]: _read(r, layout.prefix + src, rows, op, dtype, device)
                         for k, (src, rows, op) in plan.items() if k.startswith(pre)}
                # assign: the tensors just read become the parameters. to_empty + a copying
                # load_state_dict would hold the block twice for a moment.
                block.load_state_dict(state, strict=True, assign=True)
                del state
                own_module(block)  # (a no-op unless the test switch put the tensors read at odd addresses)
                if on_block is not None:
                    on_block(kind, index, block)
                release_free_memory()  # the block's full-precision tensors, freed by quantizing or moving it
    return model.eval()


def _read(r: Reader, key: str, rows: tuple[int, int] | None, op: str, dtype: torch.dtype,
          device: torch.device | str) -> torch.Tensor:
    tensor = r.get(key, dtype, device=device, rows=rows)
    if op == "swap":
        shift, scale = tensor.chunk(2, dim=0)
        tensor = torch.cat([scale, shift])
    return tensor


def _check_header(r: Reader, prefix: str, plan: Mapping[str, Source], shapes: Mapping[str, tuple[int, ...]],
                  variant: str | None, guidance: bool) -> None:
    """Every BFL tensor the plan needs is in the file with the shape the model needs, the fused
    ones split exactly, and the file has no transformer tensor the model would not use."""
    if variant == "schnell" and guidance:
        raise ModelSourceError(f"{r.path} is FLUX.1-schnell (it has no guidance_in weights), but the config has "
                               "guidance_embeds=true (FLUX.1-dev); use a schnell config (guidance_embeds=false)")
    if variant == "dev" and not guidance:
        raise ModelSourceError(f"{r.path} is FLUX.1-dev (it has guidance_in weights), but the config has "
                               "guidance_embeds=false (FLUX.1-schnell); use the dev config")
    missing, wrong = [], []
    rows_end: dict[str, int] = {}
    for key, (src, rows, _op) in plan.items():
        full = prefix + src
        if full not in r.key_set:
            missing.append(full)
            continue
        have = r.shape(full)
        want = shapes[key]
        if rows is not None:
            rows_end[full] = max(rows_end.get(full, 0), rows[1])
            ok = have[1:] == want[1:] and rows[1] - rows[0] == want[0]
        else:
            ok = have == want
        if not ok:
            wrong.append(f"{full} {list(have)} (the model's {key} needs {list(want)})")
    wrong += [f"{k} has {r.shape(k)[0]} rows, the model needs {end}" for k, end in rows_end.items()
              if r.shape(k)[0] != end]
    used = {prefix + src for src, _, _ in plan.values()}
    # with_prefix skips side keys; in a full checkpoint the other parts lie outside the prefix.
    extra = [k for k in r.with_prefix(prefix) if k not in used]
    problems = [f"{len(v)} {label}: {', '.join(map(str, v[:6]))}{', ...' if len(v) > 6 else ''}"
                for label, v in (("missing", sorted(missing)), ("with another shape", wrong),
                                 ("not in the model", sorted(extra))) if v]
    if problems:
        raise ModelSourceError(f"{r.path}: the FLUX transformer does not fit the config given (layers, width, "
                               "channels): " + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# The family's single-file model source
# --------------------------------------------------------------------------------------------

CONFIGS = Path(__file__).parent / "configs"
CLIP_TOKENIZER = [("black-forest-labs/FLUX.1-dev", "tokenizer"), ("black-forest-labs/FLUX.1-schnell", "tokenizer"),
                  ("openai/clip-vit-large-patch14", "")]
T5_TOKENIZER = [("black-forest-labs/FLUX.1-dev", "tokenizer_2"), ("black-forest-labs/FLUX.1-schnell", "tokenizer_2"),
                ("google/t5-v1_1-xxl", "")]
# part -> (preset key, ComfyUI folders, the kind of file, an example name, its part name inside a full checkpoint)
PARTS = {
    "text_encoder": ("text_encoder", ("text_encoders",), "clip-l", "clip_l.safetensors", "clip_l"),
    "text_encoder_2": ("text_encoder_2", ("text_encoders",), "t5xxl", "t5xxl_fp16.safetensors", "t5xxl"),
    "vae": ("vae", ("vae",), "vae-flux", "ae.safetensors", "vae"),
}


def resolve_files(model: Any, find: Any, overlay: Path | None = None) -> Any:
    """The transformer file (``model.path``, in ComfyUI's diffusion_models folder, or a full
    checkpoint), its text encoders and VAE (``model.text_encoder``, ``model.text_encoder_2``,
    ``model.vae``; parts a full checkpoint holds may be left out), and the folder of FLUX.1-dev's or
    -schnell's configs (as the file says) with CLIP's and T5's tokenizers. ``overlay``: configs of a
    model built on FLUX.1-dev's transformer (FLUX.1 Kontext), named as that folder; its file must be
    a dev (guidance-distilled) one."""
    from ...models.source import ModelSource
    from .._shared.singlefile.configdir import assemble, find_tokenizer, override

    path = find(model.path, ("diffusion_models", "checkpoints"), "model.path")
    layout = expect(path, "flux-transformer")
    files = {"transformer": path}
    missing = []
    for part, (key, folders, kind, example, inside) in PARTS.items():
        name = getattr(model, key)
        if name:
            files[part] = find(name, folders, f"model.{key}")
            expect(files[part], kind, also=("flux-transformer",))
        elif inside in layout.parts:
            files[part] = path
        else:
            missing.append(f"model.{key} (e.g. {example})")
    if missing:
        raise ModelSourceError(f"{path} is a FLUX.1 transformer alone; FLUX also needs its text encoders and VAE as "
                               f"files: set {', '.join(missing)}")
    if overlay is not None and layout.variant != "dev":
        raise ModelSourceError(f"{path} is a FLUX.1-{layout.variant} transformer (no guidance embedding); "
                               f"{overlay.name} is built on FLUX.1-dev: give its own file "
                               f"(e.g. {overlay.name}.safetensors)")
    if model.config:
        return ModelSource(override(model.config), files)
    clip, _ = find_tokenizer("clip", CLIP_TOKENIZER, model.comfyui, "FLUX's CLIP-L")
    t5, _ = find_tokenizer("t5", T5_TOKENIZER, model.comfyui, "FLUX's T5")
    variant = f"flux1-{layout.variant}"  # dev (guidance-distilled) or schnell, as the file says
    root = assemble(overlay.name if overlay else variant, CONFIGS / variant, {"tokenizer": clip, "tokenizer_2": t5},
                    {"tokenizer": {"model_max_length": 77}}, overlay)
    return ModelSource(root, files)


def load_vae(src: Any, dtype: torch.dtype) -> Any:
    from .._shared.singlefile.text import load_flux_vae

    return load_flux_vae(src.files["vae"], src.root, dtype)


def load_text_encoders(src: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    from .._shared.singlefile.text import load_clip_l, load_t5

    return (load_clip_l(src.files["text_encoder"], src.root, dtype),
            load_t5(src.files["text_encoder_2"], src.root, dtype))


def base_weights(src: Any, component: str, paths: list[str]) -> dict[str, torch.Tensor]:
    """fp32 weights (``<path>.weight``) of modules of a single-file FLUX model, as the diffusers
    model holds them (q/k/v: their rows of the fused BFL weight; norm_out: halves swapped)."""
    if component == "text_encoder":
        from .._shared.singlefile.text import load_clip_l

        clip = load_clip_l(src.files["text_encoder"], src.root, torch.float32)
        return {p: clip.get_submodule(p).weight.detach() for p in paths}
    if component != "transformer":
        raise ModelSourceError(f"no base weights of the FLUX {component} are read for export")
    from diffusers import FluxTransformer2DModel

    plan = flux_plan(diffusers_config(FluxTransformer2DModel, src.root, "transformer"))
    return plan_weights(src.files["transformer"], "flux-transformer", plan, paths)


def plan_weights(path: PathLike, kind: str, plan: Mapping[str, Source], paths: list[str]) -> dict[str, torch.Tensor]:
    """fp32 ``<path>.weight`` of each module path, read from a BFL-layout file through its key plan."""
    layout = expect(path, kind)
    with open_file(path) as r:
        return {p: _read(r, layout.prefix + plan[f"{p}.weight"][0], *plan[f"{p}.weight"][1:], torch.float32, "cpu")
                for p in paths}
