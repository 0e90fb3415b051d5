"""The GPU check on the offline CUDA box (issue 22, "the check would not start"): the wheels it
lacks come from .whl/ only (benchmarks/gpu_wheels.sh), the project's lower bounds allow the box's
stack, a run without CUDA stops at once, and (slow, where the venv is built) the whole rehearsal:
benchmarks/rehearse_gpu_box.sh, the box's versions, `gpu_check.sh --dry-run` with no network."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
CHECK = BENCH / "gpu_check.sh"


def _requirements() -> dict[str, object]:
    """pyproject's [project] dependencies by normalised name (packaging's Requirement)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return {canonicalize_name(r.name): r for r in reqs if r.marker is None or r.marker.evaluate()}


def _pins(script: str, flag: str) -> dict[str, str]:
    out = subprocess.run(["bash", str(BENCH / script), flag], capture_output=True, text=True, check=True).stdout
    from packaging.utils import canonicalize_name

    return {canonicalize_name(n): v for n, _, v in (line.partition("==") for line in out.split()) if v}


def test_pyproject_allows_the_gpu_box_stack() -> None:
    """torch 2.11 / transformers 5.17 / huggingface_hub 1.33 (the box's) satisfy the lower bounds,
    and so does every other pinned version of the rehearsal venv."""
    reqs = _requirements()
    box = _pins("rehearse_gpu_box.sh", "--pins")
    assert {"torch": "2.11.0", "transformers": "5.17.0", "huggingface-hub": "1.33.0"}.items() <= box.items()
    for name, version in box.items():
        if name in reqs:
            assert reqs[name].specifier.contains(version, prereleases=True), (name, version, str(reqs[name]))


def test_the_wheels_are_the_pinned_versions_the_project_allows() -> None:
    reqs = _requirements()
    wheels = _pins("gpu_wheels.sh", "--list")
    assert wheels == {"diffusers": "0.42.1", "optimum-quanto": "0.2.7"}
    for name, version in wheels.items():
        assert reqs[name].specifier.contains(version), (name, version, str(reqs[name]))


def test_the_check_never_installs_from_an_index() -> None:
    """Every pip install in gpu_check.sh is --no-index (the box has none), and no torch pin with a
    local label (+cu130) that no index serves is built."""
    text = CHECK.read_text()
    commands = re.findall(r"-m pip install(?:[^\n]*\\\n)*[^\n]*", text)
    assert commands, "gpu_check.sh installs the wheels with pip"
    for cmd in commands:
        assert "--no-index" in cmd and "--no-deps" in cmd and "--target" in cmd, cmd
    assert "torch==" not in text and "-e ." not in text


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The check's environment: this python, no PYTHONPATH (the check sets it), and a dependency list
    of one light module beside the test's own (importing diffusers and the rest takes ~15 s here;
    the slow dry-run tests of test_gpu_check.py check the whole list)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["GPU_CHECK_MODULES"] = "yaml"
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TMPDIR=str(tmp_path), **extra)
    return env


def test_a_run_without_cuda_stops_at_once_with_the_reason(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run")
    out = tmp_path / "check"
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(CHECK), "--out", str(out)], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    assert "gpu_check: STOPPED: CUDA is not available: torch sees no CUDA device" in r.stdout
    assert "CUDA available: False" in r.stdout and "rehearse the steps on the CPU with --dry-run" in r.stdout
    assert took < 30, took  # the import of torch, nothing more: no model, no wheel install
    assert (out / "steps.tsv").read_text().split("\t")[:3] == ["env", "stopped", "1"]
    assert not (out / "bench-flux").exists() and not (out / "summary.md").exists()


