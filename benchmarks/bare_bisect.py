"""A bare control on the GPU: LoRA training of FLUX.1-dev, SDXL and a 7B chat model with nothing of
imglora (diffusers / transformers, peft, torch's AdamW), each case in a process of its own, to tell
"imglora's bug" from "the stack's bug" and to find which attention kernel trains finite.

    python3 benchmarks/bare_bisect.py --out DIR               # every case, within --budget (470 s)
    python3 benchmarks/bare_bisect.py --cases env,kernels,flux:flash:1024 --out DIR
    python3 benchmarks/bare_bisect.py --tiny --out DIR        # the CPU dry run: tiny models, the same code

What it answers, case by case (the first H200 run: every imglora setting NaN from the second update,
an illegal memory access at 1024 px even in plain bf16):

- ``env``: versions, the GPU, PyTorch's SDPA priority order before and after the first CUDA attention
  call (CUDA 13 builds move cuDNN first on compute capability 9.0/10.0 at that call), and the kernel
  PyTorch picks at FLUX's layout (``[B, S, H, D]`` permuted to ``[B, H, S, D]``, bf16, with grad).
- ``kernels``: each kernel alone (PyTorch's default order, cudnn, flash, efficient, math in bf16),
  forward and backward at 4608 and 1536 tokens (FLUX.1 at 1024 and 512 px with its 512 text tokens:
  4096 + 512 and 1024 + 512), ten asynchronous repetitions, against float32 math: finite or not,
  the largest error relative to the reference's largest value, milliseconds per forward + backward.
- ``flux:KERNEL:RES[:anomaly|:blocking]``: the full FLUX.1-dev transformer (random weights: no
  download), LoRA rank 16 on imglora's target layers in fp32, AdamW, clipping at 1.0, bf16 autocast,
  gradient checkpointing, 3 updates with the kernel named (``default``: PyTorch's own order, what a
  plain diffusers loop gets; ``auto``: imglora's flash, efficient, math). Each update reports its
  loss, gradient norm, the number of LoRA gradients that are not finite and the latest module in
  forward order among them (a NaN made in block k's backward reaches every block before k, so the
  latest is where it was made), and whether the weights were finite before it. ``anomaly``: one
  update under autograd's anomaly detection (names the first backward op that makes a NaN);
  ``blocking``: one update with ``CUDA_LAUNCH_BLOCKING=1`` (a crash that goes away then is an
  ordering fault). No offload, no swap, no fp8: imglora's bf16:0 path without imglora.
- ``sdxl:KERNEL:1024``: the full SDXL UNet, bf16, LoRA on the attention projections, 5 updates.
- ``llm:KERNEL:2048``: Qwen2.5-7B-Instruct's architecture, bf16 base (the 4-bit base is imglora's
  own path: its bench-swap runs it), LoRA on every projection, 5 updates of 2048 tokens.

Each case prints ``RESULT {json}`` lines; the parent adds its own line per case (status ``ok``,
``nonfinite``, ``died`` with the exit code and the last error lines, ``timeout``, ``skipped`` when
the budget is spent, ``failed`` with the exception's line (a CUDA error, a kernel that cannot run),
``error`` when the case could not start, e.g. a missing library), and ends with
``SUMMARY {json}``: each kernel's training verdict, the kernels that trained finite, and ``kernel``,
the one to run imglora with next (flash, efficient, math, in that order of preference; written to
``DIR/kernel`` too). Everything is in ``DIR/bisect.jsonl`` and ``DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

# (case, seconds it may take on an H200, extra environment), in order of value: the budget may end
# the list early. The kernel comparison comes before the anomaly and blocking reruns.
CASES: list[tuple[str, int, dict[str, str]]] = [
    ("env", 60, {}),
    ("kernels", 90, {}),
    ("flux:default:1024", 110, {}),
    ("flux:flash:1024", 90, {}),
    ("flux:efficient:1024", 90, {}),
    ("flux:default:1024:blocking", 90, {"CUDA_LAUNCH_BLOCKING": "1"}),
    ("flux:default:1024:anomaly", 100, {}),
    ("flux:default:512", 70, {}),
    ("flux:math:1024", 110, {}),
    ("sdxl:auto:1024", 90, {}),
    ("llm:auto:2048", 110, {}),
]
BUDGET = 470  # seconds for all cases: the bisect is one GPU command of at most 8 minutes
KERNEL_PREFERENCE = ("flash", "efficient", "math")  # imglora's memory.attention_kernel = "auto" on CUDA

FLUX_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2", "proj_mlp", "proj_out")
SDXL_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
LLM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

TINY = False  # set by --tiny (children: IMGLORA_BISECT_TINY=1)


def emit(**fields: Any) -> None:
    print("RESULT " + json.dumps(fields, default=str), flush=True)


# ---------------------------------------------------------------------------------------------
# Helpers shared by the cases (run inside a child)

def device() -> Any:
    import torch

    return torch.device("cpu" if TINY else "cuda")


def sync() -> None:
    import torch

    if device().type == "cuda":
        torch.cuda.synchronize()


def backend_names() -> dict[int, str]:
    from torch.nn.attention import SDPBackend

    return {int(getattr(SDPBackend, n)): n.lower().removesuffix("_attention")
            for n in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION", "OVERRIDEABLE")
            if hasattr(SDPBackend, n)}


def priority_order() -> list[str]:
    import torch

    names = backend_names()
    return [names.get(int(b), str(b)) for b in torch._C._get_sdp_priority_order()]


def kernel_context(kernel: str) -> Any:
    """``default``: nothing set (PyTorch's order); ``auto``: imglora's CUDA list; else that kernel alone."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    table = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    if kernel == "default" or (kernel == "auto" and TINY):
        return contextlib.nullcontext()
    names = KERNEL_PREFERENCE if kernel == "auto" else (kernel,)
    return sdpa_kernel([table[k] for k in names], set_priority=True)


def init_weights(model: Any, seed: int) -> None:
    """Random weights by one rule for every case: norm scales 1, biases 0, other tensors N(0, 0.02)."""
    import torch

    gen = torch.Generator(device=device()).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.empty(p.shape, device=p.device, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))


