# Set-up is part of every target: on a fresh machine `make train` or `make test` is all it takes.
# torch is pinned *before* the package is installed: an unpinned torch pulls several GB of CUDA wheels
# (on this project's CPU machines `torch==2.13.0` resolves to the CPU wheel on disk). Override with
# `make test TORCH=torch==2.14.1` (or TORCH= to keep whatever torch the interpreter already has).
PYTHON ?= python3
TORCH ?= torch==2.13.0
# litdata's StreamingDataLoader is tested (mid-epoch resume); it is installed without its dependencies, as
# pyproject.toml's `test` extra explains (its torchvision would break `import lightning` next to the CPU torch)
LITDATA ?= litdata==0.2.76
# litgpt's GPT is one of the model families tensor parallelism is tested on (tests/tensor_parallel_models.py); its
# model code needs only torch, so it is installed without its dependencies too (its pinned huggingface_hub would
# replace the one transformers needs)
LITGPT ?= litgpt==0.5.13
# bitsandbytes (a base loaded in 4 bits, tests/integration/bitsandbytes_qlora.py; 0.50.2 runs its 4-bit layers on the
# CPU too) goes into .bitsandbytes, outside the environment, and only that test's script puts it on its path: peft
# imports bitsandbytes whenever it finds it, seconds in every process of the suite that imports peft
BITSANDBYTES ?= bitsandbytes==0.50.2
# Every `pip install` here passes --no-compile: pip would byte-compile every module of torch, Lightning and transformers
# at install time, one file after another (torch 2.13's CPU wheel: 53 s with, 14 s without, measured here). The set-up
# then byte-compiles the whole environment once, on every core, into PYCACHE (`compileall -j 0`: 24 s for all of it
# on 2 cores), so that no test pays for it and two test workers never compile the same module at once, which they did
# on a clean clone (the default suite took 346.5 s so; 318.5 s, with 18 more tests, in a checkout whose cache was warm).
# Every interpreter the targets start (the tests start hundreds: popen and spawn ranks, scripts, the docs' examples,
# notebooks, the install check) reads the modules it imports from their byte-compiled copies, which the first one to
# import a module writes under PYCACHE (a folder of this checkout; `make clean-pycache` empties it). An environment
# that sets PYTHONDONTWRITEBYTECODE would have every interpreter compile torch's and Lightning's sources again from
# scratch: `import pytorch_lightning, lightning_mgpu` took 11 s so on 2 busy cores, 4.6 s from the cache.
PYCACHE ?= $(CURDIR)/.pycache
export PYTHONPYCACHEPREFIX := $(PYCACHE)
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The compatibility tiers (`make test-compat`): the `-m compat` subset (parity of every preset at k=1, 2, manual
# accumulation, sharded resume at another world size, CLI round trip; each also from the `lightning` copy of
# the tests) in a venv of its own per tier; the two torch tiers split the namespaces between them (`--compat-namespace`,
# tests/conftest.py: the newest torch runs the `pytorch_lightning` originals, the oldest the `lightning` copies, what
# has no copy runs in both), so each torch meets one namespace and each namespace a torch besides the suite's. Oldest declared Lightning, both distributions, on the CPU wheel (skipped,
# saying so, while the suite's own environment already has exactly that release: the newest is the oldest today);
# the newest declared Lightning on the newest declared torch (.ci/requirements-newest.txt: its CUDA wheel, which
# installs and runs without a GPU, about 5 GB downloaded) and the newest declared Python (pyenv's 3.13, else
# python3.13).
OLDEST_LIGHTNING ?= 2.6.6
NEWEST_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13.*/bin/python3.13) python3.13)
# The oldest declared torch, on another Python, as on GPU machines without network that bring their own torch: Python 3.12 (pyenv's, else python3.12)
# with torch 2.11's wheel (downloaded: about 3 GB with its CUDA libraries, which install without a GPU) and without
# the optional packages (no jsonargparse, no fairscale, no transformers): the pack is installed with --no-deps.
OLDEST_TORCH ?= torch==2.11.0
OLDEST_TORCH_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3.12) python3.12)