def _wheel(folder: Path, module: str, version: str = "1.0") -> Path:
    """A real (tiny) pure-Python wheel of ``module`` whose import sets VALUE = 42."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{module}-{version}.dist-info"
    files = {f"{module}/__init__.py": "VALUE = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,", ""])
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


@pytest.mark.slow  # (the default run stays under 6 minutes in a fresh clone; CI runs it)
def test_a_missing_library_is_installed_from_the_wheels_folder_only(tmp_path) -> None:
    module = "imglora_test_wheel_mod"
    wheels = tmp_path / "whl"
    _wheel(wheels, module)
    _wheel(wheels, "imglora_test_unwanted")  # not missing: not installed
    out = tmp_path / "check"
    env = _env(tmp_path, GPU_CHECK_EXTRA_MODULES=module, GPU_CHECK_WHEELS=str(wheels), GPU_CHECK_STEPS="none",
               PIP_CONFIG_FILE=os.devnull)
    r = subprocess.run(["bash", str(CHECK), "--dry-run", "--out", str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert f"missing Python modules: {module}" in r.stdout
    assert f"installing from {wheels} (no index, no dependencies) into {tmp_path}/gpu-check-site." in r.stdout
    assert f"{module}-1.0-py3-none-any.whl" in r.stdout and "imglora_test_unwanted" not in r.stdout
    assert "dependencies: all import" in r.stdout and "MISSING" not in r.stdout
    assert f"imglora: this checkout's, through PYTHONPATH={REPO}/src" in r.stdout
    (site,) = tmp_path.glob("gpu-check-site.*")
    assert (site / module / "__init__.py").read_text() == "VALUE = 42\n"
    assert not (site / "imglora_test_unwanted").exists()
    status = {s.split("\t")[0]: s.split("\t")[1] for s in (out / "steps.tsv").read_text().splitlines()}
    assert status == {"env": "ok", "bench": "skipped", "pytest": "skipped", "probe": "skipped", "diagnose": "skipped",
                      "plan": "skipped"}


def test_without_the_wheels_folder_it_says_to_run_gpu_wheels(tmp_path) -> None:
    out = tmp_path / "check"
    env = _env(tmp_path, GPU_CHECK_EXTRA_MODULES="imglora_test_no_such_module",
               GPU_CHECK_WHEELS=str(tmp_path / "no-whl"), GPU_CHECK_STEPS="none")
    r = subprocess.run(["bash", str(CHECK), "--dry-run", "--out", str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-4000:]
    assert (f"no wheels in {tmp_path}/no-whl: run benchmarks/gpu_wheels.sh on a machine with a package index "
            "first, then bring .whl/ here with the checkout") in r.stdout
    assert "MISSING (could not install): imglora_test_no_such_module" in r.stdout
    assert "gpu-check-site" not in r.stdout


# ------------------------------------------------------------------------------ the rehearsal

VENV = Path(os.environ.get("REHEARSE_VENV", REPO / ".venv-gpubox"))


@pytest.mark.slow
def test_rehearsal_on_the_gpu_box_stack_with_no_network(tmp_path) -> None:
    """benchmarks/rehearse_gpu_box.sh end to end. It needs the venv of the box's versions (about
    3 GB: torch's CUDA build), which a test does not download unless IMGLORA_REHEARSE_BUILD=1, the
    wheels in .whl/, and root for `unshare -n`."""
    if not (VENV / "bin" / "python").exists() and os.environ.get("IMGLORA_REHEARSE_BUILD") != "1":
        pytest.skip(f"the rehearsal venv {VENV} is not built: benchmarks/rehearse_gpu_box.sh --build-only "
                    "(or IMGLORA_REHEARSE_BUILD=1 to let this test build it)")
    if not list((REPO / ".whl").glob("*.whl")):
        pytest.skip("no .whl/: run benchmarks/gpu_wheels.sh first")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a network namespace with no network")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(REHEARSE_VENV=str(VENV), OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", str(BENCH / "rehearse_gpu_box.sh"), "--out", str(tmp_path / "r")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert "rehearse: PASS (every step ran, offline, with the GPU box's versions)" in r.stdout
    assert "torch 2.11.0" in r.stdout and "transformers 5.17.0" in r.stdout
    log = (tmp_path / "r" / "check" / "check.log").read_text()
    assert "missing Python modules: diffusers optimum.quanto" in log
    assert "installing from" in log and "diffusers-0.42.1-py3-none-any.whl" in log
    assert re.search(r"diffusers 0\.42\.1 from \S*/gpu-check-site\.\w+/diffusers/__init__\.py", log), log[-3000:]
    assert "huggingface-hub 1.33.0" in log


@pytest.mark.parametrize("script", ["gpu_wheels.sh", "rehearse_gpu_box.sh"])
def test_the_box_scripts_parse_and_refuse_unknown_arguments(script) -> None:
    assert subprocess.run(["bash", "-n", str(BENCH / script)]).returncode == 0
    r = subprocess.run(["bash", str(BENCH / script), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument: --bogus" in r.stderr
    exe = shutil.which("shellcheck")
    if exe is not None:
        sc = subprocess.run([exe, str(BENCH / script)], capture_output=True, text=True)
        assert sc.returncode == 0, sc.stdout
