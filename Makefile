# restps - distributed neural-network training in C, parameter-server style.
#   make            build bin/psd, bin/workerd, build/libps.a
#   make asan       the same with AddressSanitizer + UBSan, into build/asan/
#   make test       install what is missing, build both, run every test
#   make bench      benchmarks against nginx, printing ratios (bench/bench.mk)
#   make deps       apt-get (Debian) and pip (PyPI, into build/venv) what is missing (quiet, idempotent)
#   make demo       train on Fashion-MNIST and show where to look
#   make fuzz       run each libFuzzer harness FUZZ_SECS (60) s; tests/fuzz/
#   make hostile    the hostile campaign's long form (tests/helpers/campaign.py), both builds
# The test binaries' rules: tests/unit/unit.mk; the benchmarks': bench/bench.mk;
# the fuzzers': tests/fuzz/fuzz.mk (all three included below).

CC      ?= cc
OPT     ?= -O2 -g
CFLAGS  ?=
# dynamic cost model: GCC 12 at -O2 vectorizes only "very cheap" loops, which
# leaves the finite check and the optimizers scalar
CFLAGS  += $(OPT) -fvect-cost-model=dynamic -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread \
           -Icommon -Iserver -Iclient
LDLIBS_SERVER = -lmicrohttpd -lgnutls -lcurl -ljansson -lpthread -lm
LDLIBS_CLIENT = -lcurl -ljansson -lpthread -lm

BUILD ?= build
BIN   ?= bin

# The one link recipe: a rule names its objects (its prerequisites, $^) and
# appends its libraries, e.g. "$(LINK) -lm".
define LINK
@mkdir -p $(dir $@)
$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS)
endef

# Sources, a list a folder.
COMMON_SRC = common/cluster.c common/optim.c common/flags.c common/log.c common/safetensors.c common/tensor.c \
             common/errmsg.c common/token.c common/crc32c.c common/jsonmem.c common/pem.c common/tfevents.c
COMMON_SRC += common/ckptdir.c common/history.c
SERVER_SRC = server/bufpool.c server/store.c server/sync_agg.c server/worker_state.c \
             server/waiters.c server/ticker.c server/changes.c \
             server/metrics.c server/workers.c server/shard_view.c server/membership.c \
             server/checkpoint.c server/saver.c server/summaries.c \
             server/routes.c server/request.c server/reply_blobs.c \
             server/route_params.c server/route_grads.c server/route_vars.c server/route_config.c \
             server/route_run.c server/route_placement.c server/route_sync.c server/route_status.c \
             server/route_history.c server/route_metrics.c server/route_events.c \
             server/route_checkpoint.c server/route_web.c
# client/, a folder a concept (each with one public header; includes name the
# folder, "model/model.h", and point down: workerd -> pipeline -> ring, shards,
# data -> model; libps -> common)
LIBPS_SRC    = client/libps/libps.c client/libps/transfer.c
MODEL_SRC    = client/model/model.c client/model/model_spec.c client/model/model_cpu.c client/model/blas_kernel.c
# (the device choice links the CUDA backend, or its stub: MODEL_CUDA_OBJ below)
DEVICE_SRC   = client/model/model_device.c
DATA_SRC     = client/data/idx.c client/data/batcher.c
SHARDS_SRC   = client/shards/shards.c client/shards/placement.c client/shards/heartbeat.c
RING_SRC     = client/ring/ring.c client/ring/ring_ckpt.c
PIPELINE_SRC = client/pipeline/pipeline_plan.c client/pipeline/pipeline_schedule.c client/pipeline/pipeline_mailbox.c \
               client/pipeline/pipeline_ring.c client/pipeline/pipeline_link.c client/pipeline/pipeline_ps.c
WORKERD_SRC  = client/workerd/role_common.c client/workerd/train.c client/workerd/chief.c client/workerd/evaluator.c \
               client/workerd/local.c client/workerd/ring_train.c client/workerd/pipeline_train.c \
               client/workerd/model_file.c client/workerd/progress.c client/workerd/workerd_flags.c
