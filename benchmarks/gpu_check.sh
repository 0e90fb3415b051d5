#!/usr/bin/env bash
# The one-shot GPU check: every figure the FLUX memory path needs from a CUDA machine, in one run of
# at most 8 minutes, with no download and no package index (the GPU box has none).
#
#   benchmarks/gpu_check.sh [--out DIR]      # on the GPU machine, from the repository root
#   benchmarks/gpu_check.sh --dry-run        # the same steps on the CPU with the tiny FLUX model
#
# Before: on a machine with a package index, benchmarks/gpu_wheels.sh fills the git-ignored .whl/
# with the libraries the box lacks (diffusers, optimum-quanto); bring .whl/ along with the checkout.
#
# Steps, in order of value (a GPU window may end early); each under `timeout`, its elapsed time
# printed; the whole run, wheel install included, is held to 480 s:
#   0 environment: nvidia-smi, python, torch and CUDA (no CUDA without --dry-run: stop at once);
#     imglora is this checkout's, through PYTHONPATH=src; a library that does not import is
#     installed from .whl/ only (pip --no-index --no-deps --target a temporary folder, added to
#     PYTHONPATH), else named, and the steps that need it are skipped
#   1 imglora bench-swap presets/flux.toml --arch full --resolution 1024 --blocks fp8:18,fp8:0,fp8c:18
#       --steps 8 --warmup 3 --set memory.swap_prefetch=1 (fp8:18 first; random FLUX.1-dev weights
#       made on the GPU: no model download; prefetch held at 1 block, the least memory, which the
#       peak target is about; the result still records each block's measured copy and compute time
#       and the depth auto would choose, memory.swap_prefetch = 0, the default; fp8c:18, fp8 compute,
#       last: the first H200 run measured it where the other two crashed)
#   2 diagnose, only when a bench setting crashed or trained a NaN (then it comes before the rest):
#     benchmarks/bare_bisect.py's kernel cases (no imglora: PyTorch's default kernel, flash and
#     efficient on the full FLUX.1-dev, DIR/bisect/; skipped when the bisect step already ran), then
#     imglora's bf16:0 with offloaded checkpoints off (plain bf16: no quanto, swap or offload on the
#     question) with memory.attention_kernel = "math" (3 updates, DIR/diagnose-math/: finite there =
#     a fused attention kernel is the cause), then one update of it with CUDA_LAUNCH_BLOCKING=1 and
#     bench-swap --detect-anomaly (DIR/diagnose/)
#   bisect (only when named in GPU_CHECK_STEPS; first then): benchmarks/bare_bisect.py, every case, DIR/bisect/
#   families (only when named): SDXL's full UNet at 1024 px (bf16:0) and the chat-LLM preset's full
#     architecture with its 4-bit base, bench-swap each (DIR/bench-sdxl/, DIR/bench-llm/)
#   new-families (only when named): Z-Image Turbo, FLUX.2 [klein] base 4B, Krea 2 and Qwen-Image 2.1's full architectures
#     at 1024 px with their presets' memory setting (fp8:0), 5 updates each: finite losses, s/update,
#     peaks (DIR/bench-z-image/, DIR/bench-flux2-klein/, DIR/bench-krea2/, DIR/bench-qwen-image-2.1/; FLUX.2 [dev]'s 32B is left out
#     of a 15-minute window)
#   3 python -m pytest -m gpu (HF_HUB_OFFLINE=1)
#   4 benchmarks/gpu_probe.py: copy bandwidth, copy/compute overlap, fp8 matmuls, attention kernels, the GPU
#   5 imglora plan (the prediction for the same settings; needs no GPU)
#   6 benchmarks/gpu_summary.py: each target with PASS / FAIL / NOT MEASURED, the plan's prediction
#     next to each measured peak; DIR/summary.md is the same in Markdown for docs/benchmarks.md
#
# Everything lands in DIR (default gpu-check-<timestamp>): check.log (all output), steps.tsv,
# probe.json, pytest-gpu.xml, bench-flux/ (bench.json, .csv, .png, one folder per setting),
# diagnose-math/ and diagnose/ (if they ran), plan.json, summary.md. Exit status: 0 when every target passes (dry run: when every step ran),
# 1 otherwise (CUDA unavailable without --dry-run: at once), 2 on a usage error.
#
# The next GPU window's two commands (each one call, 8 and 5 minutes):
#   GPU_CHECK_STEPS=bisect benchmarks/gpu_check.sh --out gpu-1          # the bare control
#   GPU_CHECK_STEPS="bench families" GPU_CHECK_BLOCKS=fp8:18,bf16:0,fp8c:18 GPU_CHECK_REFERENCE=bf16:0 \
#     GPU_CHECK_UPDATES=12 GPU_CHECK_TOTAL=300 GPU_CHECK_KERNEL=gpu-1/bisect/kernel benchmarks/gpu_check.sh --out gpu-2
#   (GPU_CHECK_KERNEL: the kernel the bisect's summary names, or the path of its DIR/bisect/kernel)
#
# Environment: PYTHON (default: the first of python3, python that has torch); GPU_CHECK_PIP=0 never
# runs pip (no wheel install); GPU_CHECK_WHEELS (default .whl); GPU_CHECK_STEPS (default "bench
# pytest probe diagnose plan": the others are skipped); GPU_CHECK_EXTRA_MODULES="a b" adds modules to the
# dependency check, GPU_CHECK_MODULES replaces its list (tests use them: each import takes seconds);
# GPU_CHECK_BLOCKS replaces the bench settings (default fp8:18,fp8:0,fp8c:18; fp8f:N is the fused dequantizing
# path, fp8c:N fp8 compute, a +compile suffix compiled blocks: fp8c+compile:18; its first update
# counts the compilation); GPU_CHECK_REFERENCE (default fp8:0) the unswapped setting the summary sets the swapped one
# against; GPU_CHECK_UPDATES (default 8) the bench's timed updates (after 3 warm-up); GPU_CHECK_KERNEL a
# memory.attention_kernel for the bench and families steps (a name, or a file holding one); GPU_CHECK_TOTAL
# (default 480) the seconds for the whole check; GPU_CHECK_BISECT_CASES the bare bisect's cases (default: all in the
# bisect step, the kernel cases in the diagnose step).

