# unit.mk - the test binaries, included by the Makefile (which defines the
# object lists and LINK): the unit tests (cmocka, tests/unit/), the programs
# the system tests run (tests/helpers/: mlp_dump, model_dump, ps_stress; and
# bench/'s ring_allreduce, bench/bench.mk) and, with CUDA, the GPU checks
# (tests/gpu/).
#   make unit-bins   every one of them, into $(BIN)

.PHONY: unit-bins gpu-check gpu-emu

# Unit tests (cmocka), one binary per module.
UNIT_TESTS = test_tensor test_safetensors test_cluster test_store test_saver test_flags test_idx test_tfevents
UNIT_TESTS += test_blas_kernel
UNIT_TESTS += test_ckptdir
UNIT_TESTS += test_model
UNIT_TESTS += test_retry test_while_waiting
UNIT_TESTS += test_placement
UNIT_TESTS += test_waiters test_sync
UNIT_TESTS += test_history
UNIT_TESTS += test_http_server
UNIT_TESTS += test_pipeline
UNIT_TESTS += test_push_in_body
UNIT_TESTS += test_onnx_export
UNIT_TESTS += test_sparse_table
UNIT_TESTS += test_wire_dtype
UNIT_TESTS += test_topk
IDX_OBJ = $(BUILD)/client/data/idx.o
# The fixtures the tests share (tests/unit/store_fixture.h, fake_ps.h): a
# store on a pool of its own (with the server's objects), a fake ps (with libps)
STORE_FIXTURE_OBJ = $(BUILD)/tests/unit/store_fixture.o
FAKE_PS_OBJ = $(BUILD)/tests/unit/fake_ps.o
PIPELINE_UNIT_OBJ = $(addprefix $(BUILD)/client/pipeline/,pipeline_plan.o pipeline_schedule.o pipeline_mailbox.o \
                      pipeline_ring.o)

$(BIN)/test_idx: $(BUILD)/tests/unit/test_idx.o $(IDX_OBJ) $(COMMON_OBJ)
	$(LINK) -lz -ljansson -lm -lcmocka
$(BIN)/test_model: $(BUILD)/tests/unit/test_model.o $(MODEL_OBJ) $(COMMON_OBJ)
	$(LINK) -lopenblas -ljansson -lm -lcmocka
$(BIN)/test_blas_kernel: $(BUILD)/tests/unit/test_blas_kernel.o $(BUILD)/client/model/blas_kernel.o
	$(LINK) -lopenblas -lm -lcmocka
# the ONNX export read back with protobuf-c's unpacker (the generated onnx.pb-c.h)
$(BIN)/test_onnx_export: $(BUILD)/tests/unit/test_onnx_export.o $(BUILD)/client/onnx/onnx_export.o $(ONNX_PB_OBJ) \
                         $(MODEL_OBJ) $(COMMON_OBJ)
	$(LINK) -lprotobuf-c -lopenblas -ljansson -lm -lcmocka
$(BUILD)/tests/unit/test_onnx_export.o: CFLAGS += -I$(BUILD)/client/onnx
$(BUILD)/tests/unit/test_onnx_export.o: $(BUILD)/client/onnx/onnx.pb-c.h
# A unit test links what it tests: the common/ modules alone; libps (against
# the fake server, fake_ps.c); placement alone. Only the tests of server
# modules (store, saver) link the server's objects.
COMMON_UNIT_TESTS = test_tensor test_safetensors test_cluster test_flags test_tfevents test_ckptdir test_sparse_table \
                    test_wire_dtype
$(COMMON_UNIT_TESTS:%=$(BIN)/%): $(BIN)/%: $(BUILD)/tests/unit/%.o $(COMMON_OBJ)
	$(LINK) -ljansson -lm -lcmocka
$(BIN)/test_retry: $(BUILD)/tests/unit/test_retry.o $(FAKE_PS_OBJ) $(BUILD)/libps.a
	$(LINK) $(LDLIBS_CLIENT) -lcmocka
$(BIN)/test_while_waiting: $(BUILD)/tests/unit/test_while_waiting.o $(FAKE_PS_OBJ) $(BUILD)/libps.a
	$(LINK) $(LDLIBS_CLIENT) -lcmocka
$(BIN)/test_topk: $(BUILD)/tests/unit/test_topk.o $(BUILD)/client/shards/topk.o
	$(LINK) -lm -lcmocka
