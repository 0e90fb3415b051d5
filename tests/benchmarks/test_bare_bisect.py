"""benchmarks/bare_bisect.py: the GPU's bare control (no imglora), dry-run on the CPU with tiny models.

The default run checks the parent's bookkeeping on three cases (one that trains, one that dies, one
that reports its environment); the slow run goes through every case of the GPU command."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bare_bisect.py"


def _module():
    spec = importlib.util.spec_from_file_location("bare_bisect", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(out: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "bisect.jsonl").read_text().splitlines()]


def test_it_imports_nothing_of_imglora() -> None:
    """A control must not share the code it controls for."""
    tree = ast.parse(SCRIPT.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [n for n in names if n.split(".")[0] == "imglora"]


def test_each_case_in_its_own_process_a_death_ends_only_that_case(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--cases", "env,die,flux:flash:1024")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = _lines(tmp_path)
    parent = {x["case"]: x for x in lines if x.get("parent")}
    assert parent["env"]["status"] == "ok" and parent["flux:flash:1024"]["status"] == "ok"
    assert parent["die"]["status"] == "died" and parent["die"]["exit_code"] != 0  # SIGABRT: -6
    env = next(x for x in lines if x["case"] == "env" and not x.get("parent"))
    assert env["gpu"] == "cpu" and env["order_before_first_call"][:3] == ["flash", "efficient", "math"]
    updates = [x for x in lines if x["case"] == "flux:flash:1024" and "update" in x]
    assert [u["update"] for u in updates] == [1, 2, 3]
    assert all(math.isfinite(u["loss"]) and u["loss"] > 0 and u["nonfinite_grads"] == 0 for u in updates)
    assert parent["flux:flash:1024"]["losses"] == [u["loss"] for u in updates]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["flux_1024"] == {"flash": "ok"} and summary["kernel"] == "flash"
    assert (tmp_path / "kernel").read_text() == "flash\n"
    assert "SUMMARY " in proc.stdout and "-> died" in proc.stdout


def test_a_spent_budget_skips_the_rest_and_says_so(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--cases", "env,flux:default:1024", "--budget", "10")
    assert proc.returncode == 0
    parent = {x["case"]: x for x in _lines(tmp_path) if x.get("parent")}
    assert parent == {c: {"case": c, "parent": True, "status": "skipped", "why": "the 10 s budget is spent"}
                      for c in ("env", "flux:default:1024")}
    assert (tmp_path / "kernel").read_text() == "auto\n"  # nothing measured: imglora's own default


def test_verdicts_and_the_cause_they_point_to() -> None:
    m = _module()
    good = [{"case": "c", "update": i, "loss": 1.0, "grad_norm": 0.5, "nonfinite_grad_origin": None, "seconds": 1.0,
             "peak_allocated": 7, "peak_reserved": 9} for i in (1, 2, 3)]
    bad = [dict(good[0]), {**good[1], "grad_norm": float("nan"), "nonfinite_grad_origin": "single_transformer_blocks.37.attn.to_q"},
           {**good[2], "loss": float("nan")}]
    assert m.verdict("c", good, 0, False, "")["status"] == "ok"
    v = m.verdict("c", bad, 0, False, "")
    assert v["status"] == "nonfinite" and v["first_nonfinite_update"] == 2
    assert v["origin"] == "single_transformer_blocks.37.attn.to_q" and v["peak_reserved"] == 9
    assert m.verdict("c", [], -6, False, "illegal memory access")["status"] == "died"
    assert m.verdict("c", [], 3, False, "ImportError")["status"] == "error"
    assert m.verdict("c", [], 4, False, "RuntimeError: CUDA error")["status"] == "failed"
    assert m.verdict("c", good[:1], None, True, "")["status"] == "timeout"

    def summary(**status: str) -> dict:
        env = {"case": "env", "default_choice_flux_layout": "cudnn"}
        return m.summarize([env, *({"case": f"flux:{k}:1024", "parent": True, "status": s} for k, s in status.items())])

    s = summary(default="nonfinite", flash="ok", efficient="ok")
    assert s["kernel"] == "flash" and s["finite_kernels"] == ["flash", "efficient"]
    assert s["cause"].startswith("PyTorch's default kernel (cudnn) fails bare (nonfinite) and flash trains finite")
    assert summary(default="died", flash="nonfinite", efficient="ok")["kernel"] == "efficient"
    assert summary(default="failed", flash="ok")["cause"].startswith("PyTorch's default kernel (cudnn) fails bare (failed)")
    assert summary(default="ok", flash="ok")["cause"].startswith("a bare loop with PyTorch's default kernel trains finite")
    assert summary(default="nonfinite", flash="nonfinite", efficient="died")["cause"].startswith("no kernel trains finite")
    assert summary(default="timeout", flash="skipped")["cause"].startswith("not measured")


@pytest.mark.slow
def test_every_case_of_the_gpu_command_runs_on_tiny_models(tmp_path: Path) -> None:
    m = _module()
    proc = _run(tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    parent = {x["case"]: x for x in _lines(tmp_path) if x.get("parent")}
    assert list(parent) == [name for name, _, _ in m.CASES]
    # no memory-efficient kernel on a CPU: that case fails with PyTorch's reason, the others train
    assert {c: x["status"] for c, x in parent.items()} == {c: "failed" if "efficient" in c else "ok" for c in parent}
    assert parent["flux:efficient:1024"]["error"].startswith("RuntimeError: No viable backend for scaled_dot_product_attention")
    assert len(parent["flux:default:1024:anomaly"]["losses"]) == 1 and len(parent["sdxl:auto:1024"]["losses"]) == 5
    assert len(parent["llm:auto:2048"]["losses"]) == 5 and parent["llm:auto:2048"]["losses"][0] == pytest.approx(
        math.log(512), rel=0.05)  # random weights: about uniform over the tiny vocabulary
    kernels = [x for x in _lines(tmp_path) if x["case"] == "kernels" and not x.get("parent")]
    assert {k["kernel"] for k in kernels} == {"default", "math"}
    assert all(k["finite"] and max(k["max_rel_error"].values()) < 0.05 for k in kernels)  # bf16 vs fp32 math
