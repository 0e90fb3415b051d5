"""What the web UI shows of a run folder: read from the files ``imglora train`` writes, never kept elsewhere.

A run's state: ``running`` while a live process holds its lock (``.imglora.lock``), else from its
newest train record: ``finished`` (status ok), ``interrupted`` (resumable: a checkpoint is there),
``failed`` (with the stage the record names); a folder with neither is ``unknown``.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from ..training import runlock
from ..training.checkpoint import list_checkpoints

UI_LOG = "ui-train.log"  # the stdout and stderr of a run the UI started


def is_run_dir(folder: Path) -> bool:
    return folder.is_dir() and ((folder / "log.jsonl").is_file() or (folder / "records").is_dir()
                                or (folder / runlock.LOCK_NAME).is_file() or (folder / UI_LOG).is_file())


def find_runs(root: Path) -> list[Path]:
    """Run folders under ``root`` (two levels: ``root/<name>`` and ``root/runs/<name>``)."""
    out = []
    for base in (root, root / "runs"):
        if base.is_dir():
            out += [p for p in sorted(base.iterdir()) if is_run_dir(p) and not p.is_symlink()]
    return out


def lock_record(run: Path) -> dict[str, Any] | None:
    """What the run's lock file says (pid, host, command, create_time), live or not; None when it names
    no owner (empty: released) or does not read."""
    try:
        info = json.loads((run / runlock.LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info else None


def lock_info(run: Path) -> dict[str, Any] | None:
    """The lock's owner while it lives, else None: on this host, while ``runlock.process_matches`` finds
    its process to be the run (a stale lock, or a pid reused by another process, is no owner); a lock
    of another host (a synced folder) is taken as live there."""
    info = lock_record(run)
    if info is None or not isinstance(info.get("pid"), int):
        return None
    if info.get("host") and info.get("host") != socket.gethostname():
        return info
    return info if runlock.process_matches(info) is None else None


class UnreadableRecord(ValueError):
    pass


def read_records(run: Path, command: str | None = None) -> list[dict[str, Any]]:
    """The run's records (``records/*.json``), oldest first, as ``record.read_records``; one that does not
    read as a JSON object raises ``UnreadableRecord`` naming the file."""
    out = []
    for p in sorted((run / "records").glob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise UnreadableRecord(f"{p.relative_to(run)}: {exc}") from None
        if not isinstance(rec, dict):
            raise UnreadableRecord(f"{p.relative_to(run)}: JSON {type(rec).__name__}, not an object")
        if command is None or rec.get("command") == command:
            out.append(rec)
    return out


def unreadable(exc: BaseException) -> str:
    return f"unreadable record: {exc}" if isinstance(exc, UnreadableRecord) else \
        f"unreadable: {type(exc).__name__}: {exc}"


def safe_summary(run: Path, root: Path, rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``summary``, or for a run whose files do not read, the run as ``unreadable`` with the reason (one
    malformed file never hides the other runs)."""
    try:
        return summary(run, root, rows)
    except Exception as exc:  # noqa: BLE001 - whatever a hand-edited or truncated file raises
        keys = ("step", "total", "loss", "sec_per_update", "eta_seconds", "cost", "projected_cost", "peak_allocated",
                "family")
        return {"name": run.name, "path": str(run.relative_to(root)), "state": "unreadable",
                "detail": unreadable(exc), "checkpoints": [], "resumable": False, **dict.fromkeys(keys),
                "updated": _mtime(run)}


def log_rows(run: Path, after: int = -1) -> list[dict[str, Any]]:
    """The rows of ``log.jsonl`` with a step above ``after`` (a row being written is skipped)."""
    path = run / "log.jsonl"
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step > after:
            rows.append(row)
    return rows


def state(run: Path) -> dict[str, Any]:
    owner = lock_info(run)
    records = read_records(run, "train")
    rec = records[-1] if records else None
    ckpts = [step for step, _ in list_checkpoints(run)]
    if owner is not None:
        elsewhere = owner.get("host") != socket.gethostname()
        name, detail = "running", f"pid {owner.get('pid')}" + (f" on {owner.get('host')}" if elsewhere else "")
    elif rec is None:
        name, detail = "unknown", "no train record yet"
    elif rec.get("status") == "ok":
        name, detail = "finished", ""
    elif rec.get("status") == "interrupted":
        name, detail = "interrupted", "resumable" if ckpts else "no checkpoint: start again"
    else:
        name, detail = "failed", str(rec.get("stage") or rec.get("error") or rec.get("status"))
    return {"state": name, "detail": detail, "checkpoints": ckpts, "resumable": name == "interrupted" and bool(ckpts),
            "record": rec}


UI_RUN = "ui-run.json"  # how the UI started a run: preset, overrides, command