$(BIN)/test_placement: $(BUILD)/tests/unit/test_placement.o $(BUILD)/client/shards/placement.o \
                       $(BUILD)/client/model/model_spec.o $(BUILD)/common/errmsg.o
	$(LINK) -ljansson -lm -lcmocka
# model parallelism's split, tables and receive buffer (the layout from model_spec.o)
$(BIN)/test_pipeline: $(BUILD)/tests/unit/test_pipeline.o $(PIPELINE_UNIT_OBJ) $(BUILD)/client/model/model_spec.o \
                      $(BUILD)/client/model/model.o $(BUILD)/common/errmsg.o
	$(LINK) -lm -lpthread -lcmocka
# the endpoint layer alone, on a real daemon on 127.0.0.1:0, spoken to with libcurl
$(BIN)/test_http_server: $(BUILD)/tests/unit/test_http_server.o $(ENDPOINT_OBJ) $(COMMON_OBJ)
	$(LINK) -lmicrohttpd -lcurl -ljansson -lpthread -lm -lcmocka
# the parked requests and the ticker alone, against fake libmicrohttpd calls in the test
$(BIN)/test_waiters: $(BUILD)/tests/unit/test_waiters.o $(BUILD)/server/waiters.o $(BUILD)/server/ticker.o
	$(LINK) -lcmocka
# the history alone (the TensorBoard writer faked in the test)
$(BIN)/test_history: $(BUILD)/tests/unit/test_history.o $(BUILD)/common/history.o $(BUILD)/common/log.o
	$(LINK) -ljansson -lm -lpthread -lcmocka
# the server modules' tests (store, saver, sync, push in body), on the store fixture
$(BIN)/test_%: $(BUILD)/tests/unit/test_%.o $(STORE_FIXTURE_OBJ) $(SERVER_OBJ) $(COMMON_OBJ)
	$(LINK) $(LDLIBS_SERVER) -lcmocka

# The programs the system tests run (tests/helpers/).
# Loss and gradients of given inputs, for the numpy comparison (tests/system/test_mlp_numpy.py).
$(BIN)/mlp_dump: $(BUILD)/tests/helpers/mlp_dump.o $(MODEL_OBJ) $(BUILD)/common/errmsg.o
	$(LINK) -lopenblas -lm
# One step's loss, logits and gradients from a safetensors file (the model
# contract's tool; tests/system/test_model_numpy.py compares it with numpy).
$(BIN)/model_dump: $(BUILD)/tests/helpers/model_dump.o $(MODEL_OBJ) $(COMMON_OBJ)
	$(LINK) -lopenblas -ljansson -lm
# A libps client that pushes and pulls concurrently (the consistency test).
$(BIN)/ps_stress: $(BUILD)/tests/helpers/ps_stress.o $(BUILD)/libps.a
	$(LINK) $(LDLIBS_CLIENT)

# Every test binary: the unit tests, the tools the system tests run (mlp_dump,
# ps_stress, ring_allreduce) and, with CUDA, the GPU checks.
unit-bins: $(UNIT_TESTS:%=$(BIN)/%) $(BIN)/mlp_dump $(BIN)/model_dump $(BIN)/ps_stress $(BIN)/ring_allreduce \
           $(GPU_BINS)

# The GPU checks (tests/gpu/): CUDA against the CPU on random inputs, and the
# step and sgemm benchmarks. gpu-check builds, then runs them where there is a device.
$(BIN)/cuda_vs_cpu: $(BUILD)/tests/gpu/cuda_vs_cpu.o $(MODEL_OBJ) $(MODEL_CUDA_OBJ) $(COMMON_OBJ)
	$(LINK) -lopenblas -ljansson -lm $(LDLIBS_CUDA)
$(BIN)/gpu_bench: $(BUILD)/tests/gpu/gpu_bench.o $(MODEL_OBJ) $(MODEL_CUDA_OBJ) $(COMMON_OBJ)
	$(LINK) -lopenblas -ljansson -lm $(LDLIBS_CUDA) -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas
$(BUILD)/tests/gpu/gpu_bench.o $(BUILD)/tests/gpu/cuda_vs_cpu.o: CFLAGS += -I$(CUDA_HOME)/include

gpu-check:
	bash tests/gpu/check.sh

# The CUDA backend's host logic and kernel indexing without a GPU: cuda_vs_cpu
# on a host emulation of the CUDA runtime and cuBLAS (tests/gpu/emu/run.sh).
gpu-emu:
	bash tests/gpu/emu/run.sh
