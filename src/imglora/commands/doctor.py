"""``imglora doctor [PRESET]``: one screen about this machine before the first update on it.

The GPU(s), driver and CUDA versions, torch's CUDA build, free GPU memory and host RAM against the
plan for the preset's own setting, free disk in the cache and run folders against what the run will
write there, the page-locked memory limit (``ulimit -l``) and a test registration, the PCIe link
and a one-second host-to-device copy probe, whether the model is already on disk; each problem with
what to change. Exit status 1 when the preset cannot run here as it is (the model missing, not
enough GPU memory, host RAM or disk), 0 otherwise. Without a CUDA GPU it says so and checks the rest
(the plan then counts the CPU's memory: everything lives in host RAM).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..config import Config

GIB = 2**30
PROBE_BYTES = 256 * 2**20  # the bandwidth probe's buffer
REGISTER_BYTES = 64 * 2**20  # the test registration (the swap engine registers each swapped block so)


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)  # (topic, what was found)
    problems: list[str] = field(default_factory=list)  # what stops the preset here, each with what to change
    advice: list[str] = field(default_factory=list)  # what would help but does not stop it

    def add(self, topic: str, text: str) -> None:
        self.lines.append((topic, text))

    @property
    def ok(self) -> bool:
        return not self.problems


def run(preset: str | None, overrides: tuple[str, ...], out: Callable[[str], None] = print) -> Report:
    import torch

    r = Report()
    r.add("torch", f"{torch.__version__}" + (f", CUDA build {torch.version.cuda}" if torch.version.cuda
                                              else ", a CPU build (no CUDA)"))
    gpus = _gpus(r)
    _host(r)
    _memlock(r, bool(gpus))
    if gpus:
        _pcie(r)
        _bandwidth(r)
    if preset is not None:
        _preset(r, preset, overrides, gpus)
    width = max(len(t) for t, _ in r.lines)
    for topic, text in r.lines:
        out(f"{topic.ljust(width)}  {text}")
    for p in r.problems:
        out(f"PROBLEM: {p}")
    for a in r.advice:
        out(f"advice: {a}")
    out("ready: the preset can run here as it is" if preset is not None and r.ok else
        "not ready: fix the problems above" if r.problems else "no preset given: the machine's checks only")
    return r


# -- the machine ---------------------------------------------------------------------------------


def _gpus(r: Report) -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        why = "torch has no CUDA build" if not torch.version.cuda else "CUDA is not available (no GPU or no driver)"
        r.add("GPU", f"none: {why}; training here runs on the CPU (the tiny presets do; real models are "
                     "impractically slow)")
        return []
    smi = _nvidia_smi(["name", "driver_version"])
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        out.append({"index": i, "name": p.name, "free": free, "total": total})
        r.add(f"GPU {i}", f"{p.name}, compute capability {p.major}.{p.minor}, {total / GIB:.1f} GiB, "
                         f"{free / GIB:.1f} GiB free" + (", fp8 tensor cores" if (p.major, p.minor) >= (8, 9) else ""))
    driver = smi[0][1] if smi else "unknown (no nvidia-smi)"
    r.add("driver", f"{driver}; CUDA runtime of torch {torch.version.cuda}")
    return out


def _nvidia_smi(fields: list[str]) -> list[list[str]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        res = subprocess.run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [[x.strip() for x in line.split(",")] for line in res.stdout.splitlines() if line.strip()]


def _host(r: Report) -> None:
    import psutil

    vm = psutil.virtual_memory()
    r.add("host RAM", f"{vm.total / GIB:.1f} GiB, {vm.available / GIB:.1f} GiB available; {os.cpu_count()} CPU cores")


def _memlock(r: Report, cuda: bool) -> None:
    """``ulimit -l`` and, on CUDA, one page-locked registration as the swap engine makes them."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"
    if not cuda:
        r.add("page-locked", f"ulimit -l: {limit} (used only with a CUDA GPU)")
        return
    import torch

    buf = torch.empty(REGISTER_BYTES, dtype=torch.uint8)
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), REGISTER_BYTES, 1))
    if rc == 0:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        r.add("page-locked", f"ulimit -l: {limit}; registering 64 MiB works")
    else:
        r.add("page-locked", f"ulimit -l: {limit}; registering 64 MiB FAILED (CUDA error {rc})")
        r.advice.append("page-locked registration fails, so block swap and checkpoint offload fall back to "
                        "PyTorch's pinned allocator (each buffer rounded up to a power of two) or pageable copies: "
                        "raise the limit (`ulimit -l unlimited`, or the container's --ulimit memlock=-1)")


def _pcie(r: Report) -> None:
    rows = _nvidia_smi(["pcie.link.gen.current", "pcie.link.width.current", "pcie.link.gen.max",
                        "pcie.link.width.max"])
    for i, row in enumerate(rows):
        if len(row) == 4:
            r.add(f"PCIe {i}", f"gen {row[0]} x{row[1]} now (the card can do gen {row[2]} x{row[3]}; an idle card "
                               "runs slower links)")


