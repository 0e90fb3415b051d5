#!/usr/bin/env bash
# The wheels an offline CUDA box lacks, for benchmarks/gpu_check.sh: run this on a machine with a
# package index, then carry the git-ignored folder .whl/ to the box with the checkout.
#
#   benchmarks/gpu_wheels.sh             # fills .whl/ (from the repository root)
#   benchmarks/gpu_wheels.sh --list      # prints the pinned wheels and exits
#
# The box this is for (docs: the device machine's package list) has Python 3.12, torch 2.11,
# transformers 5.17, accelerate, peft, safetensors, huggingface_hub 1.33, numpy, pillow, click,
# psutil, matplotlib, pyyaml, tqdm, tokenizers and pytest, but no diffusers and no optimum-quanto.
# Both are pure Python, and everything they need at import time is on the box (diffusers:
# filelock, huggingface-hub, numpy, regex, requests, safetensors, pillow, packaging -- its
# importlib_metadata is only imported on Python < 3.8; optimum-quanto: torch, ninja, numpy,
# safetensors, huggingface_hub), so they are fetched with --no-deps. The versions are the ones this
# project is tested with. The folder is kept small (the tree that travels to the box is limited to
# 64 MiB in all): the total is printed and more than MAX_MIB fails.
#
# Environment: PYTHON (default python3) runs pip; GPU_WHEELS_DIR (default .whl); GPU_WHEELS_MAX_MIB
# (default 40).

set -euo pipefail

WHEELS=(diffusers==0.42.1 optimum-quanto==0.2.7)
MAX_MIB=${GPU_WHEELS_MAX_MIB:-40}

if [ "${1:-}" = "--list" ]; then printf '%s\n' "${WHEELS[@]}"; exit 0; fi
if [ $# -gt 0 ]; then echo "unknown argument: $1 (usage: benchmarks/gpu_wheels.sh [--list])" >&2; exit 2; fi

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
DIR=${GPU_WHEELS_DIR:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DIR"

# CPython 3.12 on x86-64 Linux, wheels only (no source build on the box or here).
"$PY" -m pip download --disable-pip-version-check --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DIR" "${WHEELS[@]}"

# One version of each distribution: two would stop the whole --no-index install on the box.
names=""
for w in "${WHEELS[@]}"; do names="$names $(echo "${w%%==*}" | tr '-' '_')"; done
for f in "$DIR"/*.whl; do
    dist=$(basename "$f" | cut -d- -f1)
    case " $names " in
        *" $dist "*) ;;
        *) echo "removing $f: not in the pinned set (${WHEELS[*]})"; rm -f "$f" ;;
    esac
done
for w in "${WHEELS[@]}"; do
    want="$(echo "${w%%==*}" | tr '-' '_')-${w#*==}-"
    for f in "$DIR/$(echo "${w%%==*}" | tr '-' '_')"-*.whl; do
        case "$(basename "$f")" in "$want"*) ;; *) echo "removing $f: not the pinned $w"; rm -f "$f" ;; esac
    done
done

ls -l "$DIR"/*.whl
kib=$(du -sk "$DIR" | cut -f1)
mib=$(( (kib + 1023) / 1024 ))
echo "total: ${mib} MiB in $DIR ($(find "$DIR" -type f -name '*.whl' | wc -l) wheels; limit ${MAX_MIB} MiB)"
if [ "$mib" -gt "$MAX_MIB" ]; then
    echo "too large: ${mib} MiB > ${MAX_MIB} MiB (the tree that travels to the GPU box is limited to 64 MiB)" >&2
    exit 1
fi
echo "carry $DIR to the GPU box with the checkout; benchmarks/gpu_check.sh installs it with pip --no-index"
