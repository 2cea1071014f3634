"""What the sanitizer build's system run leaves to the normal build, and why.

tests/run.sh runs every system test on the normal build, and on the
AddressSanitizer + UBSan build every test this module does not name here:
conftest.py marks those skipped there, with the reason, so the run's summary
counts them. The rule for this list: a test leaves the sanitizer run only when
no C code path depends on it there: pure file, spec and Python-side checks,
timing or rate measurements whose code paths other tests reach under the
sanitizer, and the repetitions of a matrix whose C path does not change along
the axis left out. Every path reached only through a process (signals, crash
recovery, TLS, checkpoints) stays. `make coverage` measures what this costs:
the lines of C the sanitizer run still reaches, against the full normal run
(tests/coverage.txt; it must stay at 95% or more). Tests that skip themselves
under ASan (LD_PRELOAD shims, valgrind, the container build, timing tests)
say so in their own files.
"""
import os

# whole files: file name -> reason
FILES = {
    "test_docs.py": "checks README.md and docs/*.md as text (links, paths, command syntax, flags, make targets); "
                    "the curl tour's psd routes run under the sanitizer in test_http",
    "test_deploy_files.py": "lints the deploy files (YAML, Dockerfiles, units, scripts): no C code runs",
    "test_deploy_run.py": "checks the deploy scripts' mapping of TF_CONFIG and Slurm tasks to flags; "
                          "the psd and workerd they start run the training paths that test_train and "
                          "test_cluster_sh run under the sanitizer",
    "test_safetensors_py.py": "reads psd's files with Python's safetensors (the file format); psd's "
                              "writers run under the sanitizer in test_checkpoint and test_recovery",
}

# single tests: (file name, function name) -> reason
TESTS = {
    ("test_task_claim.py", "test_a_second_chief_is_refused_naming_the_holder_and_the_job_is_configured_once"): (
        "a whole sync job beside a refused second chief (11 s under ASan); every sanitizer test's workerd claims "
        "its task id, and psd's refusal (409 naming the holder) runs there in test_heartbeat_instances_over_http"),
    ("test_task_claim.py", "test_a_worker_killed_and_restarted_at_once_takes_its_id_back"): (
        "waits out a killed process's claim (3 s) in a running job; the claim code (task_claims.c: the 409, "
        "a holder's release) runs under the sanitizer in test_heartbeat_instances_over_http"),
    ("test_openapi.py", "test_spec_is_valid_openapi"): "validates the spec file with the OpenAPI "
        "validator: no C code runs (the live answers are checked under the sanitizer)",
    ("test_openapi.py", "test_route_table_matches_spec"): "compares psd --routes (which test_auth runs "
        "under the sanitizer) with the spec: no request is made",
    ("test_openapi.py", "test_event_data_is_status"): "a check of the spec's schemas: no C code runs",
    ("test_openapi.py", "test_stage_spec_is_valid_openapi"): "validates openapi/pipeline_stage.yaml with the "
        "OpenAPI validator: no C code runs",
    ("test_openapi.py", "test_a_pipeline_stages_answers_match_its_spec"): "checks the shapes of a pipeline "
        "stage's answers against its spec; the same routes (the page, /v1/status with every stage and with a "
        "dead one, /v1/pipeline, refused messages) run under the sanitizer in test_pipeline",
    ("test_history.py", "test_steps_per_sec"): "a rate measured over 7.5 s of pushes and waiting; the "
        "rate's code runs under the sanitizer in every /v1/status read",
    ("test_pipeline.py", "test_one_seed_one_file_another_seed_another"): "three more runs per case of the pipeline "
        "paths the equivalence matrix, R = 2 and the ring run under the sanitizer (the same stages, schedule, "
        "exchange, ring and optimizer code); "
        "determinism is a property of the normal build's floats",
    ("test_pipeline.py",
     "test_with_the_ps_a_killed_stage_stops_the_other_and_the_restarted_job_ends_with_the_uninterrupted_model"):
        "12 s per victim under ASan (three jobs of 300 steps); the stop on a dead neighbour runs there in "
        "test_a_dead_stage_stops_the_others_within_the_timeout, the ps's restore in test_recovery, and a "
        "stage's start at a restored step is pipe_ps_pull at another min_step (the ps matrix)",
    ("test_pipeline.py", "test_with_the_ps_one_seed_one_file"): "two more runs (9 s under ASan) of the ps "
        "paths the ps equivalence matrix runs under the sanitizer; determinism is a property of the normal "
        "build's floats",
    ("test_langid.py", "test_local_matches_numpy_and_beats_the_logistic_regression_baseline"): "an accuracy "
        "comparison with numpy over 3,000 words a language (27 s under ASan); the embedding bag, the n-gram "
        "hashing and the langid data run under the sanitizer in test_sync_two_workers_equal_local_with_twice_"
        "the_batch and test_async_over_two_ps_trains",
    ("test_torch_worker.py", "test_async_mixed_job_reaches_the_c_jobs_accuracy"): "an accuracy comparison; "
        "the Python worker's pulls and pushes reach psd under the sanitizer in the sync case",
    ("test_hostile_ring.py", "test_ring_endpoint_cuts_a_body_that_trickles"): "10 s of a body trickling in; "
        "the floor (body_too_slow in common/http_server.c, one for every endpoint) runs under the sanitizer in "
        "test_hostile's trickled bodies against psd",
    ("test_ps_unreachable.py", "test_a_stopped_ps_is_said_at_once_and_the_worker_gives_up_in_one_clear_line"):
        "9 s of a worker's retry budget; the stall report's retry and its end run under the sanitizer in "
        "test_a_ps_back_within_the_budget_is_said_to_answer_again",
    ("test_python_client.py", "test_bodies_are_what_pypi_safetensors_reads_and_writes"): "the Python "
        "package's safetensors codec against PyPI's: no C code runs",
    ("test_python_client.py", "test_pip_installs_the_package_into_a_fresh_venv"): "pip installs the Python "
        "package: no C code runs",
    ("test_python_client.py", "test_the_package_type_checks_with_mypy"): "mypy on the Python package: no C "
        "code runs",
    ("test_evaluator_end.py", "test_the_evaluator_reports_the_final_step_before_the_ps_stops"): "5-7 s under "
        "ASan (two processes loading the data one after the other); the evaluator's wait_next and the chief's "
        "wait_evaluator run under the sanitizer in test_cluster_sh's run with --evaluator, the readyz query in "
        "test_openapi",
    ("test_final_eval_said.py", "test_a_pipeline_chief_says_what_it_computes_at_the_end"): "a CNN's final "
        "evaluation timed (6 s here, minutes under ASan); final_report's pieces and progress run under the "
        "sanitizer in every chief's end (test_train, test_pipeline)",
}