.PHONY: setup train test clean-pycache test-profile test-suite test-slow test-gpu-cpu test-compat test-install test-compat-oldest test-compat-cuda test-compat-torch-oldest compat-clean test-gpu bench-gpu gpu-proof gpu-wheels bench lint notebooks docs test-lightning

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(BIN)/python -m pip install -q --no-compile "$(TORCH)")
	$(BIN)/python -m pip install -q --no-compile -e ".[test]"
	$(BIN)/python -m pip install -q --no-compile --no-deps "$(LITDATA)" "$(LITGPT)"
	rm -rf .bitsandbytes && $(BIN)/python -m pip install -q --no-compile --no-deps --target .bitsandbytes "$(BITSANDBYTES)"
	@# a module only a newer Python parses (torch's testing/_internal/py312_intrinsics.py on 3.11) fails to compile,
	@# as it would fail to import: compileall's status says nothing about the set-up
	$(BIN)/python -m compileall -qq -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	touch $(STAMP)

setup: $(STAMP)

clean-pycache:
	rm -rf $(PYCACHE)

# The main job: the sample digits CNN with mgpu_ddp (2 CPU processes without a GPU).
train: $(STAMP)
	$(BIN)/python -m lightning_mgpu.examples.train

# What CI runs (.ci/run): the linters, then the whole suite (both Lightning namespaces) in two parts, the default
# suite (`pytest`: everything but the `slow` marker) and the slow tests (launches of every kind, notebooks, the docs'
# examples, the numerics matrix in the lower precisions), then the GPU tier's CPU checks, then the compatibility
# tiers, then the install check, then the docs site.
# Each tier prints its time as it finishes ("[make test] TIER: N s"), and the list comes again at the end: the
# profile of the run by tier (`make test-profile` profiles the tests within one).
TEST_TIERS := lint test-suite test-slow test-gpu-cpu test-compat test-install docs
test: $(STAMP)
	@rm -f .test-times; for tier in $(TEST_TIERS); do start=$$(date +%s); \
		$(MAKE) --no-print-directory $$tier || exit 1; \
		echo "[make test] $$tier: $$(( $$(date +%s) - start )) s" | tee -a .test-times; done; \
	echo "[make test] every tier passed:"; cat .test-times

# Where the suite's time goes (tests/suite_profile.py): the default suite (or PROFILE_ARGS, e.g. "-m slow") with the
# profiling plugin, then the 30 slowest tests and files with their share of the run and what each spends its time on
# (start-up, rendezvous, steps, compile, the rest of the fit, the test's own process).
PROFILE_ARGS ?=
test-profile: $(STAMP)
	$(BIN)/python -m pytest -p tests.suite_profile --profile-out .profile -p no:cacheprovider -q $(PROFILE_ARGS)
	$(BIN)/python tests/suite_profile.py .profile

# The default suite and the slow tier run on TEST_WORKERS worker processes (pytest-xdist), each file's tests on one
# worker (`--dist loadfile`: a module's shared launch stays one launch). Most of a multi-process test's time is
# waiting (interpreters starting, ranks meeting, a process ending), so two workers keep 2 cores busier than one:
# see docs/development.md for the figures. TEST_WORKERS=0 runs the tests in pytest's own process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile
test-suite: $(STAMP)
	$(BIN)/python -m pytest $(XDIST)

test-slow: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "slow and not full_matrix"

# The GPU tier's CPU checks: tests/gpu with MGPU_TIER_DEVICE=cpu, every test function once (its first parameters and
# the ones its module lists in CPU_ALSO), each case forked from one interpreter that imported the worker and run on
# CPU (gloo), so a fault of the tier's own code shows without a GPU (tests/gpu/conftest.py): 28 cases, 3 skipped as
# needing CUDA hardware; docs/gpu.md gives its time. MGPU_TIER_CPU_ALL=1 runs every parameter.
test-gpu-cpu: $(STAMP)
	MGPU_TIER_DEVICE=cpu $(BIN)/python -m pytest tests/gpu -p no:cacheprovider -o addopts="-ra --strict-markers"

test-compat: test-compat-oldest test-compat-cuda test-compat-torch-oldest

# The peer check (not part of `make test`: it needs a clone of Lightning's repository): Lightning's own tests that
# name a DDP or FSDP strategy, at the tag of the installed release, run as released and with the mgpu presets
# swapped in; prints both runs' counts and every test whose outcome differs. LIGHTNING_FILES narrows it to some
# files (paths under tests/tests_pytorch); see docs/development.md.
LIGHTNING_SRC ?=
LIGHTNING_FILES ?=
test-lightning: $(STAMP)
	@test -n "$(LIGHTNING_SRC)" || { echo "make test-lightning LIGHTNING_SRC=/path/to/pytorch-lightning"; exit 2; }
	$(BIN)/python -m pip install -q --no-compile "cloudpickle>=1.3"
	$(BIN)/python tests/lightning_peer/peer_check.py --lightning-src "$(LIGHTNING_SRC)" $(LIGHTNING_FILES)