def add_lora(model: Any, targets: tuple[str, ...], rank: int, alpha: int, regex: str | None = None) -> tuple[list[str], list[Any]]:
    """peft LoRA on ``targets``, base frozen, LoRA weights in fp32 (as imglora trains them)."""
    import re

    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    target = regex or rf".*\.({'|'.join(map(re.escape, targets))})"
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=target), model)
    names, params = [], []
    for name, p in model.named_parameters():
        trainable = ".lora_A." in name or ".lora_B." in name
        p.requires_grad_(trainable)
        if trainable:
            p.data = p.data.float()
            names.append(name)
            params.append(p)
    return names, params


def train(case: str, names: list[str], params: list[Any], loss_fn: Callable[[int], Any], updates: int,
          kernel: str, anomaly: bool = False, lr: float = 1e-4) -> None:
    """``updates`` plain updates (forward and backward under one kernel, clip 1.0, AdamW); one RESULT
    line per update."""
    import torch

    dev = device()
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if anomaly:
        torch.autograd.set_detect_anomaly(True, check_nan=True)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for update in range(1, updates + 1):
        weights_finite = all(bool(torch.isfinite(p).all()) for p in params)
        sync()
        t0 = time.perf_counter()
        with kernel_context(kernel):  # forward, backward and checkpointing's recompute: one kernel
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = loss_fn(update)
            loss.backward()
        bad = [n for n, p in zip(names, params) if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
        reserved = torch.cuda.max_memory_reserved() if dev.type == "cuda" else None
        emit(case=case, update=update, loss=float(loss), grad_norm=float(norm), nonfinite_grads=len(bad),
             nonfinite_grad_origin=bad[-1].split(".lora_")[0] if bad else None, weights_finite_before=weights_finite,
             seconds=round(seconds, 3), peak_allocated=peak, peak_reserved=reserved)


# ---------------------------------------------------------------------------------------------
# Cases

def case_env(case: str) -> None:
    import torch

    dev = device()
    before = priority_order()
    s, h, d = (96, 2, 64) if TINY else (4608, 24, 128)
    q = torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    after = priority_order()
    chosen = None
    if dev.type == "cuda":  # the kernel PyTorch's own order picks for a training call at FLUX's layout
        g = torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
        chosen = backend_names().get(int(torch._fused_sdp_choice(g, g, g)))
    emit(case=case, torch=torch.__version__, cuda=torch.version.cuda,
         cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
         gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
         capability=list(torch.cuda.get_device_capability()) if dev.type == "cuda" else None,
         order_before_first_call=before, order_after_first_call=after, default_choice_flux_layout=chosen,
         python=sys.version.split()[0], packages=_versions("diffusers", "transformers", "peft", "accelerate",
                                                            "optimum-quanto"))


def _versions(*names: str) -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def case_kernels(case: str) -> None:
    import torch

    dev = device()
    f = torch.nn.functional
    heads, dim = (2, 64) if TINY else (24, 128)
    lengths = (96,) if TINY else (4608, 1536)
    kernels = ("default", "math") if TINY else ("default", "cudnn", "flash", "efficient", "math")
    for length in lengths:
        gen = torch.Generator(device=dev).manual_seed(length)
        q, k, v, up = (torch.randn(1, length, heads, dim, device=dev, generator=gen) for _ in range(4))

        def run(kernel: str, reference: bool = False) -> tuple[Any, list[Any]]:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            dtype = torch.float32 if reference else torch.bfloat16
            with kernel_context("math" if reference else kernel):
                out = f.scaled_dot_product_attention(*(t.to(dtype).transpose(1, 2) for t in leaves))
                out.transpose(1, 2).float().backward(up)
            return out.float(), [t.grad for t in leaves]

        ref_out, ref_grads = run("math", reference=True)
        for kernel in kernels:
            try:
                run(kernel)  # warm-up (kernel selection, workspace)
                sync()
                t0 = time.perf_counter()
                for _ in range(10):  # asynchronous: the host queues all ten, as a training loop does
                    out, grads = run(kernel)
                sync()
                ms = (time.perf_counter() - t0) / 10 * 1000
                finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
                errors = [float((a - b).abs().max() / b.abs().max()) for a, b in zip([out, *grads], [ref_out, *ref_grads])]
                emit(case=case, kernel=kernel, tokens=length, finite=finite, ms_fwd_bwd=round(ms, 3),
                     max_rel_error={"out": errors[0], "dq": errors[1], "dk": errors[2], "dv": errors[3]})
            except Exception as exc:  # a kernel that cannot run here, or fails: the others still run
                emit(case=case, kernel=kernel, tokens=length, error=_first_line(exc))
                if "illegal memory access" in str(exc):
                    return  # the CUDA context is gone; the parent reports the rest as not run


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def flux_model() -> tuple[Any, Any]:
    import torch
    from diffusers import FluxTransformer2DModel

    config: dict[str, Any] = {"guidance_embeds": True}  # FLUX.1-dev; the other defaults are its shape
    if TINY:
        config.update(num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                      joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    model = model.to(torch.bfloat16).to_empty(device=device())  # bf16 on meta first: no fp32 copy
    init_weights(model, seed=1)
    model.enable_gradient_checkpointing()
    return model, model.config


def case_flux(case: str, kernel: str, resolution: int, mode: str) -> None:
    import torch

    dev = device()
    t0 = time.perf_counter()
    model, c = flux_model()
    torch.manual_seed(0)  # LoRA A's initialisation
    names, params = add_lora(model, FLUX_TARGETS, 16, 16, regex=rf"(transformer_blocks|single_transformer_blocks)"
                             rf"\.\d+\.({'|'.join(t.replace('.', chr(92) + '.') for t in FLUX_TARGETS)})")
    model.train()
    side = (64 if TINY else resolution) // 16  # latent side after the 2x2 packing (VAE factor 8)
    tokens = 16 if TINY else 512
    gen = torch.Generator(device=dev).manual_seed(0)
    x0 = torch.randn(1, side * side, c.in_channels, device=dev, generator=gen)
    text = torch.randn(1, tokens, c.joint_attention_dim, device=dev, generator=gen)
    pooled = torch.randn(1, c.pooled_projection_dim, device=dev, generator=gen)
    img_ids = torch.zeros(side, side, 3, device=dev)
    img_ids[..., 1] = torch.arange(side, device=dev)[:, None]
    img_ids[..., 2] = torch.arange(side, device=dev)[None, :]
    img_ids = img_ids.reshape(-1, 3)
    txt_ids = torch.zeros(tokens, 3, device=dev)
    emit(case=case, phase="built", seconds=round(time.perf_counter() - t0, 1), lora_tensors=len(params),
         image_tokens=side * side, text_tokens=tokens)

    def loss(update: int) -> Any:  # flow matching, FLUX.1-dev's shifted sigmoid timesteps, guidance 1
        g = torch.Generator(device=dev).manual_seed(update)
        noise = torch.randn(x0.shape, device=dev, generator=g)
        u = torch.sigmoid(torch.randn(1, device=dev, generator=g))
        sigma = u * 3.1582 / (1 + 2.1582 * u)
        noisy = (1 - sigma) * x0 + sigma * noise
        pred = model(hidden_states=noisy, encoder_hidden_states=text, pooled_projections=pooled, timestep=sigma,
                     guidance=torch.ones(1, device=dev), img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        return (pred.float() - (noise - x0)).pow(2).mean()

    one = mode in ("anomaly", "blocking")
    train(case, names, params, loss, 1 if one else 3, kernel, anomaly=mode == "anomaly")


def case_sdxl(case: str, kernel: str, resolution: int) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    dev = device()
    config: dict[str, Any] = dict(  # SDXL 1.0 base's UNet
        sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816)
    if TINY:
        config.update(block_out_channels=(32, 64, 64), transformer_layers_per_block=(1, 1, 1),
                      attention_head_dim=(2, 4, 4), cross_attention_dim=32, addition_time_embed_dim=8,
                      projection_class_embeddings_input_dim=32 + 6 * 8, norm_num_groups=32)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = UNet2DConditionModel(**config)
    model = model.to(torch.bfloat16).to_empty(device=dev)  # bf16 on meta first: no fp32 copy
    init_weights(model, seed=1)
    model.enable_gradient_checkpointing()
    torch.manual_seed(0)
    names, params = add_lora(model, SDXL_TARGETS, 16, 16)
    model.train()
    side = (32 if TINY else resolution) // 8
    pooled_dim = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    gen = torch.Generator(device=dev).manual_seed(0)
    x0 = torch.randn(1, 4, side, side, device=dev, generator=gen)
    text = torch.randn(1, 77, config["cross_attention_dim"], device=dev, generator=gen)
    cond = {"text_embeds": torch.randn(1, pooled_dim, device=dev, generator=gen),
            "time_ids": torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]], device=dev,
                                     dtype=torch.float32)}
    alphas = torch.cumprod(1 - torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, device=dev) ** 2, 0)
    emit(case=case, phase="built", seconds=round(time.perf_counter() - t0, 1), lora_tensors=len(params))

    def loss(update: int) -> Any:  # epsilon prediction, DDPM's scaled-linear schedule
        g = torch.Generator(device=dev).manual_seed(update)
        noise = torch.randn(x0.shape, device=dev, generator=g)
        t = torch.randint(0, 1000, (1,), device=dev, generator=g)
        a = alphas[t].view(1, 1, 1, 1)
        pred = model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, encoder_hidden_states=text,
                     added_cond_kwargs=cond, return_dict=False)[0]
        return (pred.float() - noise).pow(2).mean()

    train(case, names, params, loss, 5, kernel)


