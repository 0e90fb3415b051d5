"""Merge a chat run's LoRA adapter into its full-precision base: a normal transformers model folder.

The base named by the run's train record (``model.path``) is loaded unquantized in the chosen
dtype (``auto``: the dtype its config.json gives), the PEFT adapter is applied with
``PeftModel.from_pretrained`` and folded in with ``merge_and_unload``; the result and the base's
tokenizer (chat template included) are written to a temporary folder that is renamed onto
``--out`` only when complete.

QLoRA trains against a 4-bit base but the merge goes into the full-precision one, as in the QLoRA
paper: merging into the quantized weights would add the quantization error to every weight.
"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any, Callable

from ...util import atomic
from ...training import checkpoint
from ...runs import record
from ...errors import ImgloraError

DTYPES = ("auto", "bf16", "fp16", "fp32")


def adapter_dir(run_dir: Path, which: str | None) -> Path:
    """The run's final adapter (``which`` None), or a checkpoint's (``"latest"`` or a step number)."""
    run_dir = Path(run_dir)
    if which is None:
        folder = run_dir / "adapter"
        if not (folder / "adapter_config.json").is_file():
            ckpts = checkpoint.list_checkpoints(run_dir)
            hint = (f"; the run has checkpoints ({', '.join(str(s) for s, _ in ckpts)}): pick one with "
                    "--checkpoint STEP or --checkpoint latest" if ckpts else "")
            raise ImgloraError(f"{folder} holds no PEFT adapter (adapter_config.json){hint}")
        return folder
    ckpts = dict(checkpoint.list_checkpoints(run_dir))
    if not ckpts:
        raise ImgloraError(f"{run_dir}/checkpoints holds no checkpoint")
    if which == "latest":
        step = max(ckpts)
    elif which.isdigit() and int(which) in ckpts:
        step = int(which)
    else:
        raise ImgloraError(f"--checkpoint {which}: no such checkpoint in {run_dir}/checkpoints; "
                           f"available: {', '.join(str(s) for s in sorted(ckpts))} or latest")
    return ckpts[step] / "adapter"


MARKER = "imglora-merge.json"  # written into every merged folder; --force replaces only such folders


def merge(family: Any, run_dir: str | Path, cfg: Any, out: str | Path, *, which: str | None = None,
          dtype: str = "auto", force: bool = False, log: Callable[[str], None] = print) -> Path:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...models.resolve import resolve_model

    run_dir, out = Path(run_dir), Path(out)
    if dtype not in DTYPES:
        raise ImgloraError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    adapter = adapter_dir(run_dir, which)
    _check_out(out, run_dir, force)
    rec = record.RunRecord("merge", run_dir, cfg.to_dict())
    with rec.phase("resolve_model"):
        src = resolve_model(cfg.model, family)
    torch_dtype = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    with rec.phase("load"):
        base = AutoModelForCausalLM.from_pretrained(src.root, dtype=torch_dtype)
        model = PeftModel.from_pretrained(base, str(adapter))
    with rec.phase("merge"):
        merged = model.merge_and_unload()
    with rec.phase("save"), atomic.atomic_dir(out) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(src.root).save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"run": str(run_dir), "adapter": str(adapter)}) + "\n")
    rec.set(model_dir=str(src.root), adapter=str(adapter), out=str(out), dtype=str(merged.dtype).removeprefix("torch."),
            merged_checksums=record.folder_checksums(out))
    rec.write()
    log(f"merged {adapter} into {cfg.model.path} ({str(merged.dtype).removeprefix('torch.')}): {out}")
    return out


def _check_out(out: Path, run_dir: Path, force: bool) -> None:
    resolved = out.resolve()
    if resolved == run_dir.resolve() or resolved in run_dir.resolve().parents:
        raise ImgloraError(f"--out {out} would replace the run folder {run_dir}; choose another folder")
    if out.exists() and not out.is_dir():
        raise ImgloraError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ImgloraError(f"--out {out} exists and is not empty; choose another folder or add --force to "
                               "replace an earlier merge")
        if not (out / MARKER).is_file():
            # --force replaces only what imglora merge wrote: never a base model or another folder.
            raise ImgloraError(f"--out {out} holds files imglora merge did not write (no {MARKER}); --force only "
                               "replaces an earlier merge. Choose another folder, or remove it yourself")
