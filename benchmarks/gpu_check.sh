#!/usr/bin/env bash
# The one-shot GPU check: every figure the FLUX memory path needs from a CUDA machine, in one run of
# at most 8 minutes, with no download.
#
#   benchmarks/gpu_check.sh [--out DIR]      # on the GPU machine, from the repository root
#   benchmarks/gpu_check.sh --dry-run        # the same steps on the CPU with the tiny FLUX model
#
# Steps (each under `timeout`, its elapsed time printed; the whole run is held to 480 s):
#   0 environment: nvidia-smi, python, torch and CUDA; how imglora is imported (installed, else
#     `pip install --no-deps -e .`, else PYTHONPATH=src); the libraries it needs (a missing one is
#     pip-installed if the network allows it, else named, and the steps that need it are skipped)
#   1 benchmarks/gpu_probe.py: copy bandwidth, copy/compute overlap, fp8 matmuls, the GPU
#   2 python -m pytest -m gpu (HF_HUB_OFFLINE=1)
#   3 imglora bench-swap presets/flux.toml --arch full --resolution 1024 --blocks fp8:0,fp8:18
#       --steps 8 --warmup 3 --set memory.swap_prefetch=1 (random FLUX.1-dev weights made on the
#       GPU: no model download; prefetch held at 1 block, the least memory, which the peak target
#       is about; the result still records each block's measured copy and compute time and the
#       depth auto would choose, memory.swap_prefetch = 0, the default)
#   4 imglora plan (the prediction for the same settings), if this imglora has the command
#   5 benchmarks/gpu_summary.py: each target with PASS/FAIL, the plan's prediction next to each
#     measured peak; DIR/summary.md is the same in Markdown for docs/benchmarks.md
#
# Everything lands in DIR (default gpu-check-<timestamp>): check.log (all output), steps.tsv,
# probe.json, pytest-gpu.xml, bench-flux/ (bench.json, .csv, .png, one folder per setting),
# plan.json, summary.md. Exit status: 0 when every target passes (dry run: when every step ran),
# 1 otherwise, 2 on a usage error.
#
# Environment: PYTHON (default python, else python3); GPU_CHECK_PIP=0 never runs pip;
# GPU_CHECK_EXTRA_MODULES="a b" adds modules to the dependency check (tests use it).

set -u