def case_llm(case: str, kernel: str, length: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dev = device()
    sizes = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064)  # Qwen2.5-7B-Instruct
    if TINY:
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
        length = 64
    config = Qwen2Config(**sizes, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device=dev)  # bf16 on meta first: no fp32 copy
    init_weights(model, seed=1)
    with torch.device(dev):  # the rotary frequencies are buffers computed at init: on meta they were not
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    torch.manual_seed(0)
    names, params = add_lora(model, LLM_TARGETS, 16, 32)
    model.train()
    ids = torch.randint(0, sizes["vocab_size"], (1, length), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(0))
    emit(case=case, phase="built", seconds=round(time.perf_counter() - t0, 1), lora_tensors=len(params), tokens=length)
    train(case, names, params, lambda update: model(input_ids=ids, labels=ids).loss, 5, kernel, lr=2e-4)


def run_case(case: str) -> None:
    parts = case.split(":")
    if parts[0] == "env":
        case_env(case)
    elif parts[0] == "kernels":
        case_kernels(case)
    elif parts[0] == "flux":
        case_flux(case, parts[1], int(parts[2]), parts[3] if len(parts) > 3 else "")
    elif parts[0] == "sdxl":
        case_sdxl(case, parts[1], int(parts[2]))
    elif parts[0] == "llm":
        case_llm(case, parts[1], int(parts[2]))
    elif parts[0] == "die":  # the dry run's check that a dying case ends only itself
        os.abort()
    else:
        raise SystemExit(f"unknown case {case!r}")


