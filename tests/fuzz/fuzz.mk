# fuzz.mk - libFuzzer harnesses (tests/fuzz/fuzz_*.c), included by the Makefile.
#   make fuzz          build them and run each for FUZZ_SECS (60) seconds on its
#                      corpus, with tests/fuzz/<harness>.dict; new inputs go
#                      to $(FUZZ_WORK)/<harness>/, never into the committed
#                      corpus; fails on any crash, leak or sanitizer report
#   make fuzz-replay   build them and run each once over tests/fuzz/corpus/<harness>/
#                      (part of make test; JUnit XML into FUZZ_XML_DIR)
#   make fuzz-api      schemathesis (build/venv, make deps) against openapi.yaml and
#                      a live psd with FUZZ_API_EXAMPLES (200) examples per operation,
#                      the checks of tests/system/test_schemathesis.py (part of make fuzz)
# clang with -fsanitize=fuzzer,address,undefined; the project's sources are
# compiled again for it into $(FUZZ_BUILD) (the gcc build is not reused).

.PHONY: fuzz fuzz-replay fuzz-bins fuzz-api
FUZZ_API_EXAMPLES ?= 200
FUZZ_CC    ?= $(firstword $(shell command -v clang-14 clang 2>/dev/null) clang)
FUZZ_BUILD ?= $(BUILD)/fuzz
FUZZ_SECS  ?= 60
FUZZ_WORK  ?= /tmp/restps-fuzz
FUZZ_XML_DIR ?= tests/out
FUZZ_SAN    = -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
# no -Werror: gcc's build gates warnings; a clang-only warning must not stop the replay
FUZZ_CFLAGS = -O1 -g $(FUZZ_SAN) -fsanitize=fuzzer-no-link -std=c11 -D_GNU_SOURCE -Wall -Wextra \
              -pthread -Icommon -Iserver -Iclient
FUZZ_HARNESSES = fuzz_safetensors fuzz_idx fuzz_cluster fuzz_request fuzz_checkpoint

FUZZ_COMMON = $(COMMON_SRC:%.c=$(FUZZ_BUILD)/%.o)
# fuzz_request includes common/http_server.c and server/route_vars.c to reach their static parsers
FUZZ_LEFT_OUT = $(FUZZ_BUILD)/server/route_vars.o $(FUZZ_BUILD)/common/http_server.o
FUZZ_SERVER = $(filter-out $(FUZZ_LEFT_OUT), \
                $(SERVER_SRC:%.c=$(FUZZ_BUILD)/%.o) \
                $(WEB_OBJ:$(BUILD)/%=$(FUZZ_BUILD)/%) $(ENDPOINT_OBJ:$(BUILD)/%=$(FUZZ_BUILD)/%))

$(FUZZ_BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -MMD -MP -c -o $@ $<

# the monitoring page's generated table (the Makefile's rule writes it)
$(FUZZ_BUILD)/common/web_assets_table.o: $(BUILD)/common/web_assets_table.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -c -o $@ $<

# idx.c reads in chunks of 256 KiB; 512 bytes here puts chunk boundaries
# inside small inputs and keeps zlib's buffers small
$(FUZZ_BUILD)/client/data/idx.o: FUZZ_CFLAGS += -DIDX_CHUNK=512

# the harnesses' link recipe (as the Makefile's LINK): a rule appends its libraries
define FUZZ_LINK
@mkdir -p $(dir $@)
$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $^
endef
$(FUZZ_BUILD)/bin/fuzz_safetensors: $(FUZZ_BUILD)/tests/fuzz/fuzz_safetensors.o $(FUZZ_COMMON)
	$(FUZZ_LINK) -ljansson -lm
$(FUZZ_BUILD)/bin/fuzz_cluster: $(FUZZ_BUILD)/tests/fuzz/fuzz_cluster.o $(FUZZ_COMMON)
	$(FUZZ_LINK) -ljansson -lm
$(FUZZ_BUILD)/bin/fuzz_idx: $(FUZZ_BUILD)/tests/fuzz/fuzz_idx.o $(FUZZ_BUILD)/client/data/idx.o $(FUZZ_COMMON)
	$(FUZZ_LINK) -lz -ljansson -lm
$(FUZZ_BUILD)/bin/fuzz_request: $(FUZZ_BUILD)/tests/fuzz/fuzz_request.o $(FUZZ_SERVER) $(FUZZ_COMMON)
	$(FUZZ_LINK) $(LDLIBS_SERVER)
$(FUZZ_BUILD)/bin/fuzz_checkpoint: $(FUZZ_BUILD)/tests/fuzz/fuzz_checkpoint.o $(FUZZ_SERVER) \
                                   $(FUZZ_LEFT_OUT) $(FUZZ_COMMON)
	$(FUZZ_LINK) $(LDLIBS_SERVER)

fuzz-bins: $(FUZZ_HARNESSES:%=$(FUZZ_BUILD)/bin/%)

# ASan's leak check and UBSan stop the run at the first report.
FUZZ_ENV = ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

fuzz: fuzz-bins fuzz-api
	@for h in $(FUZZ_HARNESSES); do \
	  mkdir -p $(FUZZ_WORK)/$$h $(FUZZ_WORK)/crashes; \
	  echo "fuzz: $$h for $(FUZZ_SECS) s (new inputs in $(FUZZ_WORK)/$$h)"; \
	  dict=; [ -f tests/fuzz/$$h.dict ] && dict=-dict=tests/fuzz/$$h.dict; \
	  $(FUZZ_ENV) $(FUZZ_BUILD)/bin/$$h -max_total_time=$(FUZZ_SECS) -timeout=10 -rss_limit_mb=2048 $$dict \
	    -artifact_prefix=$(FUZZ_WORK)/crashes/$$h- -print_final_stats=1 \
	    $(FUZZ_WORK)/$$h tests/fuzz/corpus/$$h >$(FUZZ_WORK)/$$h.log 2>&1 \
	    || { tail -40 $(FUZZ_WORK)/$$h.log; echo "fuzz: $$h FAILED (log $(FUZZ_WORK)/$$h.log)"; exit 1; }; \
	  grep -E '^stat::number_of_executed_units' $(FUZZ_WORK)/$$h.log; \
	done

# The HTTP contract: the bounded run of make test, with many more examples
# (a few minutes at 200); fails on any finding. Skipped (and says so) without build/venv.
fuzz-api: $(BIN)/psd
	RESTPS_BIN_DIR=$(BIN) RESTPS_ST_EXAMPLES=$(FUZZ_API_EXAMPLES) RESTPS_ST_TIMEOUT=3600 \
	  pytest-3 -q -rs -p no:cacheprovider tests/system/test_schemathesis.py -k every_

# Each harness replays its corpus once (no mutation): one JUnit test case per
# harness; without clang every case is skipped with the reason.
fuzz-replay:
	@sh tests/fuzz/replay.sh "$(FUZZ_CC)" "$(FUZZ_BUILD)" "$(FUZZ_XML_DIR)" "$(MAKE)" $(FUZZ_HARNESSES)

-include $(shell find $(FUZZ_BUILD) -name '*.d' 2>/dev/null)