set -u

TOTAL=${GPU_CHECK_TOTAL:-480}  # seconds for the whole check
RESERVE=30         # of which kept for the summary
DRY=0
OUT=""
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }
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

# GPU_CHECK_KERNEL: memory.attention_kernel for the bench and families steps, as a name or the bisect's
# DIR/bisect/kernel file (the kernel it found to train finite); checked before anything runs.
KERNEL=${GPU_CHECK_KERNEL:-}
if [ -n "$KERNEL" ] && [ -f "$KERNEL" ]; then KERNEL=$(tr -d '[:space:]' < "$KERNEL"); fi
case "$KERNEL" in ""|auto|flash|efficient|cudnn|math) ;; *)
    echo "GPU_CHECK_KERNEL=$KERNEL: expected auto, flash, efficient, cudnn or math (or a file holding one)" >&2; exit 2 ;;
esac

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
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
else  # the python that holds torch: on the GPU box a plain python3
    PY=python3
    for c in python3 python; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" 2>/dev/null; then
            PY=$c; break
        fi
    done
fi

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
WANTED=" ${GPU_CHECK_STEPS:-bench pytest probe diagnose plan} "
wanted() { case "$WANTED" in *" $1 "*) return 0 ;; esac; return 1; }

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
CUDA_OK=0
torch_info=$(timeout 60 "$PY" -c "import torch; print('torch', torch.__version__, '| built for CUDA', torch.version.cuda, '| CUDA available:', torch.cuda.is_available())" 2>&1)
torch_rc=$?
echo "$torch_info" | tail -5
if [ "$torch_rc" -eq 0 ]; then
    TORCH_OK=1
    case "$torch_info" in *"CUDA available: True"*) CUDA_OK=1 ;; esac
else
    echo "MISSING: torch is not importable with $PY; only the summary can run"
fi
if [ "$DRY" -eq 0 ] && [ "$CUDA_OK" -eq 0 ]; then
    # Nothing here could measure a GPU figure; going on would build the 12B model on the host.
    if [ "$TORCH_OK" -eq 1 ]; then why="torch sees no CUDA device ($(echo "$torch_info" | tail -1))"
    else why="torch is not importable with $PY"; fi
    echo "gpu_check: STOPPED: CUDA is not available: $why. Run it on a CUDA machine, or rehearse the steps on the CPU with --dry-run"
    record env stopped 1 "$((SECONDS - t0))" "CUDA not available: $why"
    exit 1