# ---------------------------------------------------------------------------------------------
# The parent: each case in a fresh process, within the budget

def parse_case(case: str) -> tuple[int, dict[str, str]]:
    for name, seconds, env in CASES:
        if name == case:
            return seconds, env
    if case.startswith(("flux:", "sdxl:", "llm:", "die")):
        return 110, {"CUDA_LAUNCH_BLOCKING": "1"} if case.endswith(":blocking") else {}
    raise SystemExit(f"unknown case {case!r}; known: {', '.join(n for n, _, _ in CASES)}")


def verdict(case: str, rows: list[dict[str, Any]], rc: int | None, timed_out: bool, tail: str) -> dict[str, Any]:
    """The parent's line for a case: its status from how the process ended and what it reported."""
    updates = [r for r in rows if "update" in r]
    line: dict[str, Any] = {"case": case, "parent": True}
    if timed_out:
        line.update(status="timeout")
    elif rc != 0:
        line.update(status={3: "error", 4: "failed"}.get(rc, "died"), exit_code=rc, error=tail)
    elif updates and not all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in updates):
        first = next(r for r in updates if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])))
        line.update(status="nonfinite", first_nonfinite_update=first["update"], origin=first["nonfinite_grad_origin"])
    else:
        line.update(status="ok")
    if updates:
        line.update(losses=[r["loss"] for r in updates], grad_norms=[r["grad_norm"] for r in updates],
                    seconds=[r["seconds"] for r in updates], peak_allocated=updates[-1]["peak_allocated"],
                    peak_reserved=updates[-1]["peak_reserved"])
    return line