.venv-oldest/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install -q --no-compile "$(TORCH)" "pytorch-lightning==$(OLDEST_LIGHTNING)" \
		"lightning==$(OLDEST_LIGHTNING)"
	.venv-oldest/bin/python -m pip install -q --no-compile -e ".[test]"
	touch $@

test-compat-oldest: $(STAMP)
	@if $(BIN)/python -c "import importlib.metadata as m, sys; \
		sys.exit(any(m.version(d) != '$(OLDEST_LIGHTNING)' for d in ('lightning', 'pytorch-lightning')))"; then \
		echo "compat tier: skipped, the suite already ran on Lightning $(OLDEST_LIGHTNING), the oldest declared release"; \
	else \
		$(MAKE) .venv-oldest/.installed && \
		.venv-oldest/bin/python -c "import lightning, pytorch_lightning, torch; \
			print('compat tier: lightning', lightning.__version__, 'pytorch_lightning', pytorch_lightning.__version__, 'torch', torch.__version__)" && \
		.venv-oldest/bin/python -m pytest -m "compat and not full_matrix" -p no:cacheprovider; \
	fi

# The two torch tiers' environments hold a torch of several GB (its CUDA libraries), which takes minutes to install on
# 2 cores: each is built once per machine under COMPAT_CACHE, in a folder named by a hash of what it is built from
# (Python, torch, Lightning), and linked from the checkout (.venv-cuda, .venv-torch-oldest); each checkout then installs
# itself (and the test extra, already there after the first time) into it, so a new clone pays seconds, not minutes.
# `make compat-clean` removes the cache.
COMPAT_CACHE ?= $(HOME)/.cache/lightning-mgpu
CUDA_BASE := $(COMPAT_CACHE)/venv-cuda-$(shell cat .ci/requirements-newest.txt | $(NEWEST_PYTHON) -c "import hashlib, sys; \
	print(hashlib.sha1((sys.version + sys.stdin.read()).encode()).hexdigest()[:12])" 2>/dev/null)
TORCH_OLDEST_REQS := "$(OLDEST_TORCH)" "lightning>=2.6.6,<2.7" "pytorch-lightning>=2.6.6,<2.7" "torchmetrics>=1.4" \
	"psutil>=5.9" "typing-extensions>=4.7" "pytest>=8" "pytest-timeout>=2.3"
TORCH_OLDEST_BASE := $(COMPAT_CACHE)/venv-torch-oldest-$(shell echo '$(TORCH_OLDEST_REQS)' | $(OLDEST_TORCH_PYTHON) -c \
	"import hashlib, sys; print(hashlib.sha1((sys.version + sys.stdin.read()).encode()).hexdigest()[:12])" 2>/dev/null)

.venv-cuda.installed: pyproject.toml Makefile .ci/requirements-newest.txt
	test -f $(CUDA_BASE)/.base || { rm -rf $(CUDA_BASE) && $(NEWEST_PYTHON) -m venv $(CUDA_BASE) && \
		$(CUDA_BASE)/bin/python -m pip install -q --no-compile -r .ci/requirements-newest.txt && touch $(CUDA_BASE)/.base; }
	rm -rf .venv-cuda && ln -s $(CUDA_BASE) .venv-cuda
	.venv-cuda/bin/python -m pip install -q --no-compile -e ".[test]"
	touch .venv-cuda.installed

test-compat-cuda: .venv-cuda.installed
	.venv-cuda/bin/python -c "import sys, lightning, torch; \
		print('compat tier: python', sys.version.split()[0], 'lightning', lightning.__version__, 'torch', torch.__version__, 'CUDA build', torch.version.cuda)"
	.venv-cuda/bin/python -m pytest -m "compat and not full_matrix" -p no:cacheprovider --compat-namespace pytorch_lightning

# The required dependencies only (pyproject.toml's `dependencies` less jsonargparse, which only the `lightning-mgpu`
# command needs), one Lightning distribution of each kind, and pytest.
.venv-torch-oldest.installed: pyproject.toml Makefile
	test -f $(TORCH_OLDEST_BASE)/.base || { rm -rf $(TORCH_OLDEST_BASE) && $(OLDEST_TORCH_PYTHON) -m venv $(TORCH_OLDEST_BASE) && \
		$(TORCH_OLDEST_BASE)/bin/python -m pip install -q --no-compile $(TORCH_OLDEST_REQS) && touch $(TORCH_OLDEST_BASE)/.base; }
	rm -rf .venv-torch-oldest && ln -s $(TORCH_OLDEST_BASE) .venv-torch-oldest
	.venv-torch-oldest/bin/python -m pip install -q --no-compile --no-deps -e .
	touch $@