fi

# Which imglora: this checkout's, always, through PYTHONPATH (nothing is installed into the python;
# an installed imglora is shadowed, never reinstalled over).
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
here="$REPO/src/imglora"
found=$("$PY" -c "import imglora, os; print(os.path.realpath(os.path.dirname(imglora.__file__)))" 2>/dev/null)
if [ "$found" = "$(realpath "$here")" ]; then
    echo "imglora: this checkout's, through PYTHONPATH=$REPO/src"
else
    echo "imglora: PYTHONPATH=$REPO/src does not give this checkout's imglora (got: ${found:-none})"
fi
# `python -m imglora` rather than the `imglora` script: it works with PYTHONPATH too.
IMGLORA=("$PY" -m imglora)

# module -> pip name; the first seven are imglora's core, the rest what its commands import.
MODULES="${GPU_CHECK_MODULES:-diffusers transformers peft accelerate optimum.quanto safetensors click psutil matplotlib PIL numpy yaml tqdm huggingface_hub} ${GPU_CHECK_EXTRA_MODULES:-}"
missing_modules() {  # prints the modules of "$@" that do not import (on stderr: why, one line each)
    local out rc
    out=$(timeout 120 "$PY" - "$@" <<'EOF'
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        print(name)
        why = " ".join(str(exc).split())
        print(f"  {name} does not import: {type(exc).__name__}: {why[:300]}", file=sys.stderr)
EOF
)
    rc=$?
    if [ "$rc" -ne 0 ]; then  # a hung or crashed import: none of them counts as importable
        echo "  the import check of: $* did not finish (exit $rc)" >&2
        printf '%s\n' "$@"
    elif [ -n "$out" ]; then
        printf '%s\n' "$out"
    fi
}
pip_name() {
    case "$1" in optimum.quanto) echo optimum-quanto ;; PIL) echo pillow ;; yaml) echo pyyaml ;;
        huggingface_hub) echo huggingface-hub ;; *) echo "$1" ;; esac
}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.whl}
wheels_for() {  # the wheels in $WHEELS of the pip names "$@" (wheel names: lower case, '_' for '-')
    local f dist n
    for f in "$WHEELS"/*.whl; do
        [ -f "$f" ] || continue
        dist=$(basename "$f" | cut -d- -f1 | tr 'A-Z.-' 'a-z__')
        for n in "$@"; do
            [ "$dist" = "$(echo "$n" | tr 'A-Z.-' 'a-z__')" ] && echo "$f"
        done
    done
}
install_wheels() {  # pip names -> installs their wheels from $WHEELS, offline, into a temporary folder
    local files site
    mapfile -t files < <(wheels_for "$@")
    if [ "${#files[@]}" -eq 0 ]; then
        echo "no wheel in $WHEELS for:$(printf ' %s' "$@")"
        return 1
    fi
    site=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX") || return 1
    echo "installing from $WHEELS (no index, no dependencies) into $site:$(printf ' %s' "${files[@]##*/}")"
    if ! timeout 120 "$PY" -m pip install --disable-pip-version-check --quiet --no-index --no-deps \
            --no-compile --no-cache-dir --target "$site" "${files[@]}"; then
        echo "pip install from $WHEELS failed"
        return 1
    fi
    export PYTHONPATH="$REPO/src:$site${PYTHONPATH#"$REPO/src"}"
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
        pkgs=()
        for m in $missing; do pkgs+=("$(pip_name "$m")"); done
        if [ "${GPU_CHECK_PIP:-1}" = 0 ]; then
            echo "not running pip (GPU_CHECK_PIP=0): would install from $WHEELS:$(printf ' %s' "${pkgs[@]}")"
        elif ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
            echo "no wheels in $WHEELS: run benchmarks/gpu_wheels.sh on a machine with a package index first, then bring .whl/ here with the checkout"
        else
            install_wheels "${pkgs[@]}"
            # shellcheck disable=SC2086  # only those that were missing: imports take seconds each
            missing=$(missing_modules $missing | tr '\n' ' ')
            missing=${missing% }
        fi
    fi
    case " $missing " in *" pytest "*) ;; *) PYTEST_OK=1 ;; esac
    lib_missing=$(echo " $missing " | sed 's/ pytest / /; s/^ *//; s/ *$//')
    if [ -z "$lib_missing" ]; then
        DEPS_OK=1
        echo "dependencies: all import$([ "$PYTEST_OK" -eq 0 ] && echo ' (but pytest is missing)')"
        timeout 60 "$PY" -c "