# matrices: (file name, function name) -> (keep(params) -> bool, reason)
WRITE_KEPT = "/v1/grads"
READ_KEPT = "/v1/params"
MATRICES = {
    ("test_overlap.py", "test_sync_with_overlap_ends_with_the_same_floats_as_without"): (
        lambda p: p["n_ps"] == 2,
        "the sanitizer build runs the 2-ps case (a variable split over both: every path of the streamed pull "
        "and push, the transfer thread's); one ps repeats it with one answer a step"),
    ("test_hostile_campaign.py", "test_hostile_endpoints_campaign"): (
        lambda p: p["surface"] != "stage",
        "the sanitizer build runs the ring's and the files' campaigns; a stage's endpoint is the same shared "
        "HTTP layer (common/http_server.c, endpoint.c) the ring's runs there, and its message checks run "
        "under the sanitizer in test_pipeline's bad-messages test"),
    ("test_pipeline.py", "test_with_the_ps_a_pipeline_trains_what_local_trains"): (
        lambda p: p["model"].startswith("mlp"),
        "the sanitizer build runs the 2 MLP cases (K = 2 and 3, R = 1 and 2, 1 and 2 ps, gpipe and 1f1b, sgd "
        "and adam: every path of the stages against the ps); the CNN cases (5-7 s each under ASan) add only "
        "the conv layers' floats, which the no-ps matrix runs there"),
    ("test_pipeline.py", "test_a_pipeline_trains_what_local_trains"): (
        lambda p: bool(p["extra"]) or (p["k"], p["m"], p["sched"], p["opt"]) in ((2, 1, "gpipe", "sgd"),
                                                                               (2, 4, "gpipe", "adam")),
        "the sanitizer build runs 3 of the 8 cases: K = 2 and 3, M = 1, 2 and 4, gpipe and 1f1b, sgd and adam, "
        "both models' layer kinds, a middle stage without the data; the other cases repeat those code paths "
        "with other numbers"),
    ("test_auth.py", "test_write_without_the_right_token_is_401"): (
        lambda p: p["auth"] == "none" or p["route"][1] == WRITE_KEPT,
        f"the sanitizer build runs every bad token on POST {WRITE_KEPT} and every write route "
        "without a token; the token check (common/http_server.c, common/token.c) runs before any route "
        "and does not depend on it"),
    ("test_auth.py", "test_auth_reads_closes_every_route_not_open"): (
        lambda p: p["auth"] == "none" or p["route"][1] == READ_KEPT,
        f"the sanitizer build runs every bad token on GET {READ_KEPT} and every route without a "
        "token; the token check runs before any route and does not depend on it"),
    ("test_onnx.py", "test_onnx_export_runs_in_onnxruntime_as_restps"): (
        lambda p: p["name"] != "tutorial cnn",
        "the sanitizer build exports 3 of the 4 models (the MLPs and the valid-padding CNN: every layer "
        "kind's ONNX nodes); the tutorial CNN (8 s under ASan) repeats conv, pool and dense with other sizes"),
    ("test_readme_blocks.py", "test_a_by_hand_block_runs_as_written_twice"): (
        lambda p: p["rel"] == "README.md",
        "the sanitizer build runs the README's blocks (sync, async with an evaluator, each twice: the rerun's "
        "'nothing to train'); docs/pipeline.md's are CNN pipelines whose final evaluation takes minutes under "
        "ASan, and their paths (the stages with and without the ps, a restored step) run there in test_pipeline"),
    ("test_history.py", "test_events_at_most_ten_a_second"): (
        lambda p: "--http_threads=2" in p["mode"],
        "a rate limit measured over seconds of pushes; the event stream runs under the sanitizer "
        "with the default pool (epoll-pool) here and with every threading in the other event tests"),
}


def normal_build_only(item):
    """The reason item runs on the normal build only, or None."""
    fname = os.path.basename(str(item.fspath))
    func = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
    if fname in FILES:
        return FILES[fname]
    if (fname, func) in TESTS:
        return TESTS[(fname, func)]
    m = MATRICES.get((fname, func))
    if m and hasattr(item, "callspec"):
        try:
            keep = m[0](item.callspec.params)
        except (KeyError, IndexError, TypeError):
            keep = True  # the matrix changed shape: run it all rather than guess
        if not keep:
            return m[1]
    return None