def _bandwidth(r: Report, seconds: float = 1.0) -> None:
    """Host-to-device copies of a pinned 256 MiB buffer for about ``seconds``: GB/s."""
    import torch

    src = torch.empty(PROBE_BYTES, dtype=torch.uint8).pin_memory()
    dst = torch.empty(PROBE_BYTES, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        n += 1
    rate = n * PROBE_BYTES / (time.perf_counter() - t0) / 1e9
    r.add("host->GPU", f"{rate:.1f} GB/s (pinned, {n} copies of 256 MiB); block swap moves each swapped block "
                       "twice per update at this rate")
    if rate < 8:
        r.advice.append(f"host-to-GPU copies run at {rate:.1f} GB/s (PCIe 4.0 x16 gives about 25): block swap will "
                        "cost more than `imglora plan` predicts; swap fewer blocks, or measure with `imglora bench-swap`")


# -- the preset ----------------------------------------------------------------------------------


def _preset(r: Report, preset: str, overrides: tuple[str, ...], gpus: list[dict[str, Any]]) -> None:
    import psutil

    from ..memory.wrap import preset_swap
    from ..plan import predict as plan
    from ..errors import ImgloraError
    from ..models.resolve import resolve_model
    from .common import family_of, load_config

    cfg = load_config(preset, overrides)
    family = family_of(cfg)
    try:
        src = resolve_model(cfg.model, family)
        r.add("model", f"{cfg.model.path}: on disk ({src})")
    except ImgloraError as exc:
        src = None
        r.add("model", f"{cfg.model.path}: NOT on this machine")
        r.problems.append(f"the model is not on disk: {exc}")
    cuda = bool(gpus)
    setting = plan.own_setting(cfg, family, preset_swap(family, cfg, src))
    p = plan.predict(cfg, family, [setting], device_kind="cuda" if cuda else "cpu", src=src,
                     process_rss=psutil.Process().memory_info().rss).settings[0]
    available = psutil.virtual_memory().available
    if cuda:
        need = plan.needed_vram(p.device_peak)
        free = min(g["free"] for g in gpus)
        r.add("plan", f"{setting.name}: {need / GIB:.1f} GiB of GPU memory needed (peak {p.device_peak / GIB:.1f} GiB "
                      f"allocated), {free / GIB:.1f} GiB free; {p.host_peak / GIB:.1f} GiB of host RAM")
        if need > free:
            r.problems.append(f"{setting.name} needs {need / GIB:.1f} GiB of GPU memory and {free / GIB:.1f} GiB are "
                              "free: swap more blocks (memory.blocks_to_swap) or keep the base in fp8 "
                              f"(`imglora plan {preset} --vram {free / GIB:.0f}GiB` names the fastest setting that fits)")
    else:  # on the CPU the device peak is host memory too (the plan counts it there)
        r.add("plan", f"{setting.name} on the CPU: {p.host_peak / GIB:.1f} GiB of host RAM at the peak")
    host = p.host_peak
    if host > available:
        r.problems.append(f"the run needs about {host / GIB:.1f} GiB of host RAM and {available / GIB:.1f} GiB are "
                          "available: swap fewer blocks, close other processes, or rent a machine with more RAM")
    _disk(r, cfg, p)


def _disk(r: Report, cfg: "Config", p: Any) -> None:
    """Free space where the run writes: its folder (checkpoints, adapter, export) and the cache."""
    lora_bytes = p.term("lora")
    keep = cfg.train.keep_checkpoints
    run_need = lora_bytes * (3 * keep + 2) + 64 * 2**20  # each checkpoint: adapter + 2 optimizer states; logs
    images = _images(cfg)
    side = cfg.data.max_resolution // 8
    per_image = 16 * side * side * 4 * (2 if cfg.cache.latents == "sample" else 1) + 4 * 2**20  # latents + text
    cache_need = images * per_image * (2 if any(s.flip for s in cfg.data.all_sets) else 1)
    if cfg.memory.fp8 and cfg.cache.quantized_base:
        # the quantized base, kept for the next run (what the plan places on the device and the host)
        cache_need += p.term("weights_resident_blocks") + p.term("host_swapped") + p.term("weights_non_block")
    for label, folder, need in (("run folder", Path(cfg.run.output_dir), run_need),
                                ("cache", Path(cfg.cache.dir), cache_need)):
        free = shutil.disk_usage(_existing(folder)).free
        r.add(f"disk ({label})", f"{folder}: {free / GIB:.1f} GiB free, about {need / GIB:.2f} GiB to be written")
        if need > free:
            r.problems.append(f"{folder} has {free / GIB:.1f} GiB free and the run writes about {need / GIB:.1f} GiB "
                              f"there: free space, or point {'run.output_dir' if label == 'run folder' else 'cache.dir'}"
                              " at a larger disk")


def _images(cfg: "Config") -> int:
    from ..data.dataset import IMAGE_EXTENSIONS

    n = 0
    for s in cfg.data.all_sets:
        folder = Path(s.dir)
        if folder.is_dir():
            n += sum(1 for f in folder.rglob("*") if f.suffix.lower() in IMAGE_EXTENSIONS)
    return n


def _existing(folder: Path) -> Path:
    folder = folder.resolve()
    while not folder.exists():
        folder = folder.parent
    return folder