import importlib.metadata as m, importlib.util as u
for p, mod in (('torch', 'torch'), ('diffusers', 'diffusers'), ('transformers', 'transformers'), ('peft', 'peft'),
               ('accelerate', 'accelerate'), ('optimum-quanto', 'optimum.quanto'), ('safetensors', 'safetensors'),
               ('huggingface-hub', 'huggingface_hub')):
    try: v = m.version(p)
    except m.PackageNotFoundError: v = '(no metadata)'
    print(' ', p, v, 'from', u.find_spec(mod).origin)  # where it imports from, without importing it again
" || true
    else
        echo "MISSING (could not install): $lib_missing -- the bench-swap, pytest and plan steps are skipped"
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
    BLOCKS=fp8:4,fp8:0,fp8c:4  # the swapped setting first, as on the GPU
    SWAPPED=fp8:4
    REFERENCE=${GPU_CHECK_REFERENCE:-fp8:0}
    BENCH_ARGS=(--steps 2 --warmup 1)
    ARCH_ARGS=()  # the preset's own (tiny) model
    SIZE_ARGS=()  # the preset's resolution
    SDXL_PRESET=presets/tiny-sdxl.toml
    LLM_PRESET=presets/tiny-llm.toml
    NEW_FAMILIES=(z-image:presets/tiny-z-image.toml flux2-klein:presets/tiny-flux2.toml krea2:presets/tiny-krea2.toml
                  qwen-image-2.1:presets/tiny-qwen-image21.toml)
    FAMILY_ARGS=(--steps 2 --warmup 1)
    BISECT_ARGS=(--tiny)
    SUMMARY_ARGS=(--dry-run --swapped "$SWAPPED" --reference "$REFERENCE")
else
    PRESET=presets/flux.toml
    BLOCKS=fp8:18,fp8:0,fp8c:18  # fp8:18 first: the targets are about it
    SWAPPED=fp8:18
    REFERENCE=${GPU_CHECK_REFERENCE:-fp8:0}
    BENCH_ARGS=(--arch full --steps "${GPU_CHECK_UPDATES:-8}" --warmup 3)
    ARCH_ARGS=(--arch full)
    SIZE_ARGS=(--resolution 1024)
    SDXL_PRESET=presets/sdxl.toml
    LLM_PRESET=presets/qlora-llm.toml
    NEW_FAMILIES=(z-image:presets/z-image.toml flux2-klein:presets/flux2-klein.toml krea2:presets/krea2.toml
                  qwen-image-2.1:presets/qwen-image-2.1.toml)
    FAMILY_ARGS=(--arch full --steps 5 --warmup 1)
    BISECT_ARGS=()
    SUMMARY_ARGS=(--swapped "$SWAPPED" --reference "$REFERENCE")
fi
KERNEL_SET=()
if [ -n "$KERNEL" ]; then
    KERNEL_SET=(--set "memory.attention_kernel=\"$KERNEL\"")
    echo "attention kernel for bench and families: $KERNEL (GPU_CHECK_KERNEL)"
fi
# GPU_CHECK_BLOCKS replaces the settings (e.g. fp8:18,fp8:0,fp8f:18,fp8c:18 adds the fused path and fp8 compute; keep the
# swapped setting first): each gets an equal share of the bench step's time.
BLOCKS=${GPU_CHECK_BLOCKS:-$BLOCKS}
n_settings=$(( $(printf '%s' "$BLOCKS" | tr -cd ',' | wc -c) + 1 ))

# ------------------------------------------------------------------------------ bisect (when named)
# The bare control first: no imglora, each case in a process of its own, within its own budget.
BISECT_RAN=0
if wanted bisect; then
    if [ "$TORCH_OK" -eq 1 ] && [ -z "$(echo " $lib_missing " | grep -w -e diffusers -e peft -e transformers)" ]; then
        t=$(budget 450)
        NOTE="benchmarks/bare_bisect.py, every case"
        run_step bisect "$t" "$PY" benchmarks/bare_bisect.py --out "$OUT/bisect" --budget "$((t - 10))" \
            ${GPU_CHECK_BISECT_CASES:+--cases "$GPU_CHECK_BISECT_CASES"} ${BISECT_ARGS[@]+"${BISECT_ARGS[@]}"}
        BISECT_RAN=1
    else
        skip bisect "needs torch, diffusers, peft and transformers"
    fi