def error_tail(stderr: str) -> str:
    """The exception lines of a dead child, not its C++ frames."""
    lines = [x for x in stderr.splitlines() if x.strip() and not x.lstrip().startswith(("frame #", "File ", "^"))]
    keys = [x for x in lines if "Error" in x or "error" in x or "Abort" in x or "terminate" in x]
    return " | ".join((keys or lines)[-3:])[:600]


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    by_case = {x["case"]: x for x in lines if x.get("parent")}
    env = next((x for x in lines if x.get("case") == "env" and not x.get("parent")), {})
    training: dict[str, str] = {}
    for case, line in by_case.items():
        parts = case.split(":")
        if parts[0] == "flux" and len(parts) == 3 and parts[2] == "1024":
            training[parts[1]] = line["status"]
    finite = [k for k, s in training.items() if s == "ok"]
    kernel = next((k for k in KERNEL_PREFERENCE if k in finite), None)
    default_kernel = env.get("default_choice_flux_layout")
    if not training:
        cause = "no FLUX training case ran"
    elif training.get("default") == "ok":
        cause = ("a bare loop with PyTorch's default kernel trains finite: if imglora's own run does not, the "
                 "fault is imglora's (compare its bf16:0 run with this case)")
    elif kernel is not None and training.get("default") in ("nonfinite", "died", "failed"):
        cause = (f"PyTorch's default kernel ({default_kernel or 'unknown'}) fails bare ({training['default']}) and "
                 f"{kernel} trains finite: the attention kernel is the cause; imglora's auto avoids cuDNN")
    elif not any(s in ("ok", "nonfinite", "died", "failed") for s in training.values()):
        cause = "not measured: no FLUX training case finished or failed on its own (" + ", ".join(
            f"{k}: {s}" for k, s in training.items()) + ")"
    elif not finite:
        cause = "no kernel trains finite bare: the stack (driver, torch, diffusers) or the model itself"
    else:
        cause = "inconclusive: see the cases"
    return {"flux_1024": training, "finite_kernels": finite, "kernel": kernel, "default_kernel": default_kernel,
            "cause": cause, "cases": {c: x["status"] for c, x in by_case.items()}}


