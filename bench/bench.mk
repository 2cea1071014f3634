# bench.mk - the benchmarks, included by the Makefile (which defines the
# object lists and LINK): their programs (bench/*.c) and what make bench runs.
#   make bench       benchmarks against nginx (and torch, gloo, TensorFlow), printing ratios
#   make bench-cnn   the CNN's accuracy target alone (issue 19; also in make bench): EPOCHS=, MODE=sync
#   make bench-bins  the benchmarks' programs, into $(BIN)

.PHONY: bench bench-cnn bench-bins

bench-bins: $(BIN)/bench_pull $(BIN)/bench_mlp $(BIN)/bench_pushpull $(BIN)/bench_push $(BIN)/ring_allreduce

$(BIN)/bench_push: $(BUILD)/bench/bench_push.o $(BUILD)/libps.a
	$(LINK) $(LDLIBS_CLIENT)

$(BIN)/bench_pushpull: $(BUILD)/bench/bench_pushpull.o $(BUILD)/libps.a
	$(LINK) $(LDLIBS_CLIENT)

$(BIN)/bench_mlp: $(BUILD)/bench/bench_mlp.o $(MODEL_OBJ) $(BUILD)/common/errmsg.o
	$(LINK) -lopenblas -lm

$(BIN)/bench_pull: $(BUILD)/bench/bench_pull.o $(BUILD)/libps.a
	$(LINK) $(LDLIBS_CLIENT)

# One member of a ring all-reduce, no model (tests/system/test_ring.py, bench/ring.py).
$(BIN)/ring_allreduce: $(BUILD)/bench/ring_allreduce.o $(BUILD)/client/ring/ring.o $(TLS_OBJ) $(WEB_OBJ) \
                       $(ENDPOINT_OBJ) $(COMMON_OBJ)
	$(LINK) -lmicrohttpd -lgnutls $(LDLIBS_CLIENT)

# What make bench runs, in this order, one recipe line each (make stops at the
# first that fails): the HTTP load against nginx, push, training, small steps,
# the step's transfers beside its compute (--overlap), the CNN against torch and its accuracy, async accuracy, scaling, the ring,
# many hosts (network namespaces: the ps's bandwidth against the ring's), the
# ring against gloo, torch's RPC parameter server, the pipeline, TLS, then
# TensorFlow from its own venv (bench/requirements.txt).
define BENCH_RUNS
sh bench/run.sh
BIN_DIR=$(BIN) sh bench/push.sh
sh bench/train.sh
/usr/bin/python3 bench/small_step.py --bin=$(BIN)
/usr/bin/python3 bench/overlap.py --bin=$(BIN)
/usr/bin/python3 bench/cnn_compare.py --bin=$(BIN)
BIN=$(BIN) sh bench/cnn_accuracy.sh
/usr/bin/python3 bench/async_accuracy.py
/usr/bin/python3 bench/scale.py
/usr/bin/python3 bench/ring.py
RESTPS_BIN_DIR=$(BIN) /usr/bin/python3 bench/hosts.py
RESTPS_BIN_DIR=$(BIN) /usr/bin/python3 bench/wire.py
/usr/bin/python3 bench/gloo_allreduce.py --bin=$(BIN)
/usr/bin/python3 bench/torch_rpc_ps.py --bin=$(BIN)
/usr/bin/python3 bench/pipeline.py
sh bench/tls.sh
sh scripts/pydeps.sh bench/requirements.txt build/bench-venv
RESTPS_BIN_DIR=$(BIN) build/bench-venv/bin/python bench/tf_compare.py
RESTPS_BIN_DIR=$(BIN) build/bench-venv/bin/python bench/langid_tf.py
endef

bench: deps all bench-bins
	@sh scripts/deps.sh python3-torch
	@sh scripts/nginx.sh
	$(BENCH_RUNS)

bench-cnn: all
	BIN=$(BIN) sh bench/cnn_accuracy.sh
