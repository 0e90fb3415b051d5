"""Test setup: offline, tiny models in a per-session folder, GPU tests skipped without CUDA."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# Set before anything imports huggingface_hub: tests never touch the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Tiny models are generated once per test session into this folder (IMGLORA_HOME may be set by CI
# to share them between runs; they are rebuilt whenever their generator version changes).
os.environ.setdefault("IMGLORA_HOME", str(Path(tempfile.gettempdir()) / "imglora-test-home"))

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # A shell that starts a command in the background without job control (`cmd &` in a script, some CI
    # runners) starts it with SIGINT ignored, and an ignored signal stays ignored in every process it
    # starts: the Ctrl-C tests would then test nothing. Give the test process Python's own handler, so the
    # processes the tests start get the default disposition, as under a terminal.
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_frozen_for: list[object] = [None]


def pytest_runtest_setup(item):
    """At each test module's first test: collect the garbage so far, then freeze what is left (gc.freeze),
    so the cyclic collector never walks it again. What lives that long (torch, diffusers, transformers,
    the test modules, the session's fixtures) is most of the heap; without this every full collection
    walks all of it: about 0.25 s each, and imglora runs one each time it drops a model
    (util.devices.free), several per tiny run. A cycle made later is still collected as before; one
    alive at a freeze and dropped later is not (refcounted objects are freed as ever): the collection
    before each freeze keeps that to what a module leaves alive past its end."""
    import gc

    if item.module is not _frozen_for[0]:
        _frozen_for[0] = item.module
        gc.collect()
        gc.freeze()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (CI does; the default run skips them)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--slow"):
        skip_slow = pytest.mark.skip(reason="slow: run with --slow (CI does)")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing entirely: every gpu test is skipped below
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: on a shared 2-core runner a second
    thread only adds contention (steps measured ~10x slower with 2 threads while other tests run).
    A module or folder asks for it with ``usefixtures("one_thread")`` or an autouse fixture."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def sample_dataset() -> Path:
    return REPO / "sample_datasets" / "sks_toy"


@pytest.fixture()
def small_run(tmp_path: Path, sample_dataset: Path):
    """``small_run(names)``: copy some sample images into tmp_path and return --set overrides that
    point data, cache and runs there, so a test trains or caches in a few seconds."""

    def make(names: tuple[str, ...] = ("01_sky", "02_grass", "04_wall")) -> list[str]:
        data = tmp_path / "data"
        data.mkdir(exist_ok=True)
        for name in names:
            for f in sample_dataset.glob(f"{name}.*"):
                shutil.copy(f, data / f.name)
        return [f"data.dir={json.dumps(str(data))}", f"cache.dir={json.dumps(str(tmp_path / 'cache'))}",
                f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}"]

    return make


@pytest.fixture(autouse=True)
def _work_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in a folder of its own (not its tmp_path, which tests list): preset defaults
    such as cache.dir = ".imglora/cache" (where a quantized base is kept) land there, never in the
    repository. The tiny presets' relative data.dir (sample_datasets/...) resolves through a link."""
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "sample_datasets").symlink_to(REPO / "sample_datasets", target_is_directory=True)
    monkeypatch.chdir(cwd)