TOTAL=480          # seconds for the whole check
RESERVE=30         # of which kept for the summary
DRY=0
OUT=""
usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) [ $# -ge 2 ] || { echo "--out needs a folder" >&2; exit 2; }; OUT=$2; shift ;;
        --out=*) OUT=${1#--out=} ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
[ -f pyproject.toml ] && [ -d src/imglora ] || { echo "not an imglora checkout: $REPO" >&2; exit 2; }
OUT=${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
STEPS=$OUT/steps.tsv
: > "$STEPS"
exec > >(tee -a "$OUT/check.log") 2>&1

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONUNBUFFERED=1
START=$SECONDS
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3

elapsed() { echo $((SECONDS - START)); }
record() {  # step status rc seconds note
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$STEPS"
}
skip() {  # step why
    echo "== [$1] skipped: $2"
    record "$1" skipped "" 0 "$2"
}
budget() {  # wanted seconds -> what is left of TOTAL (less the summary's reserve) for it (0: none)
    local left=$((TOTAL - RESERVE - $(elapsed)))
    if [ "$left" -lt 10 ]; then echo 0; elif [ "$1" -gt "$left" ]; then echo "$left"; else echo "$1"; fi
}
run_step() {  # step seconds command... : runs it under timeout, prints and records its time
    local name=$1 t=$2
    shift 2
    if [ "$t" -le 0 ]; then
        skip "$name" "no time left of the ${TOTAL} s budget"
        return 1
    fi
    echo
    echo "== [$name] up to ${t} s: $*"
    local t0=$SECONDS rc status
    timeout --kill-after=10 "$t" "$@"
    rc=$?
    status=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status=failed; fi
    echo "== [$name] $status (exit $rc) in $((SECONDS - t0)) s; $(elapsed) s of ${TOTAL} s used"
    record "$name" "$status" "$rc" "$((SECONDS - t0))" "${NOTE:-}"
    NOTE=""
    return "$rc"
}
NOTE=""

if [ "$DRY" -eq 1 ]; then
    echo "gpu_check: DRY RUN on the CPU (tiny FLUX model): every step runs, no GPU figure is measured"
else
    echo "gpu_check: FLUX.1-dev memory path on this GPU (at most ${TOTAL} s)"
fi
echo "output: $OUT"

# ------------------------------------------------------------------------------ 0: environment
echo
echo "== [env]"
t0=$SECONDS
date -u +"date: %Y-%m-%d %H:%M:%S UTC"
echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 30 nvidia-smi -L || echo "nvidia-smi -L failed"
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
    echo "nvidia-smi: not found"
fi
echo "python: $(command -v "$PY") ($("$PY" --version 2>&1))"
TORCH_OK=0
if timeout 60 "$PY" -c "import torch; print('torch', torch.__version__, '| built for CUDA', torch.version.cuda, '| CUDA available:', torch.cuda.is_available())"; then
    TORCH_OK=1
else
    echo "MISSING: torch is not importable with $PY; only the summary can run"
fi

# Which imglora: this checkout's. An imglora installed from elsewhere is shadowed with PYTHONPATH
# (never reinstalled over); none at all is installed from here without dependencies if pip can.
here="$REPO/src/imglora"
where_imglora() { "$PY" -c "import imglora, os; print(os.path.realpath(os.path.dirname(imglora.__file__)))" 2>/dev/null; }
found=$(where_imglora)
if [ "$found" = "$(realpath "$here")" ]; then
    echo "imglora: imported from this checkout ($found)"
elif [ -n "$found" ]; then
    export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
    echo "imglora: the installed one is $found; using this checkout's through PYTHONPATH=$REPO/src"
else
    if [ "$DRY" -eq 0 ] && [ "${GPU_CHECK_PIP:-1}" != 0 ]; then
        echo "imglora: not importable; pip install --no-deps --no-build-isolation -e ."
        timeout 60 "$PY" -m pip install --disable-pip-version-check --no-deps --no-build-isolation -e . \
            || echo "pip install -e . failed"
    fi
    if [ "$(where_imglora)" != "$(realpath "$here")" ]; then
        export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
        echo "imglora: using this checkout through PYTHONPATH=$REPO/src"
    fi
fi
# `python -m imglora` rather than the `imglora` script: it works with PYTHONPATH too.
IMGLORA=("$PY" -m imglora)

# module -> pip name; the first seven are imglora's core, the rest what its commands import.
MODULES="diffusers transformers peft accelerate optimum.quanto safetensors click psutil matplotlib PIL numpy yaml tqdm huggingface_hub ${GPU_CHECK_EXTRA_MODULES:-}"
missing_modules() {  # prints the modules of "$@" that do not import
    "$PY" - "$@" <<'EOF'
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        print(name)
EOF
}
pip_name() {
    case "$1" in optimum.quanto) echo optimum-quanto ;; PIL) echo pillow ;; yaml) echo pyyaml ;;
        huggingface_hub) echo huggingface-hub ;; *) echo "$1" ;; esac
}
DEPS_OK=0
PYTEST_OK=0
lib_missing=""
if [ "$TORCH_OK" -eq 1 ]; then
    # shellcheck disable=SC2086  # the module list is split on purpose
    missing=$(missing_modules $MODULES pytest | tr '\n' ' ')
    missing=${missing% }
    if [ -n "$missing" ]; then
        echo "missing Python modules: $missing"
        pkgs=""
        for m in $missing; do pkgs="$pkgs $(pip_name "$m")"; done
        if [ "$DRY" -eq 1 ] || [ "${GPU_CHECK_PIP:-1}" = 0 ]; then
            echo "not running pip ($([ "$DRY" -eq 1 ] && echo 'dry run' || echo 'GPU_CHECK_PIP=0')): would install$pkgs"
        else
            # The installed torch stays: a dependency must not replace the CUDA build.
            constraint=$OUT/torch-constraint.txt
            "$PY" -c "import torch; print('torch==' + torch.__version__)" > "$constraint"
            echo "pip install$pkgs (torch held at $(cat "$constraint"))"
            # shellcheck disable=SC2086
            timeout 90 "$PY" -m pip install --disable-pip-version-check --retries 0 --timeout 10 \
                -c "$constraint" $pkgs || echo "pip install failed (offline?)"
            # shellcheck disable=SC2086
            missing=$(missing_modules $MODULES pytest | tr '\n' ' ')
            missing=${missing% }
        fi
    fi
    case " $missing " in *" pytest "*) ;; *) PYTEST_OK=1 ;; esac
    lib_missing=$(echo " $missing " | sed 's/ pytest / /; s/^ *//; s/ *$//')
    if [ -z "$lib_missing" ]; then
        DEPS_OK=1
        echo "dependencies: all import$([ "$PYTEST_OK" -eq 0 ] && echo ' (but pytest is missing)')"
        "$PY" -c "