def main() -> int:
    global TINY
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated cases (default: all, in order of value)")
    parser.add_argument("--out", type=Path, help="folder for bisect.jsonl, summary.json and kernel")
    parser.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for all cases (default {BUDGET})")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (the dry run)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child: run this one case
    args = parser.parse_args()
    TINY = args.tiny or os.environ.get("IMGLORA_BISECT_TINY") == "1"
    if args.case:
        try:
            run_case(args.case)
        except ImportError as exc:  # a library the case needs is not there: said, not a crash
            emit(case=args.case, error=_first_line(exc))
            return 3
        except Exception as exc:  # a Python exception (a CUDA error, no such kernel): its line, not its frames
            emit(case=args.case, error=_first_line(exc))
            return 4
        return 0

    cases = [c.strip() for c in args.cases.split(",") if c.strip()] if args.cases else [n for n, _, _ in CASES]
    plan = [(c, *parse_case(c)) for c in cases]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"IMGLORA_BISECT_TINY": "1"} if TINY else {})}
    start = time.perf_counter()
    lines: list[dict[str, Any]] = []
    log = open(args.out / "bisect.jsonl", "w") if args.out else None

    def keep(line: dict[str, Any]) -> None:
        lines.append(line)
        if log:
            log.write(json.dumps(line, default=str) + "\n")
            log.flush()

    for case, seconds, extra in plan:
        left = args.budget - (time.perf_counter() - start)
        if left < 15:
            keep({"case": case, "parent": True, "status": "skipped", "why": f"the {args.budget:.0f} s budget is spent"})
            print(f"== {case}: skipped (budget)", flush=True)
            continue
        limit = min(seconds, left)
        print(f"== {case} (up to {limit:.0f} s){' ' + str(extra) if extra else ''}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--case", case], env={**env, **extra},
                                  capture_output=True, text=True, timeout=limit)
            rc, stdout, stderr, timed_out = proc.returncode, proc.stdout, proc.stderr, False
        except subprocess.TimeoutExpired as exc:
            rc, timed_out = None, True
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        rows = [json.loads(x[7:]) for x in stdout.splitlines() if x.startswith("RESULT ")]
        for row in rows:
            keep(row)
            print("  " + json.dumps(row, default=str), flush=True)
        errors = [r["error"] for r in rows if "error" in r and "kernel" not in r]
        line = verdict(case, rows, rc, timed_out, errors[0] if errors else error_tail(stderr))
        line["wall_seconds"] = round(time.perf_counter() - t0, 1)
        keep(line)
        print(f"  -> {line['status']}" + (f": {line['error']}" if line.get("error") else ""), flush=True)
    summary = summarize(lines)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    summary["tiny"] = TINY
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.out:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (args.out / "kernel").write_text((summary["kernel"] or "auto") + "\n")  # (auto: none was measured finite)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
