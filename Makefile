# The two commands of the README: `make demo` and `make test`. Both create (or reuse) the
# virtual environment in .venv and install what they need into it.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH_VERSION ?= 2.13.0
# Where a CPU-only torch build comes from when this machine has no GPU and no local wheel.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
RUN_DIR ?= runs/demo
PYTEST_ARGS ?=
# TorchRec for `dlrmflow bench report`'s side-by-side comparison: a set that runs with the
# torch above. Installed without dependencies, since torchrec's metadata would pull the
# GPU build of FBGEMM and an old torchmetrics.
TORCHREC_PKGS := torchrec==1.8.0 tensordict==0.15.3 pyvers==0.2.3 \
	pyre-extensions==0.0.32 typing-inspect==0.9.0 mypy-extensions==1.2.0
# TorchX for `dlrmflow launch torchx` (its components) and their tests. Without its
# dependencies: its metadata pins urllib3 below 1.27, which the S3 client's urllib3 2
# excludes, and its local and Slurm schedulers never import urllib3; the rest of what it
# needs is installed already.
TORCHX_PKGS := torchx==0.7.0 tabulate==0.10.0
# FBGEMM (model.kernels=fbgemm, and TorchRec's kernels): the release built for the torch
# above. Its CUDA build where a GPU is present, else its CPU build.
FBGEMM_VERSION ?= 1.8.0
RECBOLE_VERSION ?= 1.2.1

.PHONY: demo test test-across-cpus lint bench-movielens gpu-check bench-ingest bench-report bench-docs bench-scale bench-recurring bench-dynamic bench-schedule bench-step clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	@# torch first: a CUDA build only where a GPU is present, else a CPU build (a local
	@# wheel when pip's find-links has one, else the CPU index), never the multi-GB CUDA one.
	if $(PY) -c "import torch" 2>/dev/null; then :; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install torch==$(TORCH_VERSION); \
	else $(PIP) install --no-deps --no-index torch==$(TORCH_VERSION) 2>/dev/null \
	  || $(PIP) install --no-deps --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION); \
	  $(PIP) install torch==$(TORCH_VERSION); fi
	$(PIP) install -c constraints.txt -e '.[dev]'
	$(PIP) install --no-deps $(TORCHREC_PKGS)
	$(PIP) install --no-deps $(TORCHX_PKGS)
	@# MovieLens-100k for `dlrmflow bench movielens`: package data of recbole's wheel, whose
	@# licence forbids passing the data on (so it is never committed); its code is not used.
	$(PIP) install --no-deps recbole==$(RECBOLE_VERSION)
	@# Where no FBGEMM build matches the installed torch, one line says so and auto uses Triton.
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install --no-deps fbgemm-gpu==$(FBGEMM_VERSION) \
	  || echo "warning: no fbgemm-gpu $(FBGEMM_VERSION) build for this torch; model.kernels=auto uses Triton"; \
	else $(PIP) install --no-deps fbgemm-gpu-cpu==$(FBGEMM_VERSION); fi
	$(PY) scripts/fbgemm_status.py
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/dlrmflow demo --run-dir $(RUN_DIR)

# Most of the suite on two xdist workers (a file's tests stay on one worker, sharing its
# fixtures); then, alone, the tests marked serial, which time waits and signals. A phase
# that selects no test (exit 5, with PYTEST_ARGS naming files) is not a failure.
PYTEST_PHASES = $(PY) -m pytest -q -n 2 --dist loadfile -m "not serial" $(PYTEST_ARGS) \
	  || [ $$? -eq 5 ]; \
	  $(PY) -m pytest -q -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

test: $(VENV)/.installed
	set -e; $(PYTEST_PHASES)

# The suite under another CPU's code paths on this one (tests/across_cpus.py's OTHER_CPU):
# a test that pins this machine's bits fails here, not on the next machine.
test-across-cpus: $(VENV)/.installed
	set -e; export MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2 \
	  NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"; $(PYTEST_PHASES)

# On a machine with a GPU: the gpu tests, the demo on cuda:0 under each TBE backend and the
# kernel benchmark on the GPU, in ~13 minutes, into one JSON (gpu-results/gpu_check.json).
gpu-check: $(VENV)/.installed
	$(PY) scripts/gpu_check.py --out gpu-results/gpu_check.json

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check dlrmflow tests
	$(VENV)/bin/ruff format --check dlrmflow tests

# Reader + transform against pyarrow's decode (~20 s); `dlrmflow bench docs --ingest
# bench-results/ingest.json` puts it in the docs (the report runs it too).
bench-ingest: $(VENV)/.installed
	$(VENV)/bin/dlrmflow bench ingest --json bench-results/ingest.json

# Criteo's full cardinalities (33.8M rows at dim 64) on 2 ranks under a 256 MiB budget per
# rank, against the same job all in memory: ~7 minutes and ~25 GB of disk here. Then
# `dlrmflow bench docs --scale bench-results/scale.json` puts it in the docs.
bench-scale: $(VENV)/.installed
	$(VENV)/bin/dlrmflow bench scale --json bench-results/scale.json

# A model line against daily retraining and a frozen model on 12 drifting days (~5 min);
# then `dlrmflow bench docs --report docs/benchmarks.json --recurring
# bench-results/recurring/recurring.json` puts it in the docs.
bench-recurring: $(VENV)/.installed
	$(VENV)/bin/dlrmflow bench recurring --json bench-results/recurring/recurring.json

# Model lines with dynamic ID tables against hashing and a day-0 vocabulary on 15 churning
# days; `dlrmflow bench docs --report docs/benchmarks.json --dynamic
# bench-results/dynamic.json` puts it in the docs.
bench-dynamic: $(VENV)/.installed
	$(VENV)/bin/dlrmflow bench dynamic --json bench-results/dynamic.json

# MovieLens-100k registered by week and trained as a model line, against each movie's past
# click rate; `dlrmflow bench docs --report docs/benchmarks.json --movielens
# bench-results/movielens.json` puts it in the docs.
bench-movielens: $(VENV)/.installed
	$(VENV)/bin/dlrmflow bench movielens --json bench-results/movielens.json

bench-schedule: $(VENV)/.installed
	$(VENV)/bin/dlrmflow bench schedule --json bench-results/schedule/schedule.json

# One process's training step in fp32 and bf16 against the multiply-bound ceiling, with
# its per-op profile (~20 s); `dlrmflow bench docs --step bench-results/step.json` puts it
# in the docs (the report runs it too).
bench-step: $(VENV)/.installed
	$(VENV)/bin/dlrmflow bench step --json bench-results/step.json

bench-report: $(VENV)/.installed
	$(VENV)/bin/dlrmflow bench report --out bench-results/report

# The full report, then docs/benchmarks.md and the README's results table from its JSON.
bench-docs: bench-report
	$(VENV)/bin/dlrmflow bench docs --report bench-results/report/report.json

clean:
	rm -rf $(VENV) runs build *.egg-info