fi

# ------------------------------------------------------------------------------ 1: bench-swap
if ! wanted bench; then
    skip bench "not in GPU_CHECK_STEPS"
elif [ "$DEPS_OK" -eq 1 ]; then
    t=$(budget 240)
    # Each setting gets its share, so a slow one cannot take the other's result with it
    # (bench.json is written at the end; finished settings also leave setting-N/result.json).
    per_setting=$(( (t - 20) / n_settings ))
    [ "$per_setting" -lt 10 ] && per_setting=10
    run_step bench "$t" "${IMGLORA[@]}" bench-swap "$PRESET" "${BENCH_ARGS[@]}" ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} \
        --blocks "$BLOCKS" --set memory.swap_prefetch=1 ${KERNEL_SET[@]+"${KERNEL_SET[@]}"} --timeout "$per_setting" \
        --out "$OUT/bench-flux"
else
    skip bench "needs imglora's dependencies"
fi

# ------------------------------------------------------------------------------ 2: diagnose
# Right after the bench, and only when it found something wrong (then knowing why is worth more than
# the steps after it): a setting that crashed, or losses that are not finite
# (the first H200 run: an illegal memory access in two settings, NaN from the second update in all).
# One update of the swapped setting again, with CUDA_LAUNCH_BLOCKING=1 (a crash that goes away then
# is an ordering bug between streams or with host memory) and every backward under autograd's anomaly
# detection (the first operation that makes a NaN or infinity is named, with the forward line).
bench_trouble() {
    timeout 30 "$PY" - "$OUT/bench-flux/bench.json" <<'EOF2' 2>/dev/null
import json, math, sys
try:
    results = json.load(open(sys.argv[1]))["results"]
except Exception:
    sys.exit(0)  # no bench.json: the bench itself did not finish
bad = [r for r in results if r.get("status") != "ok"
       or any(not (isinstance(x, (int, float)) and math.isfinite(x)) for x in r.get("losses") or [])]
sys.exit(1 if bad else 2)
EOF2
}
if ! wanted diagnose; then
    skip diagnose "not in GPU_CHECK_STEPS"
elif [ "$DEPS_OK" -ne 1 ]; then
    skip diagnose "needs imglora's dependencies"
else
    bench_trouble
    case $? in
        1) # a: the bare control's kernel cases (no imglora), unless the bisect step ran them already
           if [ "$BISECT_RAN" -eq 0 ]; then
               t=$(budget 200)
               NOTE="benchmarks/bare_bisect.py: env, kernels, FLUX with the default, flash and efficient kernels"
               run_step diagnose-bisect "$t" "$PY" benchmarks/bare_bisect.py --out "$OUT/bisect" --budget "$((t - 10))" \
                   --cases "${GPU_CHECK_BISECT_CASES:-env,kernels,flux:default:1024,flux:flash:1024,flux:efficient:1024}" \
                   ${BISECT_ARGS[@]+"${BISECT_ARGS[@]}"}
           fi
           # b: imglora's plain bf16 path (no quanto, no swap, no offloaded checkpoints) with PyTorch's math
           #    kernel, asynchronous as before (3 updates: the first H200 run went NaN from the second):
           #    finite here = a fused attention kernel is the cause
           NOTE="bf16:0, offloaded checkpoints off, memory.attention_kernel = math, asynchronous, 3 updates"
           run_step diagnose-math "$(budget 75)" "${IMGLORA[@]}" bench-swap "$PRESET" \
               ${ARCH_ARGS[@]+"${ARCH_ARGS[@]}"} ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} --blocks bf16:0 \
               --steps 2 --warmup 1 --set memory.offload_checkpoints=false --set 'memory.attention_kernel="math"' \
               --timeout 65 --out "$OUT/diagnose-math"
           # c: launch-blocking (an ordering fault goes away) with anomaly detection (names the first NaN op)
           NOTE="CUDA_LAUNCH_BLOCKING=1, autograd anomaly detection, one update of bf16:0, offloaded checkpoints off"
           CUDA_LAUNCH_BLOCKING=1 run_step diagnose "$(budget 100)" "${IMGLORA[@]}" bench-swap "$PRESET" \
               ${ARCH_ARGS[@]+"${ARCH_ARGS[@]}"} ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} --blocks bf16:0 \
               --steps 1 --warmup 1 --detect-anomaly --set memory.offload_checkpoints=false --timeout 90 \
               --out "$OUT/diagnose" ;;
        2) skip diagnose "the bench found nothing to diagnose" ;;
        *) skip diagnose "no bench.json to read" ;;
    esac
