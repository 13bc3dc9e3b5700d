# memtrain - build, test, demo, bench, install.
#
#   make demo    installs missing Debian packages (as root), builds, trains a small model
#   make test    installs missing Debian packages (as root), builds, runs the test suite
#   make test-isa  the CPU tests again with the kernels capped at AVX2 and at the baseline
#   make test-arm64  aarch64: cross-built, the CPU tests under qemu-user
#
# Variables: CC (gcc or clang), PREFIX (install), SAN=1 (AddressSanitizer +
# UndefinedBehaviorSanitizer build in build-san/), NVCC (path to nvcc; empty
# disables the CUDA kernels), CUDA_ARCHS.

PREFIX ?= /usr/local
SAN ?=
ifeq ($(SAN),1)
BUILD ?= build-san
else
BUILD ?= build
endif

CFLAGS ?= -O2 -g
CPPFLAGS += -Iinclude -Ilib -D_GNU_SOURCE
WARN := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wno-unused-parameter
MT_CFLAGS := -std=c11 $(WARN) -fopenmp -pthread -fno-strict-aliasing -fno-math-errno
LDLIBS := -ljemalloc -ldnnl -ldl -lm -lpthread
MT_LDFLAGS := -fopenmp -pthread
# A cross build (CC for another architecture, e.g. aarch64-linux-gnu-gcc,
# as `make test-arm64` does): Debian's -dev packages of jemalloc and oneDNN
# do not install beside the host's, so the target's runtime libraries are
# linked by name, with the host's headers (the same text); nvcc and mpicc
# build for the host, so the CUDA kernels and the MPI archive are left out;
# build-time helpers (bin2c) are built with HOSTCC.
HOSTCC ?= cc
ifneq ($(shell $(CC) -dumpmachine 2>/dev/null),$(shell $(HOSTCC) -dumpmachine 2>/dev/null))
CROSS := 1
LDLIBS := -l:libjemalloc.so.2 -l:libdnnl.so.2 -ldl -lm -lpthread
NVCC :=
MPICC :=
endif
ifeq ($(SAN),1)
SAN_FLAGS := -fsanitize=address,undefined
MT_CFLAGS += $(SAN_FLAGS) -fno-omit-frame-pointer -fno-sanitize-recover=undefined
MT_LDFLAGS += $(SAN_FLAGS)
endif

# Debian packages the build needs, and those the tests need besides
# (rsvg-convert renders the memory plots the tests write).
DEB_PKGS := libjemalloc-dev libdnnl-dev pkg-config libopenmpi-dev openmpi-bin
TEST_DEB_PKGS := librsvg2-bin