CLIENT_SRC = $(LIBPS_SRC)
WORKER_SRC = $(MODEL_SRC) $(DEVICE_SRC) $(DATA_SRC) $(SHARDS_SRC) $(RING_SRC) $(PIPELINE_SRC) $(WORKERD_SRC)

# The CUDA backend (client/model/model_cuda.cu, cuBLAS) is built when nvcc is found
# ($(CUDA_HOME)/bin/nvcc, else on PATH), for Hopper (sm_90) plus compute_75 PTX
# that newer and older GPUs JIT-compile; make CUDA=0 forces a CPU-only build
# (client/model/model_cuda_stub.c). Sanitizer builds (-fsanitize in OPT, make asan) are
# CPU-only: the CUDA runtime and ASan's shadow memory do not mix. cudart is
# linked statically and libcublas is dlopen'ed once a device is chosen, so
# workerd starts on a machine without the NVIDIA driver or cuBLAS (and then
# uses the CPU), as fast as a CPU-only build.
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(firstword $(wildcard $(CUDA_HOME)/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
ifneq ($(findstring -fsanitize,$(OPT)),)
CUDA ?= 0
endif
ifeq ($(NVCC),)
CUDA ?= 0
endif
CUDA ?= 1
NVCCFLAGS ?= -O2 -g -std=c++17 -Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings -Wno-deprecated-gpu-targets \
             -gencode arch=compute_90,code=sm_90 -gencode arch=compute_75,code=compute_75 \
             -DRESTPS_CUDA_LIBDIR='"$(CUDA_HOME)/lib64"'
ifeq ($(CUDA),1)
ifeq ($(NVCC),)
$(error CUDA=1 but no nvcc in $(CUDA_HOME)/bin or on PATH: install the CUDA toolkit, set CUDA_HOME, or make CUDA=0)
endif
MODEL_CUDA_OBJ = $(BUILD)/client/model/model_cuda.o
LDLIBS_CUDA = -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
GPU_BINS = $(BIN)/cuda_vs_cpu $(BIN)/gpu_bench
$(info restps: CUDA backend on ($(NVCC): sm_90 + compute_75 PTX); make CUDA=0 for a CPU-only build)
else
MODEL_CUDA_OBJ = $(BUILD)/client/model/model_cuda_stub.o
LDLIBS_CUDA =
GPU_BINS =
$(info restps: CPU-only build (no CUDA backend: CUDA=0 or no nvcc))
endif

COMMON_OBJ = $(COMMON_SRC:%.c=$(BUILD)/%.o)
SERVER_OBJ = $(SERVER_SRC:%.c=$(BUILD)/%.o) $(WEB_OBJ) $(ENDPOINT_OBJ)
CLIENT_OBJ = $(CLIENT_SRC:%.c=$(BUILD)/%.o)
# (MODEL_CUDA_OBJ, above: the model's CUDA backend, or its stub without CUDA)
WORKER_OBJ = $(WORKER_SRC:%.c=$(BUILD)/%.o) $(MODEL_CUDA_OBJ)
MODEL_OBJ = $(MODEL_SRC:%.c=$(BUILD)/%.o)
LDLIBS_WORKER = -lopenblas -lz -lmicrohttpd -lgnutls $(LDLIBS_CLIENT) $(LDLIBS_CUDA)
# GnuTLS priority strings (psd's --tls_priorities, the ring's): kept out of
# COMMON_OBJ, whose users (libps.a, the unit tests) do not link GnuTLS
TLS_OBJ = $(BUILD)/common/tls_priorities.o
# The monitoring page (common/web_assets.h): the lookup and the generated table
WEB_OBJ = $(BUILD)/common/web_assets.o $(BUILD)/common/web_assets_table.o
# What psd and the ring's endpoint answer with (libmicrohttpd: also kept out of COMMON_OBJ)
ENDPOINT_OBJ = $(BUILD)/common/endpoint.o $(BUILD)/common/conntrack.o $(BUILD)/common/http_server.o

ASAN_FLAGS = -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer

.PHONY: all asan test coverage hostile deps demo clean
all: $(BIN)/psd $(BIN)/workerd $(BUILD)/libps.a

# client/ never includes server/ (common/ holds what both use)
$(BUILD)/client/%.o: CFLAGS := $(filter-out -Iserver,$(CFLAGS))

# sqrtf in the optimizers' loops vectorizes only when it need not set errno
$(BUILD)/common/optim.o: CFLAGS += -fno-math-errno

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c -o $@ $<

$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -Icommon -Iclient -MMD -MP -c -o $@ $<

# The monitoring page, compiled in: one binary deploys (psd, and workerd for a ring's chief).
$(BUILD)/common/web_assets_table.c: web/index.html web/app.js web/style.css scripts/embed_web.sh
	@mkdir -p $(dir $@)
	sh scripts/embed_web.sh web > $@.tmp && mv $@.tmp $@

$(BUILD)/common/web_assets_table.o: $(BUILD)/common/web_assets_table.c
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/libps.a: $(CLIENT_OBJ) $(COMMON_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BIN)/psd: $(BUILD)/server/psd.o $(SERVER_OBJ) $(COMMON_OBJ) $(TLS_OBJ)
	$(LINK) $(LDLIBS_SERVER)

# (the monitoring page too: the chief of a ring job serves it)
$(BIN)/workerd: $(BUILD)/client/workerd/workerd.o $(WORKER_OBJ) $(TLS_OBJ) $(WEB_OBJ) $(ENDPOINT_OBJ) $(BUILD)/libps.a
	$(LINK) $(LDLIBS_WORKER)

# The unit tests, the system tests' programs and the GPU checks (unit-bins,
# gpu-check, gpu-emu); the benchmarks (bench, bench-cnn, bench-bins)
include tests/unit/unit.mk
include bench/bench.mk

asan:
	$(MAKE) BUILD=build/asan BIN=build/asan/bin OPT="$(ASAN_FLAGS)" LDFLAGS="-fsanitize=address,undefined" all unit-bins

deps:
	@sh scripts/deps.sh
	@sh scripts/pydeps.sh
	@sh scripts/promtool.sh

# make test: both builds (and the fuzzers' clang build, where clang is) at
# once over the cores, then tests/run.sh (the two system runs side by side).
JOBS ?= $(shell nproc)
test: deps
	$(MAKE) -j$(JOBS) all unit-bins asan $(if $(shell command -v $(FUZZ_CC) 2>/dev/null),fuzz-bins)
	sh tests/run.sh

# Line coverage of the C code (gcovr) under the full normal run and under the
# sanitizer run's subset, on a --coverage build (COV_BUILD); prints both line
# sets and the ratio, and writes tests/coverage.txt. Slow: not part of make test.
COV_BUILD ?= build/cov
COV_FLAGS = CUDA=0 OPT="-O1 -g --coverage" LDFLAGS="--coverage"
coverage: deps
	$(MAKE) -j$(JOBS) BUILD=$(COV_BUILD) BIN=$(COV_BUILD)/bin $(COV_FLAGS) all unit-bins
	sh tests/coverage.sh $(COV_BUILD)

# The hostile campaign's long form (issue 23; make test runs its short form,
# tests/system/test_hostile_campaign.py) against the normal and the sanitizer
# build, then the exhaustion tests at the issue's figures
hostile: all
	$(MAKE) asan
	/usr/bin/python3 tests/helpers/campaign.py --long --bin $(BIN)
	/usr/bin/python3 tests/helpers/campaign.py --long --bin build/asan/bin
	RESTPS_HOSTILE_LONG=1 RESTPS_BIN_DIR=$(BIN) pytest-3 -q -rs -p no:cacheprovider tests/system/test_hostile_exhaustion.py

# MODEL=cnn make demo trains the CNN instead (deploy/local/demo.sh says how long)
demo: deps all
	RESTPS_BIN_DIR=$(BIN) sh deploy/local/demo.sh

clean:
	rm -rf build bin

# libFuzzer harnesses (make fuzz, make fuzz-replay): tests/fuzz/fuzz.mk
include tests/fuzz/fuzz.mk

-include $(shell find build -name '*.d' 2>/dev/null)
