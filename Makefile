# tp-query: `make demo` and `make test` are the two commands of the README.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
GPU ?= h200
TORCH_PIN := torch==2.13.0
# Where torch comes from. Empty: pip's default (PyPI, or a local CPU wheel where the machine provides one).
# On a plain Linux machine PyPI's torch is a CUDA build of several GB; for the CPU build run
#   make test TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: install demo test check lint typecheck collect collect-comm validate validate-dist report bench clean templates snapshot

# A virtual environment with a CPU-only torch pinned first (a bare `torch` would pull a CUDA build).
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN) $(TORCH_INDEX)
	$(BIN)/pip install -q -e '.[trace,dev]'
	touch $(STAMP)

install: $(STAMP)

# The main job: an example prediction on the shipped H200 database.
demo: $(STAMP)
	$(BIN)/tp-query predict examples/llama3.1-8b.json --gpu h200 --dp 2 --tp 4

test: $(STAMP)
	$(BIN)/python -m pytest tests

# Graph templates of a model's structural types into data/templates (resumable: builds only what is missing).
TEMPLATE_MODEL ?= examples/llama3.1-8b.json
TEMPLATE_PRECISIONS ?= amp_bf16,bf16,amp_fp16,fp16,mp_bf16,mp_fp16,fp8_tensorwise,fp8_rowwise
templates: $(STAMP)
	$(BIN)/python -m tp_query.engine.trace.template_build $(TEMPLATE_MODEL) --precisions $(TEMPLATE_PRECISIONS)

# The database's shipped snapshot (every read the engine makes, derived by DuckDB once): after a campaign changes
# data/$(GPU); a stale one is ignored (and a test says so).
snapshot: $(STAMP)
	$(BIN)/python -m tp_query.engine.snapshot $(GPU)

lint: $(STAMP)
	$(BIN)/ruff check schema collector engine tests

typecheck: $(STAMP)
	$(BIN)/mypy schema collector engine

check: lint typecheck test

# A profiling campaign on this machine's GPU (GPU=h200, GPU=h100, ...): resumable, chunked.
# Works without a virtual environment too (a GPU box with torch, pyarrow, rich and nvidia-ml-py).
NS := .ns
$(NS)/tp_query:
	mkdir -p $(NS)/tp_query
	for d in schema engine collector; do ln -sfn $(CURDIR)/$$d $(NS)/tp_query/$$d; done

SIGS := $(wildcard data/$(GPU)/campaigns/*.jsonl)
collect: $(NS)/tp_query
	PYTHONPATH=$(NS) $(PY) -m tp_query.collector collect --gpu $(GPU) --out data/$(GPU)/ops --grid \
		$(if $(SIGS),--sigs $(SIGS)) --repeat-fraction 0.03 $(ARGS)

# Real training iterations on this machine's GPU, then the op logs for the graph-fidelity test.
validate: $(NS)/tp_query
	PYTHONPATH=$(NS) $(PY) -m tp_query.collector validate --gpu $(GPU) $(ARGS)
	PYTHONPATH=$(NS) $(PY) -m tp_query.collector oplog --out data/validation/oplog-$(GPU).parquet

# Several GPUs of one host (NGPU of them): NCCL collectives, and distributed training iterations.
NGPU ?= 8
collect-comm: $(NS)/tp_query
	PYTHONPATH=$(NS) NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node $(NGPU) -m tp_query.collector comm \
		--gpu $(GPU) --out data/$(GPU)/comm $(ARGS)

# Distributed training iterations (torch: DDP, FSDP2, DTensor TP/SP, pipelining; Megatron-Core), NGPU of
# them: resumable, one torchrun for the whole campaign. Megatron-Core needs CUDA_DEVICE_MAX_CONNECTIONS=1.
# The host probe keeps this machine instance's rows beside other instances'; ARGS=--machine-sample measures
# the cases again as this instance's own samples (data/validation/machines/<id>/).
DIST_ENV := PYTHONPATH=$(NS)$(if $(PYTHONPATH),:$(PYTHONPATH)) NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
validate-dist: $(NS)/tp_query
	$(DIST_ENV) torchrun --nproc-per-node $(NGPU) -m tp_query.collector dist-probe --gpu $(GPU)
	$(DIST_ENV) torchrun --nproc-per-node $(NGPU) -m tp_query.collector dist-validate --gpu $(GPU) \
		--frameworks torch $(ARGS)
	$(DIST_ENV) CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node $(NGPU) -m tp_query.collector \
		dist-validate --gpu $(GPU) --frameworks megatron $(ARGS)

# CPU side: fit the host model on the calibration split, compare, write docs/validation.md.
report: $(STAMP)
	$(BIN)/tp-query report --gpu $(GPU) --calibration-out data/$(GPU)/calibration.json

# Whole processes, several runs each (minimum and median); fails when a target is missed. ARGS=--quick
# searches a smaller space for the search figures.
bench: $(STAMP)
	rc=0; $(BIN)/python tests/bench/bench_trust.py || rc=1; \
	$(BIN)/python tests/bench/bench_engine.py $(ARGS) || rc=1; \
	$(BIN)/python tests/bench/bench_collector.py || rc=1; exit $$rc

clean:
	rm -rf $(VENV) $(NS) .pytest_cache .mypy_cache .ruff_cache