# CUDA kernels: built whenever nvcc is found; nothing needs a GPU to build.
NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_ARCHS ?= 80 90
CUDA_SRC := $(wildcard kernels/cuda/*.cu kernels/cuda/*.cuh)

LIB_SRC := $(wildcard lib/*.c lib/*/*.c allocators/*.c kernels/cpu/*.c kernels/cuda/*.c)
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
ifneq ($(strip $(NVCC)),)
ifneq ($(strip $(CUDA_SRC)),)
LIB_OBJ += $(BUILD)/obj/cuda_kernels_blob.o
CPPFLAGS_CUDA := -DMT_HAVE_CUDA_KERNELS=1
endif
endif

LIB := $(BUILD)/libmemtrain.a
TOOL := $(BUILD)/memtrain
TEST_SRC := $(wildcard test/*.c)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/obj/%.o) $(BUILD)/obj/examples/custom_allocator_lib.o
TEST_BIN := $(BUILD)/mt_tests
FAKE_CUDA := $(BUILD)/libfakecuda.so
FAKE_CUBLASLT := $(BUILD)/libfakecublaslt.so
FAKE_NCCL := $(BUILD)/libfakenccl.so
FAKE_ENV = MT_FAKE_CUDA=$(FAKE_CUDA) MT_FAKE_CUBLASLT=$(FAKE_CUBLASLT) MT_FAKE_NCCL=$(FAKE_NCCL)
# The MPI communicator: its own archive, built whenever mpicc is found
MPICC ?= $(shell command -v mpicc 2>/dev/null)
LIB_MPI := $(BUILD)/libmemtrain_mpi.a
ifneq ($(strip $(MPICC)),)
MPI_TARGETS := $(LIB_MPI) $(BUILD)/mpi/comm_mpi_test $(BUILD)/mpi/train_mpi_test \
	$(BUILD)/mpi/libmtfault.so
endif
EXAMPLES := $(BUILD)/examples/embed $(BUILD)/examples/custom_allocator $(BUILD)/examples/plan_memory
BENCH_SRC := $(wildcard bench/bench_*.c)
BENCH_BIN := $(BENCH_SRC:bench/%.c=$(BUILD)/bench/%)

.PHONY: bench-tp bench-pp bench-sparse fuzz test-deps all lib test test-isa test-arm64 test-long test-gpu gpu-bundle gpu-bundle-dir demo bench bench-gpt2 bench-offload bench-offload-io bench-dp install uninstall clean deps valgrind check-tests
.DEFAULT_GOAL := all
.SECONDARY: # keep intermediate objects (examples, benchmarks) between runs

all: $(LIB) $(TOOL) $(TEST_BIN) $(FAKE_CUDA) $(FAKE_CUBLASLT) $(FAKE_NCCL) $(EXAMPLES) $(BENCH_BIN) $(MPI_TARGETS)

lib: $(LIB) $(MPI_TARGETS)

# ---- dependencies ----
# Installs the missing packages of $(1) when run as root; otherwise names them.
define install_missing
	@missing=""; \
	for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  echo "installing:$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing) || exit 1; \
	else \
	  echo "memtrain needs Debian packages that are missing:$$missing"; \
	  echo "install them with:  sudo apt-get install -y$$missing"; exit 1; \
	fi
endef

deps:
	$(call install_missing,$(DEB_PKGS))

test-deps: deps
	$(call install_missing,$(TEST_DEB_PKGS))

# ---- the library ----
$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CPPFLAGS_CUDA) $(CFLAGS) $(MT_CFLAGS) -MMD -MP -c $< -o $@

$(LIB): $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# the MPI communicator, compiled by mpicc, in libmemtrain_mpi.a
$(BUILD)/obj-mpi/%.o: lib/comm/mpi/%.c
	@mkdir -p $(dir $@)
	$(MPICC) $(CPPFLAGS) $(CFLAGS) $(MT_CFLAGS) -MMD -MP -c $< -o $@
$(LIB_MPI): $(BUILD)/obj-mpi/comm_mpi.o
	@rm -f $@
	ar rcs $@ $^

# CUDA kernels: nvcc -> fatbin (cubin per arch + PTX of the newest) -> C array in the library.
NVCC_GENCODE := $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
	-gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS))
$(BUILD)/cuda/kernels.fatbin: $(CUDA_SRC)
	@mkdir -p $(dir $@)
	$(NVCC) -fatbin -O3 -std=c++17 $(NVCC_GENCODE) -Ikernels/cuda -o $@ kernels/cuda/kernels.cu
$(BUILD)/bin2c: tools/bin2c.c
	@mkdir -p $(dir $@)
	$(HOSTCC) -O2 -std=c11 $(WARN) -o $@ $<
$(BUILD)/cuda/cuda_kernels_blob.c: $(BUILD)/cuda/kernels.fatbin $(BUILD)/bin2c
	$(BUILD)/bin2c mti_cuda_fatbin $< > $@
$(BUILD)/obj/cuda_kernels_blob.o: $(BUILD)/cuda/cuda_kernels_blob.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(MT_CFLAGS) -c $< -o $@

# ---- fuzzing ----
# Targets (test/fuzz/fuzz_*.c) for the config parser, the token-file loader,
# the trace loader and the checkpoint loader. `make fuzz` runs each under
# libFuzzer (clang, ASan + UBSan) for FUZZ_SECONDS, from the seeds in
# test/fuzz/<target>/; what it finds goes to build-fuzz/crashes/<target>/.
# `make test` runs every kept input through each target (the regressions).
FUZZ_TARGETS := config tokens trace checkpoint
FUZZ_SECONDS ?= 60
FUZZ_BUILD := build-fuzz
FUZZ_REGRESS := $(FUZZ_TARGETS:%=$(BUILD)/fuzz/%)
# the config parser reads which options are flags from the command's option table
CFG_OBJ = $(BUILD)/obj/tools/config.o $(BUILD)/obj/tools/cli_options.o
$(BUILD)/fuzz/%: test/fuzz/fuzz_%.c test/fuzz/driver.c $(CFG_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(MT_CFLAGS) -o $@ test/fuzz/fuzz_$*.c test/fuzz/driver.c \
	  $(CFG_OBJ) $(LIB) $(MT_LDFLAGS) $(LDLIBS)

fuzz: deps
	@command -v clang >/dev/null || { echo "fuzz: needs clang (libFuzzer)"; exit 1; }
	@$(MAKE) --no-print-directory SAN=1 BUILD=$(FUZZ_BUILD) CC=clang \
	  SAN_FLAGS="-fsanitize=address,undefined,fuzzer-no-link" \
	  $(FUZZ_BUILD)/libmemtrain.a $(FUZZ_BUILD)/obj/tools/config.o $(FUZZ_BUILD)/obj/tools/cli_options.o
	@for t in $(FUZZ_TARGETS); do \
	  clang $(CPPFLAGS) -O1 -g -fsanitize=fuzzer,address,undefined -fopenmp -pthread \
	    -o $(FUZZ_BUILD)/fuzz-$$t test/fuzz/fuzz_$$t.c $(FUZZ_BUILD)/obj/tools/config.o $(FUZZ_BUILD)/obj/tools/cli_options.o \
	    $(FUZZ_BUILD)/libmemtrain.a $(LDLIBS) || exit 1; \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t $(FUZZ_BUILD)/crashes/$$t; \
	  echo "== fuzz $$t for $(FUZZ_SECONDS) s"; \
	  $(FUZZ_BUILD)/fuzz-$$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_BUILD)/crashes/$$t/ $(FUZZ_BUILD)/corpus/$$t test/fuzz/$$t || exit 1; \
	done

# ---- the tool, examples, tests, benchmarks ----
# the built-in corpus of `memtrain train --model gpt`: the project's own text
# (not the dated benchmark log, which would double it)
CORPUS_SRC := README.md $(sort $(filter-out docs/benchmarks-history.md,$(wildcard docs/*.md)))
$(BUILD)/corpus/corpus.txt: $(CORPUS_SRC)
	@mkdir -p $(dir $@)
	cat $(CORPUS_SRC) > $@
$(BUILD)/corpus/corpus_blob.c: $(BUILD)/corpus/corpus.txt $(BUILD)/bin2c
	$(BUILD)/bin2c mt_corpus $< > $@
$(BUILD)/obj/corpus_blob.o: $(BUILD)/corpus/corpus_blob.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(MT_CFLAGS) -c $< -o $@

TOOL_SRC := $(filter-out tools/bin2c.c,$(wildcard tools/*.c))
# the tool's objects with cli_ranks.c built without MPI (it then refuses a
# job of several ranks), for copies that must not need libmpi (the GPU bundle)
TOOL_OBJ_NOMPI := $(filter-out $(BUILD)/obj/tools/cli_ranks.o,$(TOOL_SRC:%.c=$(BUILD)/obj/%.o)) \
	$(BUILD)/obj-nompi/tools/cli_ranks.o
$(BUILD)/obj-nompi/tools/cli_ranks.o: tools/cli_ranks.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(MT_CFLAGS) -MMD -MP -c $< -o $@
# with mpicc, train runs data parallel under mpirun (tools/cli_ranks.c)
ifneq ($(strip $(MPICC)),)
$(BUILD)/obj/tools/cli_ranks.o: tools/cli_ranks.c
	@mkdir -p $(dir $@)
	$(MPICC) $(CPPFLAGS) $(CFLAGS) $(MT_CFLAGS) -DMT_CLI_MPI -MMD -MP -c $< -o $@
$(TOOL): $(TOOL_SRC:%.c=$(BUILD)/obj/%.o) $(BUILD)/obj/corpus_blob.o $(LIB_MPI) $(LIB)
	$(MPICC) $(MT_LDFLAGS) -o $@ $^ $(LDLIBS)
else
$(TOOL): $(TOOL_SRC:%.c=$(BUILD)/obj/%.o) $(BUILD)/obj/corpus_blob.o $(LIB)
	$(CC) $(MT_LDFLAGS) -o $@ $^ $(LDLIBS)
endif

$(BUILD)/examples/%: $(BUILD)/obj/examples/%.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(MT_LDFLAGS) -o $@ $^ $(LDLIBS)

# the example allocator, without its main, for the conformance suite
$(BUILD)/obj/examples/custom_allocator_lib.o: examples/custom_allocator.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(MT_CFLAGS) -DMT_EXAMPLE_NO_MAIN -MMD -MP -c $< -o $@

$(TEST_BIN): $(TEST_OBJ) $(LIB)
	$(CC) $(MT_LDFLAGS) -o $@ $^ $(LDLIBS)

# a stand-in CUDA driver over host memory, so the CUDA device layer runs in tests
$(FAKE_CUDA): test/fake_cuda/fake_libcuda.c lib/device/cuda_driver.h kernels/cuda/dequant.cuh kernels/cuda/scalar.cuh
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -std=c11 $(WARN) -fPIC -shared -o $@ $< -ldl

# and a stand-in cuBLASLt for it, so the CUDA op table's GEMMs run there too
$(FAKE_CUBLASLT): test/fake_cuda/fake_cublaslt.c lib/device/cublaslt_api.h
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -std=c11 $(WARN) -Ilib -fPIC -shared -o $@ $<

# a stand-in libnccl (threads as ranks), so the NCCL communicator runs in tests
$(FAKE_NCCL): test/fake_nccl/fake_libnccl.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -std=c11 $(WARN) -D_GNU_SOURCE -fPIC -shared -pthread -o $@ $<

# the MPI tests' programs (test/mpi_test.sh runs them under mpirun), and a
# rank's faults the command meets (preloaded: a stall, a failing disk)
$(BUILD)/mpi/libmtfault.so: test/mpi/fault_shim.c
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) $(WARN) -fPIC -shared -o $@ $< -ldl
$(BUILD)/mpi/%: test/mpi/%.c $(LIB_MPI) $(LIB)
	@mkdir -p $(dir $@)
	$(MPICC) $(CPPFLAGS) $(CFLAGS) $(MT_CFLAGS) -o $@ $< $(LIB_MPI) $(LIB) $(MT_LDFLAGS) $(LDLIBS)

$(BUILD)/bench/%: $(BUILD)/obj/bench/%.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(MT_LDFLAGS) -o $@ $^ $(LDLIBS)
# the offload I/O benchmark measures io_uring too where liburing is installed
# (Debian: liburing-dev; the library itself never needs it)
URING_LIBS := $(if $(CROSS),,$(shell pkg-config --libs liburing 2>/dev/null))
$(BUILD)/obj/bench/bench_offload_io.o: MT_CFLAGS += $(if $(URING_LIBS),,-DMT_NO_URING)
$(BUILD)/bench/bench_offload_io: LDLIBS += $(URING_LIBS)

# ---- the README's two commands ----
test: test-deps
	@$(MAKE) --no-print-directory check-tests

check-tests: $(TEST_BIN) $(FAKE_CUDA) $(FAKE_CUBLASLT) $(FAKE_NCCL) $(EXAMPLES) $(TOOL) $(FUZZ_REGRESS) $(MPI_TARGETS) \
	gpu-bundle-dir
	$(FAKE_ENV) $(TEST_BIN)
	$(FAKE_ENV) MT_TEST_GPU=standin $(TEST_BIN) gpu_engine_
	@for t in $(FUZZ_TARGETS); do printf "fuzz regressions, %s: " $$t; \
	  $(BUILD)/fuzz/$$t test/fuzz/$$t/* || exit 1; done
	$(BUILD)/examples/embed > /dev/null
	$(BUILD)/examples/custom_allocator > /dev/null
	$(BUILD)/examples/plan_memory > /dev/null
	./test/tool_test.sh $(TOOL)
	./test/mpi_test.sh $(BUILD)
	./test/api_doc_test.sh
	./test/linkgraph.py $(BUILD) $(LIB_OBJ)
	BUILD=$(BUILD) SAN_FLAGS="$(SAN_FLAGS)" ./test/install_test.sh
	$(GPU_BUNDLE)/memtrain-gpu/run.sh --stand-in $(BUILD)/gpu-standin-results
	./test/gpu_bundle_test.sh $(GPU_BUNDLE)/memtrain-gpu

# The CPU op, engine, quantized-base, optimizer and estimate tests again
# with the CPU kernels capped at each class of ISA_CAPS (MT_CPU_ISA; oneDNN
# capped with them), so a machine with AVX-512 proves the AVX2 and baseline
# paths too; and the standard QLoRA run of the command at each cap.
ISA_CAPS ?= avx2 baseline
ISA_TESTS := test_ops.c test_engine.c test_qbase.c test_quant.c test_estimate.c test_isa.c \
	test_optim.c test_optim4.c test_golden.c test_sparse.c test_sparse_mm.c
test-isa: test-deps
	@$(MAKE) --no-print-directory $(TEST_BIN) $(TOOL) $(FAKE_CUDA) $(FAKE_CUBLASLT) $(FAKE_NCCL)
	@for c in $(ISA_CAPS); do echo "== MT_CPU_ISA=$$c"; \
	  $(FAKE_ENV) MT_CPU_ISA=$$c $(TEST_BIN) $(ISA_TESTS) || exit 1; \
	  MT_CPU_ISA=$$c $(TOOL) train --model gpt --layers 2 --lora 8 --base nf4 --precision bf16 \
	    --steps 4 --every 2 || exit 1; \
	done

# aarch64: the library, the tests and the stand-ins cross-built with
# Debian's aarch64 compiler against the arm64 runtime packages (multiarch),
# then the op, engine, quantized-base, estimate and golden tests run under
# qemu-user (8.5 minutes on a 2-core EPYC; docs/kernels.md). qemu finds
# the arm64 libraries through the host's loader cache (libc6:arm64): no -L,
# which would mix two builds of glibc. One test is left out: the long
# training of every optimizer and precision (17 minutes under qemu alone),
# which the engine tests above cover piece by piece.
ARM64_CC ?= aarch64-linux-gnu-gcc
ARM64_BUILD ?= build-arm64
ARM64_PKGS := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user libc6:arm64 \
	libgomp1:arm64 libjemalloc2:arm64 libdnnl2:arm64
ARM64_TESTS := test_ops.c test_engine.c test_qbase.c test_quant.c test_estimate.c test_isa.c \
	test_golden.c test_sparse.c test_sparse_mm.c -every_optimizer_and_precision_learns_text
test-arm64: deps
	@if ! dpkg --print-foreign-architectures | grep -qx arm64; then \
	  if [ "$$(id -u)" = 0 ]; then dpkg --add-architecture arm64 && apt-get update -qq || exit 1; \
	  else echo "test-arm64 needs the arm64 architecture: sudo dpkg --add-architecture arm64"; exit 1; fi; \
	fi
	$(call install_missing,$(ARM64_PKGS))
	@$(MAKE) --no-print-directory BUILD=$(ARM64_BUILD) CC=$(ARM64_CC) \
	  $(ARM64_BUILD)/mt_tests $(ARM64_BUILD)/libfakecuda.so $(ARM64_BUILD)/libfakecublaslt.so \
	  $(ARM64_BUILD)/libfakenccl.so
	MT_FAKE_CUDA=$(ARM64_BUILD)/libfakecuda.so MT_FAKE_CUBLASLT=$(ARM64_BUILD)/libfakecublaslt.so \
	  MT_FAKE_NCCL=$(ARM64_BUILD)/libfakenccl.so qemu-aarch64 $(ARM64_BUILD)/mt_tests $(ARM64_TESTS)

# the long randomized stress (10^6 operations per allocator and seed)
test-long: deps
	@$(MAKE) --no-print-directory $(TEST_BIN) $(FAKE_CUDA)
	MT_FAKE_CUDA=$(FAKE_CUDA) MT_TEST_LONG=1 $(TEST_BIN) stress

# the op conformance suite against the CUDA table, the engine against the
# CPU, and the estimates and budgets against CUDA runs and the driver, on a
# real GPU (needs nvcc at build time and an NVIDIA driver at run time; the
# stand-in driver cannot run kernels)
test-gpu: deps
	@test -n "$(strip $(NVCC))" || { echo "test-gpu: nvcc not found, so no CUDA kernels to test (set NVCC)"; exit 1; }
	@$(MAKE) --no-print-directory $(TEST_BIN) $(BUILD)/bench/bench_memory
	MT_TEST_GPU=1 $(TEST_BIN) ops gpu_engine _cuda
	$(BUILD)/bench/bench_memory --sections d

# ---- the offline GPU bundle ----
# A folder and a tarball (at most 48 MiB) to carry to a GPU machine with no
# network: the test suite, the benchmarks and the tool, linked with an
# $$ORIGIN rpath to the shared libraries they need (gpu/bundle.sh), and
# gpu/run.sh, which runs the GPU validation groups there in one command
# (docs/gpu-validation.md). `make test` builds the folder and runs it over
# the stand-ins (run.sh --stand-in), so the bundle is checked everywhere.
GPU_BUNDLE := $(BUILD)/gpu-bundle
GPU_BIN := $(BUILD)/gpu/bin
GPU_PROGS := $(GPU_BIN)/mt_tests $(GPU_BIN)/bench_memory $(GPU_BIN)/bench_gpt2 \
	$(GPU_BIN)/bench_cuda $(GPU_BIN)/memtrain
BUNDLE_RPATH := -Wl,--disable-new-dtags,-rpath,'$$ORIGIN/../lib'
$(GPU_BIN)/mt_tests: $(TEST_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(MT_LDFLAGS) $(BUNDLE_RPATH) -o $@ $^ $(LDLIBS)
$(GPU_BIN)/bench_cuda: $(BUILD)/obj/gpu/bench_cuda.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(MT_LDFLAGS) $(BUNDLE_RPATH) -o $@ $^ $(LDLIBS)
$(GPU_BIN)/bench_%: $(BUILD)/obj/bench/bench_%.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(MT_LDFLAGS) $(BUNDLE_RPATH) -o $@ $^ $(LDLIBS)
$(GPU_BIN)/memtrain: $(TOOL_OBJ_NOMPI) $(BUILD)/obj/corpus_blob.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(MT_LDFLAGS) $(BUNDLE_RPATH) -o $@ $^ $(LDLIBS)

# the bundle's stack sampler for machines without gdb: static, libc only,
# no sanitizers (it runs before the bundle's libraries are found)
GPU_STACKS := $(GPU_BIN)/mt_stacks
$(GPU_STACKS): gpu/stacks.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -O2 -Wall -Wextra -D_GNU_SOURCE -static -o $@ $<

gpu-bundle-dir: $(GPU_PROGS) $(GPU_STACKS) $(FAKE_CUDA) $(FAKE_CUBLASLT) $(FAKE_NCCL)
	STACKS=$(GPU_STACKS) BUNDLE_TAR=0 NVCC="$(NVCC)" ./gpu/bundle.sh $(GPU_BUNDLE) $(GPU_PROGS) -- $(FAKE_CUDA) $(FAKE_CUBLASLT) $(FAKE_NCCL)

gpu-bundle: deps
	@test -n "$(strip $(NVCC))" || { echo "gpu-bundle: nvcc not found, so no CUDA kernels to carry (set NVCC)"; exit 1; }
	@$(MAKE) --no-print-directory $(GPU_PROGS) $(GPU_STACKS) $(FAKE_CUDA) $(FAKE_CUBLASLT) $(FAKE_NCCL)
	STACKS=$(GPU_STACKS) NVCC="$(NVCC)" ./gpu/bundle.sh $(GPU_BUNDLE) $(GPU_PROGS) -- $(FAKE_CUDA) $(FAKE_CUBLASLT) $(FAKE_NCCL)

valgrind: deps
	@$(MAKE) --no-print-directory $(TEST_BIN) $(FAKE_CUDA) $(FAKE_CUBLASLT) $(EXAMPLES)
	$(FAKE_ENV) MT_TEST_LIGHT=1 valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite \
	  --suppressions=test/valgrind.supp $(TEST_BIN)
	valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite \
	  --suppressions=test/valgrind.supp $(BUILD)/examples/embed > /dev/null

demo: deps
	@$(MAKE) --no-print-directory $(TOOL)
	$(TOOL) train --model gpt --layers 4 --steps 600 --every 100 --report

# bench_gpt2 is left to bench-gpt2: it takes minutes and compares with PyTorch;
# bench_offload to bench-offload (GPT-2 124M twice, and a GiB through the disk),
# bench_offload_io to bench-offload-io (a disk's worth of pieces)
bench: deps
	@$(MAKE) --no-print-directory $(BENCH_BIN)
	@for b in $(filter-out %/bench_gpt2 %/bench_offload %/bench_offload_io,$(BENCH_BIN)); do echo "== $$b"; $$b || exit 1; done

# disk offload of the optimizer state against the resident run, GPT-2 124M fp32
# AdamW (fused step): peak RSS, step time, the disk's O_DIRECT bandwidth.
# OFFLOAD_DIR is where the scratch files go (a directory on the disk to measure).
OFFLOAD_DIR ?= /tmp
bench-offload: deps
	@$(MAKE) --no-print-directory $(BUILD)/bench/bench_offload
	$(BUILD)/bench/bench_offload --dir $(OFFLOAD_DIR) $(OFFLOAD_ARGS)

# the disk offload's I/O: a thread pool's pread/pwrite against io_uring (where
# liburing is installed), O_DIRECT, at offload's piece sizes and depths
bench-offload-io: deps
	@$(MAKE) --no-print-directory $(BUILD)/bench/bench_offload_io
	$(BUILD)/bench/bench_offload_io --dir $(OFFLOAD_DIR) $(OFFLOAD_IO_ARGS)

# GPT-2 training against PyTorch on the CPU (about 15 minutes at the 124M shape;
# GPT2_ARGS=--quick for a small model, GPT2_ARGS=--long for the 200-step loss
# comparison). PyTorch comes from the virtualenv named by MT_TORCH_VENV.
bench-gpt2: deps
	@$(MAKE) --no-print-directory $(BUILD)/bench/bench_gpt2
	BUILD=$(BUILD) ./bench/gpt2_side_by_side.sh $(GPT2_ARGS)

# data parallel on this machine: 1 rank x 2 threads against 2 ranks x 1
# thread, with and without the communication thread (docs/benchmarks.md)
bench-dp: deps
	@$(MAKE) --no-print-directory $(TOOL)
	BUILD=$(BUILD) ./bench/dp_overlap.sh

# tensor parallel on this machine: 1 rank x 2 threads against one tensor
# group of 2 ranks x 1 thread, with and without sequence parallel
bench-tp: deps
	@$(MAKE) --no-print-directory $(TOOL)
	BUILD=$(BUILD) TP=1 ./bench/dp_overlap.sh $(TP_ARGS)

bench-pp: deps
	@$(MAKE) --no-print-directory $(TOOL)
	BUILD=$(BUILD) PP=1 ./bench/dp_overlap.sh $(PP_ARGS)

# pruning's quality on GPT-2 124M (byte vocabulary) over the built-in corpus:
# trained dense, pruned 50% by magnitude, Wanda and 2:4, trained on (about 35
# minutes on two cores; SPARSE_ARGS="--dense-steps N --sparse-steps N"). The
# bytes per class and the step times are bench_sparse's part of `make bench`.
bench-sparse: deps
	@$(MAKE) --no-print-directory $(BUILD)/bench/bench_sparse $(BUILD)/corpus/corpus.txt
	$(BUILD)/bench/bench_sparse --quality --data $(BUILD)/corpus/corpus.txt $(SPARSE_ARGS)

# ---- install ----
install: $(LIB) $(TOOL) $(MPI_TARGETS)
	install -d $(DESTDIR)$(PREFIX)/include/memtrain $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin
	install -m 644 include/memtrain.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 include/memtrain/allocator.h include/memtrain/comm.h include/memtrain/mpi.h $(DESTDIR)$(PREFIX)/include/memtrain/
	install -m 644 $(LIB) $(DESTDIR)$(PREFIX)/lib/
	if [ -f $(LIB_MPI) ]; then install -m 644 $(LIB_MPI) $(DESTDIR)$(PREFIX)/lib/; fi
	install -m 755 $(TOOL) $(DESTDIR)$(PREFIX)/bin/
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(shell sed -n 's/#define MT_VERSION_STRING "\(.*\)"/\1/p' include/memtrain.h)|g' \
	  memtrain.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/memtrain.pc

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/include/memtrain.h $(DESTDIR)$(PREFIX)/include/memtrain/allocator.h \
	  $(DESTDIR)$(PREFIX)/include/memtrain/comm.h $(DESTDIR)$(PREFIX)/include/memtrain/mpi.h \
	  $(DESTDIR)$(PREFIX)/lib/libmemtrain_mpi.a \
	  $(DESTDIR)$(PREFIX)/lib/libmemtrain.a $(DESTDIR)$(PREFIX)/lib/pkgconfig/memtrain.pc \
	  $(DESTDIR)$(PREFIX)/bin/memtrain
	-rmdir $(DESTDIR)$(PREFIX)/include/memtrain

clean:
	rm -rf build build-san build-clang build-arm64

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
