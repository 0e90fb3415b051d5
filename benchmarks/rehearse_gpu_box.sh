#!/usr/bin/env bash
# Rehearse benchmarks/gpu_check.sh on the offline GPU box, here on the CPU: a venv with exactly the
# box's Python stack, no diffusers and no optimum-quanto, then `gpu_check.sh --dry-run` inside a
# network namespace with no network at all (`unshare -n`, as root), the two missing libraries
# installed only from .whl/ (benchmarks/gpu_wheels.sh).
#
#   benchmarks/rehearse_gpu_box.sh [--out DIR]   # builds the venv if needed, then the dry run
#   benchmarks/rehearse_gpu_box.sh --build-only  # only the venv (downloads ~3 GB once: torch's CUDA build)
#   benchmarks/rehearse_gpu_box.sh --pins        # prints the box's versions it pins and exits
#
# The venv: REHEARSE_VENV (default .venv-gpubox, git-ignored), from REHEARSE_PYTHON (default: a
# python3.12 on PATH, else pyenv's newest 3.12); a changed pin list below is installed into it.
# Exit status: gpu_check.sh's (0: every step ran), 1 when the rehearsal itself could not run or a
# step did not, 2 on a usage error.

set -uo pipefail

# The box's versions (docs: the device machine's package list, as read there in 2026-11); torch
# 2.11.0 from the index is the CUDA build, which runs on the CPU. The box's peft, pillow, click,
# psutil, matplotlib, pyyaml and tqdm versions were not read: those this project is tested with.
PINS=(torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 huggingface_hub==1.33.0 safetensors==0.8.0
      numpy==2.5.2 tokenizers==0.23.2 peft==0.21.2 pillow==13.0.0 click==8.5.1 psutil==7.2.2
      matplotlib==3.11.2 pyyaml==6.0.4 tqdm==4.70.1 pytest ninja requests regex filelock packaging)
# (requests, regex, filelock, packaging: on the box, and what diffusers checks for at import; ninja:
# optimum-quanto's; versions not read there.)

OUTDIR=""
BUILD_ONLY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --build-only) BUILD_ONLY=1 ;;
        --pins) printf '%s\n' "${PINS[@]}"; exit 0 ;;
        --out) [ $# -ge 2 ] || { echo "--out needs a folder" >&2; exit 2; }; OUTDIR=$2; shift ;;
        *) echo "unknown argument: $1 (usage: benchmarks/rehearse_gpu_box.sh [--out DIR] [--build-only])" >&2; exit 2 ;;
    esac
    shift
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 1
VENV=${REHEARSE_VENV:-$REPO/.venv-gpubox}
VPY=$VENV/bin/python
STAMP=$VENV/imglora-pins.txt

find_python() {  # the first Python 3.12 that runs (a pyenv shim on PATH may not)
    local p
    local pyenv=("${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12)
    for p in "${REHEARSE_PYTHON:-}" "$(command -v python3.12 2>/dev/null)" /usr/bin/python3.12 \
             $(printf '%s\n' "${pyenv[@]}" | sort -rV); do
        [ -n "$p" ] && [ -x "$p" ] && "$p" -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
            && { echo "$p"; return; }
    done
}

if [ ! -x "$VPY" ]; then
    base=$(find_python)
    if [ -z "$base" ]; then
        echo "rehearse: no Python 3.12 here (set REHEARSE_PYTHON, or install python3.12-venv or pyenv's 3.12)" >&2
        exit 1
    fi
    echo "rehearse: creating $VENV from $base ($("$base" --version 2>&1))"
    "$base" -m venv "$VENV" || exit 1
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "${PINS[*]}" ]; then  # a changed list updates the venv in place
    echo "rehearse: installing into $VENV: ${PINS[*]}"
    "$VPY" -m pip install --disable-pip-version-check -q "${PINS[@]}" || { echo "rehearse: pip install failed" >&2; exit 1; }
    echo "${PINS[*]}" > "$STAMP"
fi
for gone in diffusers optimum-quanto; do  # as on the box: these come from .whl/ only
    if "$VPY" -m pip show -q "$gone" >/dev/null 2>&1; then "$VPY" -m pip uninstall -q -y "$gone"; fi
done
"$VPY" -c "import sys, torch, transformers, huggingface_hub as h
print('rehearse venv: python', sys.version.split()[0], '| torch', torch.__version__, '| transformers',
      transformers.__version__, '| huggingface_hub', h.__version__)" || exit 1
[ "$BUILD_ONLY" -eq 1 ] && exit 0

if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "rehearse: no .whl/ here; fetching it with benchmarks/gpu_wheels.sh (this machine has an index)"
    PYTHON="$VPY" benchmarks/gpu_wheels.sh || exit 1
fi
if [ "$(id -u)" != 0 ] || ! unshare -n true 2>/dev/null; then
    echo "rehearse: needs root and \`unshare -n\` (a network namespace with no network); not rehearsed" >&2
    exit 1
fi

OUTDIR=${OUTDIR:-$(mktemp -d "${TMPDIR:-/tmp}/rehearse-gpu-box.XXXXXX")}
mkdir -p "$OUTDIR" || exit 1
OUTDIR=$(cd "$OUTDIR" && pwd)
HOME_DIR=$OUTDIR/home
mkdir -p "$HOME_DIR"
echo "rehearse: gpu_check.sh --dry-run with no network; output in $OUTDIR/check"
# A clean environment, as on the box: no PYTHONPATH, no pip configuration (no index, no find-links),
# this venv's python first on PATH; one thread per library (a shared machine).
unshare -n env -i PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" HOME="$HOME_DIR" \
    IMGLORA_HOME="$HOME_DIR/imglora" PIP_CONFIG_FILE=/dev/null PYTHON="$VPY" TMPDIR="$OUTDIR" \
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}" LANG=C.UTF-8 \
    bash benchmarks/gpu_check.sh --dry-run --out "$OUTDIR/check"
rc=$?
steps=$OUTDIR/check/steps.tsv
# (the diagnose step runs only when the bench crashed or trained a NaN: skipped is its good outcome)
bad=$(awk -F'\t' '$2 != "ok" && !($1 == "diagnose" && $2 == "skipped") {print $1 " " $2}' "$steps" 2>/dev/null | tr '\n' ';')
echo "rehearse: gpu_check.sh exit $rc; steps: $(cut -f1,2 "$steps" 2>/dev/null | tr '\t\n' '= ')"
if [ "$rc" -eq 0 ] && [ -s "$steps" ] && [ -z "$bad" ]; then
    echo "rehearse: PASS (every step ran, offline, with the GPU box's versions)"
    exit 0
fi
echo "rehearse: FAIL${bad:+ (not ok: $bad)}"
[ "$rc" -eq 0 ] && exit 1
exit "$rc"
