# restps - distributed neural-network training in C, parameter-server style.
#   make            build bin/psd, bin/workerd, build/libps.a
#   make asan       the same with AddressSanitizer + UBSan, into build/asan/
#   make test       install what is missing, build both, run every test
#   make bench      benchmarks against nginx, printing ratios
#   make deps       apt-get what is missing (quiet, idempotent)
#   make demo       train on Fashion-MNIST and show where to look

CC      ?= cc
OPT     ?= -O2 -g
CFLAGS  ?=
# dynamic cost model: GCC 12 at -O2 vectorizes only "very cheap" loops, which
# leaves the finite check and the optimizers scalar
CFLAGS  += $(OPT) -fvect-cost-model=dynamic -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -Icommon -Iserver -Iclient
LDLIBS_SERVER = -lmicrohttpd -lcurl -ljansson -lpthread -lm
LDLIBS_CLIENT = -lcurl -ljansson -lpthread -lm

BUILD ?= build
BIN   ?= bin

COMMON_SRC = common/cluster.c common/optim.c common/flags.c common/log.c common/safetensors.c common/tensor.c common/errmsg.c common/token.c common/crc32c.c
SERVER_SRC = server/auth.c server/bufpool.c server/bulk.c server/http.c server/routes.c \
             server/status.c server/store.c server/vars.c \
             server/training.c server/waiters.c \
             server/metrics.c server/workers.c server/history.c server/events.c server/web.c \
             server/checkpoint.c server/saver.c server/checkpoint_routes.c \
             server/membership.c
CLIENT_SRC = client/libps.c
WORKER_SRC = client/idx.c client/mlp.c client/mlp_cpu.c client/shards.c client/train.c client/progress.c client/heartbeat.c client/placement.c

COMMON_OBJ = $(COMMON_SRC:%.c=$(BUILD)/%.o)
SERVER_OBJ = $(SERVER_SRC:%.c=$(BUILD)/%.o) $(BUILD)/web_assets.o
CLIENT_OBJ = $(CLIENT_SRC:%.c=$(BUILD)/%.o)
WORKER_OBJ = $(WORKER_SRC:%.c=$(BUILD)/%.o)
LDLIBS_WORKER = -lopenblas -lz $(LDLIBS_CLIENT)

ASAN_FLAGS = -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer

.PHONY: all asan test test-unit test-system deps bench demo clean help
all: $(BIN)/psd $(BIN)/workerd $(BUILD)/libps.a $(BIN)/ps_stress

# sqrtf in the optimizers' loops vectorizes only when it need not set errno
$(BUILD)/common/optim.o: CFLAGS += -fno-math-errno

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c -o $@ $<

# The monitoring page, compiled in: one binary deploys.
$(BUILD)/web_assets.c: web/index.html web/app.js web/style.css scripts/embed_web.sh
	@mkdir -p $(dir $@)
	sh scripts/embed_web.sh web > $@.tmp && mv $@.tmp $@

$(BUILD)/web_assets.o: $(BUILD)/web_assets.c
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/libps.a: $(CLIENT_OBJ) $(COMMON_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BIN)/psd: $(BUILD)/server/psd.o $(SERVER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS_SERVER)

$(BIN)/workerd: $(BUILD)/client/workerd.o $(WORKER_OBJ) $(BUILD)/libps.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS_WORKER)

# A libps client that pushes and pulls concurrently (the consistency test).
$(BIN)/ps_stress: $(BUILD)/tests/system/ps_stress.o $(BUILD)/libps.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS_CLIENT)

# Unit tests (cmocka), one binary per module.
UNIT_TESTS = test_tensor test_safetensors test_cluster test_store test_flags test_idx test_mlp
IDX_OBJ = $(BUILD)/client/idx.o
MLP_OBJ = $(BUILD)/client/mlp.o $(BUILD)/client/mlp_cpu.o

$(BIN)/test_idx: $(BUILD)/tests/unit/test_idx.o $(IDX_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) -lz -ljansson -lm -lcmocka
$(BIN)/test_mlp: $(BUILD)/tests/unit/test_mlp.o $(MLP_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) -lopenblas -ljansson -lm -lcmocka
# Loss and gradients of given inputs, for the numpy comparison (tests/system/test_mlp_numpy.py).
$(BIN)/mlp_dump: $(BUILD)/tests/unit/mlp_dump.o $(MLP_OBJ) $(BUILD)/common/errmsg.o
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) -lopenblas -lm
$(BIN)/test_%: $(BUILD)/tests/unit/test_%.o $(SERVER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS_SERVER) -lcmocka

bench-bins: $(BIN)/bench_pull $(BIN)/bench_mlp $(BIN)/bench_pushpull

$(BIN)/bench_pushpull: $(BUILD)/bench/bench_pushpull.o $(BUILD)/libps.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS_CLIENT)

$(BIN)/bench_mlp: $(BUILD)/bench/bench_mlp.o $(MLP_OBJ) $(BUILD)/common/errmsg.o
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) -lopenblas -lm

$(BIN)/bench_pull: $(BUILD)/bench/bench_pull.o $(BUILD)/libps.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS_CLIENT)

asan:
	$(MAKE) BUILD=build/asan BIN=build/asan/bin OPT="$(ASAN_FLAGS)" LDFLAGS="-fsanitize=address,undefined" all unit-bins

unit-bins: $(UNIT_TESTS:%=$(BIN)/%) $(BIN)/mlp_dump

deps:
	@sh scripts/deps.sh
	@sh scripts/npm-deps.sh
	@sh scripts/promtool.sh

test: deps
	$(MAKE) all unit-bins
	$(MAKE) asan
	sh tests/run.sh

bench: deps all bench-bins
	sh bench/run.sh
	sh bench/train.sh
	/usr/bin/python3 bench/scale.py
	sh bench/tls.sh

demo: deps all
	sh deploy/local/demo.sh

clean:
	rm -rf build bin

-include $(shell find build -name '*.d' 2>/dev/null)
