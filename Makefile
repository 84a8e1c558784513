# The two commands that do all set-up on a fresh Debian 12 machine:
#   make demo   installs what is missing, builds (release) and runs the main job
#   make test   installs what is missing, builds (release) and runs the test suite
# and, for sanitizers: make asan, make tsan.
DEMO_ARGS ?= --reserve_hugetlb

.PHONY: deps demo test asan tsan build clean

deps:
	@bash scripts/install-deps.sh

build: deps
	cmake --preset release
	cmake --build --preset release

demo: build
	mkdir -p build/release/scratch
	./build/release/bench/aio_vs_fio --dir build/release/scratch --json build/release/aio_vs_fio.json $(DEMO_ARGS)

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
