"""Every Python process started with this folder on PYTHONPATH and ``IMGLORA_CUDA_STANDIN`` set runs
on the CUDA stand-in (tests/cuda_standin.py: AsyncCuda), so a script that starts processes
(benchmarks/gpu_check.sh, ``imglora bench-swap`` and its workers) takes its CUDA code paths on this
CPU-only build.

``IMGLORA_CUDA_STANDIN``: ``late`` (each copy lands as late as allowed) or a fuzz seed (random copy
latencies). Each process writes ``<pid>.json`` (its command line, violations, copies landed early)
into ``IMGLORA_CUDA_STANDIN_REPORT`` (a folder) at exit, and exits with status 70 if the stand-in
saw an ordering violation.
"""

from __future__ import annotations

import os

_MODE = os.environ.get("IMGLORA_CUDA_STANDIN")
_ACTIVE = None


def _boot(mode: str) -> None:
    import atexit
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for cuda_standin
    from _pytest.monkeypatch import MonkeyPatch
    from cuda_standin import AsyncCuda

    fake = AsyncCuda(fuzz=None if mode == "late" else int(mode))
    fake.install(MonkeyPatch())
    global _ACTIVE
    _ACTIVE = fake.active()  # kept: a context manager collected would leave the mode
    _ACTIVE.__enter__()  # for the whole process
    try:  # the tiny models' checkpoint boundaries are a few KiB: move them all (as the tests do)
        from imglora.memory import offload

        offload.MIN_BYTES = 1024
    except ImportError:  # a process without imglora (pip, a module check)
        pass

    def report() -> None:
        folder = os.environ.get("IMGLORA_CUDA_STANDIN_REPORT")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            facts = {"argv": sys.argv, "violations": fake.violations, "landed_early": fake.landed_early,
                     "copies_in_flight_at_exit": len(fake.in_flight),
                     "streams": [s.name for s in fake.streams], "host": sorted(set(fake.host.values()))}
            (Path(folder) / f"{os.getpid()}.json").write_text(json.dumps(facts, indent=1))
        if fake.violations:
            sys.stderr.write(f"CUDA stand-in: {len(fake.violations)} ordering violation(s), first: "
                             f"{fake.violations[0]}\n")
            sys.stderr.flush()
            os._exit(70)

    atexit.register(report)


if _MODE:
    _boot(_MODE)