compat-clean:
	rm -rf $(COMPAT_CACHE)/venv-cuda-* $(COMPAT_CACHE)/venv-torch-oldest-* .venv-cuda .venv-torch-oldest \
		.venv-cuda.installed .venv-torch-oldest.installed

# The compatibility subset without what needs the missing packages (the CLI, fairscale) and without tests/meta (checks
# of the sources, the same on every torch; some read docstrings with jsonargparse's parser).
TORCH_OLDEST_SKIP = --ignore=tests/meta --ignore=tests/integration/test_cli.py \
	--ignore=tests/unit/planning/test_planning.py --ignore=tests/unit/planning/test_source.py \
	-k "not fairscale and not print_config"

test-compat-torch-oldest: .venv-torch-oldest.installed
	.venv-torch-oldest/bin/python -c "import sys, lightning, torch; \
		print('compat tier: python', sys.version.split()[0], 'lightning', lightning.__version__, 'torch', torch.__version__)"
	.venv-torch-oldest/bin/python -m pytest -m "compat and not full_matrix" -p no:cacheprovider --compat-namespace lightning $(TORCH_OLDEST_SKIP)

# The pack as users install it (.ci/test-install): the wheel built from this checkout, installed into a fresh
# virtual environment with torch and one Lightning distribution (`lightning-mgpu[pytorch-lightning]`, then
# `lightning-mgpu[lightning]`): the main job and `lightning-mgpu --help`, then a new user's first hour
# (tests/install/first_hour.py: a tutorial-style module of the distribution's namespace as a script, through the
# command's fit and plan with a config, in a notebook, under mgpu_auto); with both distributions installed (the
# `lightning` extra) also `lightning-mgpu plan --config cfg.yaml` and `fit --config cfg.yaml` from a folder holding a
# user's mymodel.py (tests/install/), the first hour running there with `lightning` only.
# The wheel is built once, then both distributions' checks run at the same time (each in a folder of its own; much of
# each is pip unpacking torch), each one's output printed whole when both have finished; the target fails if either
# does: 267 s, against 188 s and 249 s one after the other, measured on 2 cores.
INSTALL_DISTS := pytorch-lightning lightning
test-install: $(STAMP)
	@work=$$(mktemp -d "$${TMPDIR:-/tmp}/lightning-mgpu-wheel.XXXXXX"); trap 'rm -rf "$$work"' EXIT; \
	$(BIN)/python -m pip wheel . --no-deps --no-build-isolation -q -w "$$work" || exit 1; \
	wheel=$$(ls "$$work"/lightning_mgpu-*.whl); \
	for dist in $(INSTALL_DISTS); do \
		{ PYTHON=$(PYTHON) TORCH="$(TORCH)" WHEEL="$$wheel" .ci/test-install $$dist >"$$work/$$dist.log" 2>&1; \
		  echo $$? >"$$work/$$dist.rc"; } & \
	done; wait; \
	failed=; for dist in $(INSTALL_DISTS); do cat "$$work/$$dist.log"; \
		[ "$$(cat "$$work/$$dist.rc")" = 0 ] || failed="$$failed $$dist"; done; \
	[ -z "$$failed" ] || { echo "test-install failed:$$failed"; exit 1; }

# The GPU tier, on a machine with an NVIDIA GPU (CI has none: there tests/gpu is skipped with "no CUDA device").
# `make test-gpu`: tests/gpu (marker `gpu`), every CUDA path and every feature through Trainer.fit on NCCL;
# `make bench-gpu`: memory per rank at world sizes 2/4/8 (torch's fake process group), tokens/s + MFU, the blocking
# time of synchronous and asynchronous checkpoints, the planner's prediction against the CUDA allocator, and the
# step time compiled against eager (benchmarks/bench_compile.py on the GPU), results saved as JSON under
# benchmarks/results/; then hybrid against flat sharding (printed; needs 4 GPUs, else a message). Both use the
# package from this checkout (PYTHONPATH) with an interpreter
# that already has a CUDA torch and Lightning (GPU_PYTHON, default python3, as on GPU images without network access);
# where that interpreter lacks them, .venv-cuda (the newest declared torch's CUDA wheel, .ci/requirements-newest.txt)
# is built and used. Each test case runs in a fresh interpreter (tests/gpu/worker.py), six at a time on the one GPU where pytest-xdist is installed; the tier
# and the benchmarks together are estimated at about 11 minutes on an H100 (docs/gpu.md: each part's estimate).
GPU_PYTHON ?= python3
GPU_PY = $$($(GPU_PYTHON) -c "import torch, pytorch_lightning, lightning" 2>/dev/null && echo $(GPU_PYTHON) || \
	{ $(MAKE) -s .venv-cuda.installed >&2 && echo .venv-cuda/bin/python; })