import importlib.metadata as m
for p in ('diffusers', 'transformers', 'peft', 'accelerate', 'optimum-quanto', 'safetensors'):
    try: print(' ', p, m.version(p))
    except m.PackageNotFoundError: print(' ', p, '(no metadata)')
" || true
    else
        echo "MISSING (could not install): $lib_missing -- the pytest, bench-swap and plan steps are skipped"
    fi
fi
env_note="python $("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null)"
[ "$TORCH_OK" -eq 1 ] || env_note="$env_note; torch missing"
[ "$TORCH_OK" -eq 1 ] && [ "$DEPS_OK" -eq 0 ] && env_note="$env_note; missing: $lib_missing"
[ "$TORCH_OK" -eq 1 ] && [ "$PYTEST_OK" -eq 0 ] && env_note="$env_note; pytest missing"
echo "== [env] done in $((SECONDS - t0)) s; $(elapsed) s of ${TOTAL} s used"
record env ok 0 "$((SECONDS - t0))" "$env_note"

if [ "$DRY" -eq 1 ]; then
    PRESET=presets/tiny-flux.toml
    BLOCKS=fp8:0,fp8:4
    SWAPPED=fp8:4
    BENCH_ARGS=(--steps 2 --warmup 1)
    SIZE_ARGS=()  # the preset's resolution
    SUMMARY_ARGS=(--dry-run --swapped "$SWAPPED")
else
    PRESET=presets/flux.toml
    BLOCKS=fp8:0,fp8:18
    SWAPPED=fp8:18
    BENCH_ARGS=(--arch full --steps 8 --warmup 3)
    SIZE_ARGS=(--resolution 1024)
    SUMMARY_ARGS=(--swapped "$SWAPPED")
fi

# ------------------------------------------------------------------------------ 1: probe
if [ "$TORCH_OK" -eq 1 ]; then
    run_step probe "$(budget 50)" "$PY" benchmarks/gpu_probe.py --out "$OUT/probe.json"
else
    skip probe "torch is not importable"
fi

# ------------------------------------------------------------------------------ 2: GPU tests
if [ "$DEPS_OK" -eq 1 ] && [ "$PYTEST_OK" -eq 1 ]; then
    run_step pytest "$(budget 100)" "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml"
else
    skip pytest "needs pytest and imglora's dependencies"
fi

# ------------------------------------------------------------------------------ 3: bench-swap
if [ "$DEPS_OK" -eq 1 ]; then
    t=$(budget 240)
    # Each setting gets its share, so a slow one cannot take the other's result with it
    # (bench.json is written at the end; finished settings also leave setting-N/result.json).
    per_setting=$(( (t - 20) / 2 ))
    [ "$per_setting" -lt 10 ] && per_setting=10
    run_step bench "$t" "${IMGLORA[@]}" bench-swap "$PRESET" "${BENCH_ARGS[@]}" ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} \
        --blocks "$BLOCKS" --set memory.swap_prefetch=1 --timeout "$per_setting" --out "$OUT/bench-flux"
else
    skip bench "needs imglora's dependencies"
fi

# ------------------------------------------------------------------------------ 4: plan
if [ "$DEPS_OK" -eq 1 ]; then
    if timeout 60 "${IMGLORA[@]}" plan --help >/dev/null 2>&1; then
        run_step plan "$(budget 30)" "${IMGLORA[@]}" plan "$PRESET" --blocks "$BLOCKS" ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} \
            --json "$OUT/plan.json"
    else
        echo "imglora plan not available"
        skip plan "imglora plan not available"
    fi
else
    skip plan "needs imglora's dependencies"
fi

# ------------------------------------------------------------------------------ 5: summary
echo
echo "== [summary]"
t0=$SECONDS
timeout "$RESERVE" "$PY" benchmarks/gpu_summary.py --probe "$OUT/probe.json" --bench "$OUT/bench-flux/bench.json" \
    --plan "$OUT/plan.json" --junit "$OUT/pytest-gpu.xml" --steps "$STEPS" --md "$OUT/summary.md" \
    "${SUMMARY_ARGS[@]}"
rc=$?
echo "== [summary] exit $rc in $((SECONDS - t0)) s; the check took $(elapsed) s (limit ${TOTAL} s)"
[ -f "$OUT/summary.md" ] || { echo "no summary written"; rc=1; }
echo "everything is in $OUT (summary.md: paste into docs/benchmarks.md)"
exit "$rc"
