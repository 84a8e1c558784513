# The two commands that do all set-up on a fresh Debian 12 machine:
#   make demo   installs what is missing (Debian's packages, and the Python environment .venv
#               from PyPI), builds (release) and runs the main job: the quick NVMe
#               sweep on a scratch folder under the build directory, then single-device
#               fine-tuning of a GPT-style model with strata (its aio block from the sweep),
#               beside plain PyTorch
#   make test   installs what is missing, builds (release) and runs the test suite
# and: make bench (the benchmarks, with their ceilings), make asan, make tsan.
SCRATCH ?= build/release/scratch
DEMO_ARGS ?=
FINETUNE_ARGS ?=
VENV ?= $(CURDIR)/.venv
PYTHON ?= $(VENV)/bin/python
BENCH_ARGS ?= --reserve-hugetlb

.PHONY: deps venv demo bench test asan tsan build clean

deps:
	@bash scripts/install-deps.sh

# The Python environment (torch, transformers, pytest, ... pinned in python/requirements.txt).
venv: deps
	@STRATA_VENV=$(VENV) bash scripts/python-env.sh

build: venv
	cmake --preset release -DSTRATA_PYTHON=$(PYTHON)
	cmake --build --preset release

demo: build
	mkdir -p $(SCRATCH)
	./build/release/tools/aio_bench/aio_bench_perf_sweep --nvme_dir $(SCRATCH) --quick $(DEMO_ARGS)
	PYTHONPATH=build/release/python $(PYTHON) examples/finetune.py --work $(SCRATCH)/finetune \
	    --aio-block $(SCRATCH)/strata-sweep/best.json $(FINETUNE_ARGS)

bench: build
	mkdir -p $(SCRATCH)
	./build/release/bench/aio_vs_fio --dir $(SCRATCH) --json build/release/aio_vs_fio.json $(BENCH_ARGS)
	./build/release/bench/sweep_vs_fio --dir $(SCRATCH) --json build/release/sweep_vs_fio.json $(BENCH_ARGS)
	./build/release/bench/cpu_adam --json build/release/cpu_adam.json --torch_python $(PYTHON)
	./build/release/bench/optimizer_swap --dir $(SCRATCH) --json build/release/optimizer_swap.json $(BENCH_ARGS)
	./build/release/bench/nvme_store --dir $(SCRATCH) --json build/release/nvme_store.json
	./build/release/bench/sched_step --dir $(SCRATCH) --json build/release/sched_step.json
	PYTHONPATH=build/release/python $(PYTHON) bench/train_step.py --dir $(SCRATCH) --json build/release/train_step.json
	@STRATA_VENV=$(VENV) bash scripts/python-env.sh --deepspeed
	PYTHONPATH=build/release/python $(PYTHON) bench/vs_deepspeed.py --dir $(SCRATCH) \
	    --json build/release/vs_deepspeed.json --png build/release/vs_deepspeed.png
	PYTHONPATH=build/release/python $(PYTHON) bench/checkpoint.py --dir $(SCRATCH) --json build/release/checkpoint.json
	PYTHONPATH=build/release/python $(PYTHON) bench/train_ranks.py --json build/release/train_ranks.json
	PYTHONPATH=build/release/python $(PYTHON) bench/plan_vs_ranks.py --json build/release/plan_vs_ranks.json
	PYTHONPATH=build/release/python $(PYTHON) bench/bigger_than_ram.py --dir $(SCRATCH)/bigger_than_ram \
	    --plan build/release/tools/strata_plan/strata_plan --deepspeed --json build/release/bigger_than_ram.json

test: build
	ctest --preset release

asan: deps
	cmake --preset asan
	cmake --build --preset asan
	ctest --preset asan

tsan: deps
	cmake --preset tsan
	cmake --build --preset tsan
	ctest --preset tsan

clean:
	rm -rf build
