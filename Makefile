# kvxfer — the two commands of the quick start:
#   make bench   builds everything and runs ./cpp_examples/bench with its defaults
#   make test    runs every test: Rust unit + integration, the C ABI tests, header checks
SHELL := /bin/bash
CARGO ?= cargo
CC ?= gcc
CXX ?= g++
LIB := target/release/libkvxfer.so
CBUILD := tests/c/build
TEST_DIR ?= $(CURDIR)/target/test-files
export KVX_TEST_DIR := $(TEST_DIR)

.PHONY: all build bench test rust-test c-test valgrind-test header-test exports-test bench-smoke header tools clean

all: build

# Tools the build needs beyond cargo. As root we install what is missing; otherwise we
# stop with the exact command to run.
tools:
	@missing=""; \
	for t in $(CC):gcc $(CXX):g++ nm:binutils make:make valgrind:valgrind; do \
	  command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t##*:}"; \
	done; \
	command -v $(CARGO) >/dev/null 2>&1 || { echo "cargo not found: install Rust from https://rustup.rs"; exit 1; }; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $$missing; \
	  else echo "missing:$$missing — run: sudo apt-get install -y$$missing"; exit 1; fi; \
	fi

build: tools
	$(CARGO) build --release
	ln -sf libkvxfer.so target/release/libkvxfer.so.1
	$(MAKE) -C cpp_examples

bench: build
	./cpp_examples/bench

# Rewrites include/kvxfer.h from src/ffi (commit the result).
header:
	KVX_WRITE_HEADER=1 $(CARGO) build --release

test: build rust-test c-test valgrind-test header-test exports-test bench-smoke
	@echo "make test: all passed"

rust-test: $(TEST_DIR)
	$(CARGO) test --release

$(TEST_DIR):
	mkdir -p $@

$(CBUILD):
	mkdir -p $@

# The C program against the header and the cdylib, strict warnings.
c-test: build $(CBUILD) $(TEST_DIR)
	$(CC) -std=c11 -Wall -Wextra -Werror -g -Iinclude tests/c/test_abi.c -o $(CBUILD)/test_abi \
	  -Ltarget/release -Wl,-rpath,$(CURDIR)/target/release -lkvxfer
	$(CBUILD)/test_abi

# The same C program under memcheck: no errors, nothing definitely lost.
valgrind-test: c-test
	valgrind -q --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite --error-exitcode=3 $(CBUILD)/test_abi

# The header alone, included twice, as C11 and as C++17, pedantic.
header-test: $(CBUILD)
	$(CC) -std=c11 -Wall -Wextra -Wpedantic -Werror -Iinclude -c tests/c/header_alone.c -o $(CBUILD)/header_c.o
	$(CXX) -std=c++17 -Wall -Wextra -Wpedantic -Werror -Iinclude -c tests/c/header_alone.cpp -o $(CBUILD)/header_cpp.o

# Only kvx_ symbols leave the shared library.
exports-test: build
	@bad=$$(nm -D --defined-only $(LIB) | awk '{print $$3}' | grep -v '^kvx_' || true); \
	if [ -n "$$bad" ]; then echo "exported symbols without the kvx_ prefix:"; echo "$$bad"; exit 1; fi; \
	echo "exports-test: $$(nm -D --defined-only $(LIB) | wc -l) symbols, all kvx_"

# The benchmark runs and its byte check passes (small, not timed).
bench-smoke: build $(TEST_DIR)
	./cpp_examples/bench --num-blocks 4 --blocks-per-batch 2 --iterations 1 --warmup 0 --num-layers 4 --dir $(TEST_DIR)

clean:
	$(CARGO) clean
	$(MAKE) -C cpp_examples clean
	rm -rf $(CBUILD)