def run_config(run: Path) -> Any:
    """The run's configuration: as the UI started it, else its record's or newest checkpoint's; None
    before either exists (a run started elsewhere, before its first checkpoint)."""
    from ..commands.common import load_config, saved_config
    from ..errors import ImgloraError

    try:
        if (run / UI_RUN).is_file():
            started = json.loads((run / UI_RUN).read_text())
            return load_config(started["preset"], started.get("overrides", []))
        return saved_config(run)
    except (ImgloraError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def summary(run: Path, root: Path, rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``rows``: the log's rows when the caller has read them already (read once, not twice)."""
    from ..runs.cost import run_rate

    st = state(run)
    rows = log_rows(run) if rows is None else rows
    last = rows[-1] if rows else {}
    rec = st.pop("record") or {}
    cfg = run_config(run)
    total = cfg.train.max_steps if cfg is not None else None
    rate = run_rate(cfg)[1] if cfg is not None else None
    spu, step, cost = (_number(last.get(k)) for k in ("sec_per_update", "step", "cost"))
    eta = (total - step) * spu if spu is not None and isinstance(step, int) and total else None
    peak = rec.get("peak_memory")
    return {"name": run.name, "path": str(run.relative_to(root)), **st, "step": step,
            "total": total, "loss": _number(last.get("loss")), "sec_per_update": spu,
            "eta_seconds": eta if st["state"] == "running" else None, "cost": cost,
            "projected_cost": (cost + eta / 3600 * rate) if eta and rate and cost is not None else None,
            "peak_allocated": _number(peak.get("peak_allocated")) if isinstance(peak, dict) else None,
            "family": cfg.model.family if cfg is not None else None, "updated": _mtime(run)}


def detail(run: Path, root: Path) -> dict[str, Any]:
    rows = log_rows(run)
    out = summary(run, root, rows)
    out["rows"] = rows
    out["smoothed"] = smooth([r.get("loss") for r in rows])
    out["tail"] = tail(run / UI_LOG, 40)
    out["sheets"] = [str(p.relative_to(root)) for p in sorted(run.rglob("*.png")) if "sheet" in p.name
                     or p.parent.name in ("eval", "samples")]
    evals = read_records(run, "eval")
    out["evals"] = [{k: r.get(k) for k in ("started", "status", "best_step", "best_checkpoint")}
                    | {"steps": [x.get("step") for x in _list(r.get("losses")) if isinstance(x, dict)]} for r in evals]
    out["eval_losses"] = eval_losses(run, root, evals)
    files = sorted((run / "adapter").glob("*.safetensors")) if (run / "adapter").is_dir() else []
    out["adapter"] = str(files[0].relative_to(root)) if files else None  # the download
    exported = run / "export"  # `imglora export RUN`: the ComfyUI-form file and its workflows
    out["exports"] = sorted(str(p.relative_to(root)) for p in exported.iterdir()
                            if p.suffix in (".safetensors", ".json") and p.is_file()) if exported.is_dir() else []
    return out


def eval_losses(run: Path, root: Path, evals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluation pass's table (``eval/losses.json``): per checkpoint its held-out and
    training-image loss, its adapter and contact sheet (paths inside the root), the best one marked
    (lowest held-out loss), and the base model's losses; None before any evaluation."""
    try:
        table = json.loads((run / "eval" / "losses.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(table, dict):
        return None
    sheets: dict[str, Any] = {}
    for r in evals:  # later evaluations' sheets replace earlier ones
        outputs = r.get("outputs")
        found = outputs.get("sheets") if isinstance(outputs, dict) else None
        sheets.update(found if isinstance(found, dict) else {})

    best = table.get("best_step")
    rows = [{"step": r.get("step"), "heldout": _number(r.get("heldout")), "train": _number(r.get("train")),
             "adapter": inside_root(r.get("adapter"), root), "sheet": inside_root(sheets.get(str(r.get("step"))), root),
             "best": r.get("step") == best} for r in _list(table.get("checkpoints")) if isinstance(r, dict)]
    plot = run / "eval" / "loss_vs_step.png"
    return {"checkpoints": rows, "best_step": best, "base": table.get("base"),
            "plot": inside_root(plot, root) if plot.is_file() else None}


def inside_root(path: Any, root: Path) -> str | None:
    """``path`` (symlinks resolved) relative to ``root``, or None when there is none or it leads out of
    the root (a page shows only what /files would serve)."""
    try:
        return str(Path(path).resolve().relative_to(root)) if path else None
    except (ValueError, TypeError, OSError, RuntimeError):  # not a path, a NUL byte, a symlink loop ...
        return None


def _number(x: Any) -> Any:
    """``x`` when it is a number (a log or record edited by hand may hold anything), else None."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def smooth(values: list[Any], alpha: float = 0.9) -> list[float | None]:
    """An exponential moving average of the losses, as the training log's smoothed curve."""
    out: list[float | None] = []
    m = None
    for v in values:
        if not isinstance(v, (int, float)):
            out.append(m)
            continue
        m = v if m is None else alpha * m + (1 - alpha) * v
        out.append(m)
    return out


def tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _mtime(run: Path) -> float:
    try:
        return max((p.stat().st_mtime for p in (run / "log.jsonl", run / "records") if p.exists()),
                   default=run.stat().st_mtime)
    except OSError:
        return time.time()