test-gpu:
	py=$(GPU_PY); PYTHONPATH=$(CURDIR) $$py benchmarks/gpu/env.py && \
	xdist=$$($$py -c "import xdist" 2>/dev/null && echo "-n 6"); \
	PYTHONPATH=$(CURDIR) $$py -m pytest tests/gpu $$xdist -p no:cacheprovider -o timeout=900 -o addopts="-ra --strict-markers"

bench-gpu:
	py=$(GPU_PY); PYTHONPATH=$(CURDIR) $$py benchmarks/gpu/bench_memory_per_rank.py --out benchmarks/results && \
	PYTHONPATH=$(CURDIR) $$py benchmarks/gpu/bench_throughput.py --out benchmarks/results && \
	PYTHONPATH=$(CURDIR) $$py benchmarks/gpu/bench_offload.py --out benchmarks/results && \
	PYTHONPATH=$(CURDIR) $$py benchmarks/gpu/bench_checkpoint_blocking.py --out benchmarks/results && \
	PYTHONPATH=$(CURDIR) $$py benchmarks/gpu/bench_planner_vs_allocator.py --out benchmarks/results && \
	PYTHONPATH=$(CURDIR) $$py benchmarks/bench_hsdp.py --accelerator gpu
	PYTHONPATH=$(CURDIR) $$py benchmarks/bench_compile.py --accelerator gpu --devices 1 --out benchmarks/results

# One command for a GPU machine as it is (its own python3 with a CUDA torch and Lightning, no network): the GPU
# tier, then the benchmarks that matter most (tokens/s and MFU, offload's cost, compile against eager, the planner
# against the allocator, checkpoint blocking, memory per rank), most valuable first, each under its own time budget, 8 minutes
# in all on one H100 (benchmarks/gpu/proof.py says each part's budget); results and logs under benchmarks/results/.
# Where `make gpu-wheels` left wheels in .whl/ (jsonargparse and its needs, fairscale: pure Python, missing there),
# they are installed first into .whl/site, offline.
# GPU_PROOF_OUT: where the proof writes its JSON and logs (a folder the GPU machine sends back, for example)
GPU_PROOF_OUT ?= benchmarks/results
gpu-proof:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl/site .whl/*.whl; fi
	PYTHONPATH=$(CURDIR)$$(test -d .whl/site && echo :$(CURDIR)/.whl/site) $(GPU_PYTHON) benchmarks/gpu/proof.py --out $(GPU_PROOF_OUT)

# Run where pip reaches PyPI, before taking the checkout to a GPU machine without network: the pure-Python packages
# that machine lacks, as wheels for its Python (3.12, x86-64 Linux) in .whl/ (ignored by git): jsonargparse with its
# `signatures` extra and what it needs, torchao (the 4-bit base's NF4; its kernels are not needed for NF4), and
# fairscale (published as a source archive only: built into a wheel here).
GPU_WHEEL_PYTHON ?= 3.12
gpu-wheels:
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_WHEEL_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl "jsonargparse[signatures]>=4.27"
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0
	$(PYTHON) -m pip wheel -q --no-deps -w .whl fairscale==0.4.13
	@ls .whl/*.whl

# Re-run every notebook and store its outputs (tests/meta/test_notebooks.py fails on outputs older than the cells).
notebooks: $(STAMP)
	$(BIN)/python notebooks/execute.py --write notebooks/*.ipynb

# The documentation site (docs/, Sphinx + MyST), warnings as errors: a public name without a docstring, a broken
# link between pages or a docstring that is not valid reStructuredText fails it. Output: docs/_build/html.
# NITPICKY=1 also lists unresolved cross-references (sphinx-build -n).
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q --no-compile -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/sphinx-build -W --keep-going -q $(if $(NITPICKY),-n) -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_ddp.py

# The linters, at the versions pinned in pyproject.toml's `test` extra: ruff's lint rules and its formatting (Python
# files, notebooks' lint, and the code blocks of the Markdown pages), and mypy on the package.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy lightning_mgpu