fi

# ------------------------------------------------------------------------------ families (when named)
# SDXL and the chat-LLM preset through imglora's own bench on this GPU: finite losses, s/update, peaks.
if wanted families; then
    if [ "$DEPS_OK" -eq 1 ]; then
        NOTE="SDXL, bf16:0"
        run_step families-sdxl "$(budget 100)" "${IMGLORA[@]}" bench-swap "$SDXL_PRESET" "${FAMILY_ARGS[@]}" \
            ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} --blocks bf16:0 ${KERNEL_SET[@]+"${KERNEL_SET[@]}"} --timeout 90 \
            --out "$OUT/bench-sdxl"
        NOTE="chat LLM, its 4-bit base"
        run_step families-llm "$(budget 110)" "${IMGLORA[@]}" bench-swap "$LLM_PRESET" "${FAMILY_ARGS[@]}" \
            --blocks 0 ${KERNEL_SET[@]+"${KERNEL_SET[@]}"} --timeout 100 --out "$OUT/bench-llm"
    else
        skip families "needs imglora's dependencies"
    fi
fi

# ------------------------------------------------------------------------------ new families (when named)
# Issue 43's families through imglora's own bench on this GPU: each full architecture, its preset's setting.
if wanted new-families; then
    if [ "$DEPS_OK" -eq 1 ]; then
        for entry in "${NEW_FAMILIES[@]}"; do
            name=${entry%%:*}
            NOTE="$name, fp8:0"
            run_step "families-$name" "$(budget 150)" "${IMGLORA[@]}" bench-swap "${entry#*:}" "${FAMILY_ARGS[@]}" \
                ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} --blocks fp8:0 ${KERNEL_SET[@]+"${KERNEL_SET[@]}"} --timeout 140 \
                --out "$OUT/bench-$name"
        done
    else
        skip new-families "needs imglora's dependencies"
    fi
fi

# ------------------------------------------------------------------------------ 3: GPU tests
if ! wanted pytest; then
    skip pytest "not in GPU_CHECK_STEPS"
elif [ "$DEPS_OK" -eq 1 ] && [ "$PYTEST_OK" -eq 1 ]; then
    run_step pytest "$(budget 100)" "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml"
else
    skip pytest "needs pytest and imglora's dependencies"
fi

# ------------------------------------------------------------------------------ 4: probe
if ! wanted probe; then
    skip probe "not in GPU_CHECK_STEPS"
elif [ "$TORCH_OK" -eq 1 ]; then
    run_step probe "$(budget 50)" "$PY" benchmarks/gpu_probe.py --out "$OUT/probe.json"
else
    skip probe "torch is not importable"
fi

# ------------------------------------------------------------------------------ 5: plan
if ! wanted plan; then
    skip plan "not in GPU_CHECK_STEPS"
elif [ "$DEPS_OK" -eq 1 ]; then  # this checkout's imglora, which has the command
    run_step plan "$(budget 60)" "${IMGLORA[@]}" plan "$PRESET" --blocks "$BLOCKS" ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} \
        --json "$OUT/plan.json"
else
    skip plan "needs imglora's dependencies"
fi

# ------------------------------------------------------------------------------ 6: summary
echo
echo "== [summary]"
t0=$SECONDS
timeout "$RESERVE" "$PY" benchmarks/gpu_summary.py --probe "$OUT/probe.json" --bench "$OUT/bench-flux/bench.json" \
    --plan "$OUT/plan.json" --junit "$OUT/pytest-gpu.xml" --steps "$STEPS" --md "$OUT/summary.md" --diagnose "$OUT" \
    "${SUMMARY_ARGS[@]}"
rc=$?
echo "== [summary] exit $rc in $((SECONDS - t0)) s; the check took $(elapsed) s (limit ${TOTAL} s)"
[ -f "$OUT/summary.md" ] || { echo "no summary written"; rc=1; }
echo "everything is in $OUT (summary.md: paste into docs/benchmarks.md)"
exit "$rc"
