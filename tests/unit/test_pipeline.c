/* test_pipeline.c - model parallelism's pure parts: the split of the layers
 * into stages (client/pipeline_plan.c) against splits worked out by hand and
 * against a brute force over every split, --stage_layers and its refusals,
 * the grid rule; the gpipe and 1f1b tables (client/pipeline_schedule.c):
 * every micro-batch forwarded once and backwarded once after, the in-flight
 * bound, and a simulation of K stages running their tables with blocking
 * receives (no deadlock; with unit-time ops the fill-drain time, so the
 * bubble is (K-1)/(M+K-1)); a table made wrong on purpose deadlocks there;
 * the receive buffer (client/pipeline_mailbox.c): what it refuses leaves
 * nothing, a take waits until its deadline. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "pipeline/pipeline_mailbox.h"
#include "pipeline/pipeline_ring.h"
#include "pipeline/pipeline_plan.h"
#include "pipeline/pipeline_schedule.h"

static model_layout layout(const char *spec)
{
    model_layout L;
    char err[256];
    int rc = model_layout_init(&L, spec, (model_shape){28, 28, 1}, 10, err, sizeof(err));
    if (rc != 0)
        fail_msg("%s: %s", spec, err);
    return L;
}

static void expect_split(const pipe_plan *p, const char *want)
{
    char got[128];
    pipe_plan_format(p, got, sizeof(got));
    assert_string_equal(got, want);
}

/* mlp:32,16: flatten of the 28x28x1 images (0), dense 784x32 (6*784*32 =
 * 150528), relu 32 (64), dense 32x16 (3072), relu 16 (32), dense 16x10 (960).
 * What is computed: the first dense has no parameters below it, so no input
 * gradient: 4*784*32 = 100352. */
static void test_flops_and_split_of_the_mlp(void **state)
{
    (void)state;
    model_layout L = layout("mlp:32,16");
    assert_int_equal(L.n_layers, 6);
    const uint64_t want[] = {0, 150528, 64, 3072, 32, 960};
    const uint64_t cost[] = {0, 100352, 64, 3072, 32, 960};
    for (int i = 0; i < 6; i++) {
        assert_int_equal(pipe_layer_flops(&L.layers[i]), want[i]);
        assert_int_equal(pipe_layer_cost(&L, i), cost[i]);
    }
    pipe_plan p;
    char err[256];
    /* K=2: the first dense (and the flatten) is the bottleneck (100352); 0-2 would be 100416 */
    assert_int_equal(pipe_split_balanced(&L, 2, &p, err, sizeof(err)), 0);
    expect_split(&p, "0-1,2-5");
    assert_int_equal(p.cost[0], 100352);
    assert_int_equal(p.cost[1], 64 + 3072 + 32 + 960);
    /* K=3: the same bottleneck; stage 1 takes all it can and leaves one layer */
    assert_int_equal(pipe_split_balanced(&L, 3, &p, err, sizeof(err)), 0);
    expect_split(&p, "0-1,2-4,5-5");
    /* K=6: one layer each; K=7: more stages than layers */
    assert_int_equal(pipe_split_balanced(&L, 6, &p, err, sizeof(err)), 0);
    expect_split(&p, "0-0,1-1,2-2,3-3,4-4,5-5");
    assert_int_equal(pipe_split_balanced(&L, 7, &p, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "6 layers"));
    assert_int_equal(pipe_split_balanced(&L, 1, &p, err, sizeof(err)), -1);
    assert_int_equal(pipe_split_balanced(&L, 9, &p, err, sizeof(err)), -1);
}

/* conv:3x3x4,pool:2,dense:16,dropout:0.25,dense:10: conv 28x28x1->28x28x4
 * (6*28*28*9*4 = 169344), relu (2*3136 = 6272), pool 2 -> 14x14x4 (2*784*4 =
 * 6272), flatten (0), dense 784x16 (75264), relu (32), dropout (32), dense
 * 16x10 (960). Computed: the conv at the bottom without its input gradient,
 * 4*28*28*9*4 = 112896. */
static void test_flops_and_split_of_a_cnn(void **state)
{
    (void)state;
    model_layout L = layout("conv:3x3x4,pool:2,dense:16,dropout:0.25,dense:10");
    assert_int_equal(L.n_layers, 8);
    const layer_kind kinds[] = {LAYER_CONV2D, LAYER_RELU, LAYER_MAXPOOL, LAYER_FLATTEN,
                                LAYER_DENSE, LAYER_RELU, LAYER_DROPOUT, LAYER_DENSE};
    const uint64_t want[] = {169344, 6272, 6272, 0, 75264, 32, 32, 960};
    const uint64_t cost[] = {112896, 6272, 6272, 0, 75264, 32, 32, 960};
    for (int i = 0; i < 8; i++) {
        assert_int_equal(L.layers[i].kind, kinds[i]);
        assert_int_equal(pipe_layer_flops(&L.layers[i]), want[i]);
        assert_int_equal(pipe_layer_cost(&L, i), cost[i]);
    }
    pipe_plan p;
    char err[256];
    assert_int_equal(pipe_split_balanced(&L, 2, &p, err, sizeof(err)), 0);
    expect_split(&p, "0-0,1-7"); /* 112896 | 88832; conv+relu would be 119168 */
    assert_int_equal(p.cost[0], 112896);
    assert_int_equal(p.cost[1], 88832);
    /* K=3: the conv alone still bounds it; stage 1 takes relu..dense 784x16
     * (6272 + 6272 + 0 + 75264 = 87808) and can take relu and dropout too (87872),
     * leaving the last dense */
    assert_int_equal(pipe_split_balanced(&L, 3, &p, err, sizeof(err)), 0);
    expect_split(&p, "0-0,1-6,7-7");
    size_t off, n;
    model_layout *Lp = &L;
    pipe_stage_params(Lp, &p, 0, &off, &n);
    assert_int_equal(off, 0);
    assert_int_equal(n, 3 * 3 * 4 + 4);
    pipe_stage_params(Lp, &p, 1, &off, &n);
    assert_int_equal(off, 40);
    assert_int_equal(n, 784 * 16 + 16);
    pipe_stage_params(Lp, &p, 2, &off, &n);
    assert_int_equal(off, 40 + 784 * 16 + 16);
    assert_int_equal(off + n, L.n_params);
    /* a stage without parameters (the relu and the pool): an empty run */
    assert_int_equal(pipe_split_parse(&L, "0-0,1-2,3-7", 3, &p, err, sizeof(err)), 0);
    pipe_stage_params(Lp, &p, 1, &off, &n);
    assert_int_equal(off, 40);
    assert_int_equal(n, 0);
}

/* Layers of given costs: dense layers with in_numel 1 and out_numel c, and
 * parameters: 6c each, but 4c for layer 0 (no input gradient below it). */
static model_layout costs_layout(const uint64_t *c, int n)
{
    model_layout L;
    memset(&L, 0, sizeof(L));
    snprintf(L.spec, sizeof(L.spec), "synthetic");
    L.n_layers = n;
    for (int i = 0; i < n; i++) {
        L.layers[i].kind = LAYER_DENSE;
        L.layers[i].in_numel = 1;
        L.layers[i].out_numel = c[i];
        L.layers[i].w = 2 * i;
        L.layers[i].b = 2 * i + 1;
    }
    return L;
}

static uint64_t synthetic_cost(const uint64_t *c, int i)
{
    return (i ? 6 : 4) * c[i];
}

/* The smallest largest-stage cost over every split of n layers into K, by
 * enumerating the K-1 cut positions. */
static uint64_t brute_best(const uint64_t *c, int n, int K)
{
    uint64_t best = UINT64_MAX;
    int cut[PIPE_MAX_STAGES];
    for (int i = 0; i < K - 1; i++)
        cut[i] = i + 1;
    for (;;) {
        uint64_t worst = 0;
        for (int s = 0; s < K; s++) {
            int a = s ? cut[s - 1] : 0, b = s < K - 1 ? cut[s] : n;
            uint64_t run = 0;
            for (int i = a; i < b; i++)
                run += synthetic_cost(c, i);
            if (run > worst)
                worst = run;
        }
        if (worst < best)
            best = worst;
        int k = K - 2;
        while (k >= 0 && cut[k] == n - (K - 1 - k))
            k--;
        if (k < 0)
            break;
        cut[k]++;
        for (int j = k + 1; j < K - 1; j++)
            cut[j] = cut[j - 1] + 1;
    }
    return best;
}

static void test_the_balanced_split_is_optimal_and_deterministic(void **state)
{
    (void)state;
    srand(12345);
    for (int trial = 0; trial < 400; trial++) {
        int n = 2 + rand() % 11, K = 2 + rand() % (n - 1 < 5 ? n - 1 : 5);
        uint64_t c[16];
        for (int i = 0; i < n; i++)
            c[i] = (uint64_t)(rand() % 4 == 0 ? 0 : 1 + rand() % 1000);
        model_layout L = costs_layout(c, n);
        pipe_plan p, q;
        char err[128];
        assert_int_equal(pipe_split_balanced(&L, K, &p, err, sizeof(err)), 0);
        assert_int_equal(pipe_split_balanced(&L, K, &q, err, sizeof(err)), 0);
        assert_memory_equal(&p, &q, sizeof(p));
        uint64_t worst = 0;
        int at = 0;
        for (int s = 0; s < K; s++) {
            assert_int_equal(p.first[s], at);
            assert_true(p.last[s] >= p.first[s]);
            uint64_t run = 0;
            for (int i = p.first[s]; i <= p.last[s]; i++)
                run += synthetic_cost(c, i);
            assert_int_equal(run, p.cost[s]);
            worst = run > worst ? run : worst;
            at = p.last[s] + 1;
        }
        assert_int_equal(at, n);
        assert_int_equal(worst, brute_best(c, n, K));
    }
}

/* The split balances what is computed. Dense layers 1x3, 1x2, 1x2: 12, 12, 12
 * computed (the first without its input gradient, 4 x 3) where the full
 * estimate says 18, 12, 12: K = 2 splits 0-1 | 2 (24 | 12), which the full
 * estimate would not (30 | 12 against 18 | 24: 0 | 1-2). And a model with a
 * pool at the bottom, pool:2,dense:10: the pool computes its forward only,
 * 14*14*4 = 784 window reads; the flatten 0; the dense 196x10 its forward and
 * kernel gradient, 4*1960 = 7840. */
static void test_the_cost_counts_no_input_gradient_below_the_first_parameters(void **state)
{
    (void)state;
    const uint64_t c[] = {3, 2, 2};
    model_layout L = costs_layout(c, 3);
    assert_int_equal(pipe_layer_cost(&L, 0), 12);
    assert_int_equal(pipe_layer_flops(&L.layers[0]), 18);
    assert_int_equal(pipe_layer_cost(&L, 1), 12);
    assert_int_equal(pipe_layer_cost(&L, 2), 12);
    pipe_plan p;
    char err[256];
    assert_int_equal(pipe_split_balanced(&L, 2, &p, err, sizeof(err)), 0);
    expect_split(&p, "0-1,2-2");
    assert_int_equal(p.cost[0], 24);
    assert_int_equal(p.cost[1], 12);
    model_layout P = layout("pool:2,dense:10");
    assert_int_equal(P.n_layers, 3);
    assert_int_equal(P.layers[0].kind, LAYER_MAXPOOL);
    assert_int_equal(pipe_layer_cost(&P, 0), 784);
    assert_int_equal(pipe_layer_flops(&P.layers[0]), 2 * 784);
    assert_int_equal(pipe_layer_cost(&P, 1), 0);
    assert_int_equal(pipe_layer_cost(&P, 2), 4 * 196 * 10);
}

/* model_layout_range: a stage's layers as a model of their own. For every
 * split of the cnn above and of mlp:32,16 into two ranges, each range has the
 * stage's parameters alone (pipe_stage_params: the whole buffer's run), its
 * tensors the whole one's with offsets from the run's start, its layers the
 * whole one's renumbered, the largest activation of its layers, and its
 * initialization is the whole one's run, float for float. */
static void test_a_range_layout_is_the_stages_part_of_the_whole(void **state)
{
    (void)state;
    const char *specs[] = {"conv:3x3x4,pool:2,dense:16,dropout:0.25,dense:10", "mlp:32,16"};
    char err[256];
    for (int m = 0; m < 2; m++) {
        model_layout L = layout(specs[m]);
        float *whole = malloc(sizeof(float) * L.n_params);
        assert_non_null(whole);
        model_init_params(&L, whole, 7);
        for (int cut = 0; cut + 1 < L.n_layers; cut++) {
            pipe_plan p = {.stages = 2, .first = {0, cut + 1}, .last = {cut, L.n_layers - 1}};
            for (int s = 0; s < 2; s++) {
                size_t off, n;
                pipe_stage_params(&L, &p, s, &off, &n);
                model_layout R;
                assert_int_equal(model_layout_range(&L, p.first[s], p.last[s], &R, err, sizeof(err)), 0);
                assert_int_equal(R.n_layers, p.last[s] - p.first[s] + 1);
                assert_int_equal(R.n_params, n);
                assert_int_equal(R.range_offset, off);
                assert_int_equal(R.range_first, p.first[s]);
                assert_int_equal(R.n_in, L.layers[p.first[s]].in_numel);
                size_t act = 0;
                for (int i = p.first[s]; i <= p.last[s]; i++) {
                    const model_layer *a = &L.layers[i], *b = &R.layers[i - p.first[s]];
                    assert_int_equal(a->kind, b->kind);
                    assert_int_equal(a->in_numel, b->in_numel);
                    assert_int_equal(a->out_numel, b->out_numel);
                    assert_int_equal(a->dropout_index, b->dropout_index);
                    assert_int_equal(a->w < 0, b->w < 0);
                    if (a->w >= 0) {
                        assert_string_equal(L.tensors[a->w].name, R.tensors[b->w].name);
                        assert_int_equal(L.tensors[a->w].offset - off, R.tensors[b->w].offset);
                        assert_int_equal(L.tensors[a->b].offset - off, R.tensors[b->b].offset);
                        assert_int_equal(R.tensors[b->w].layer, i - p.first[s]);
                    }
                    act = a->in_numel > act ? a->in_numel : act;
                    act = a->out_numel > act ? a->out_numel : act;
                }
                assert_int_equal(R.max_act, act);
                float *part = malloc(sizeof(float) * (n ? n : 1));
                assert_non_null(part);
                model_init_params(&R, part, 7);
                assert_memory_equal(part, whole + off, sizeof(float) * n);
                free(part);
            }
        }
        model_layout R;
        assert_int_equal(model_layout_range(&L, 2, 1, &R, err, sizeof(err)), -1);
        assert_int_equal(model_layout_range(&L, 0, L.n_layers, &R, err, sizeof(err)), -1);
        assert_int_equal(model_layout_range(&L, -1, 0, &R, err, sizeof(err)), -1);
        free(whole);
    }
}

static void test_stage_layers_and_its_refusals(void **state)
{
    (void)state;
    model_layout L = layout("mlp:32,16");
    pipe_plan p;
    char err[256];
    assert_int_equal(pipe_split_parse(&L, "0-2,3-5", 2, &p, err, sizeof(err)), 0);
    expect_split(&p, "0-2,3-5");
    assert_int_equal(p.cost[0], 100352 + 64);
    assert_int_equal(pipe_split_parse(&L, "0,1-4,5", 3, &p, err, sizeof(err)), 0);
    expect_split(&p, "0-0,1-4,5-5");
    static const struct {
        const char *s;
        int K;
        const char *says;
    } bad[] = {
        {"", 2, "empty"},
        {"0-1,3-5", 2, "'3-5' starts at layer 3, not 2"},
        {"1-2,3-5", 2, "'1-2' starts at layer 1, not 0"},
        {"0-1,2-6", 2, "'2-6' goes past the last layer, 5"},
        {"0-1,2-4", 2, "ends at layer 4"},
        {"0-1,2-5", 3, "has 2 ranges, --pipeline_stages=3"},
        {"0-0,1-1,2-5", 2, "more than 2 ranges"},
        {"0-x,1-5", 2, "'0-x' is not a layer range"},
        {"2-1,2-5", 2, "'2-1' ends before it starts"},
        {"0-1,,2-5", 2, "'' is not a layer range"},
        {"0-1,2-5,", 2, "'' is not a layer range"},
        {"-1-1,2-5", 2, "'-1-1' is not a layer range"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = 0;
        assert_int_equal(pipe_split_parse(&L, bad[i].s, bad[i].K, &p, err, sizeof(err)), -1);
        if (!strstr(err, bad[i].says))
            fail_msg("'%s': got '%s', want it to say '%s'", bad[i].s, err, bad[i].says);
    }
}

static void test_the_grid_rule(void **state)
{
    (void)state;
    pipe_grid g;
    char err[256];
    /* 6 tasks, K = 3: task i is stage i % 3 of replica i / 3 */
    for (int i = 0; i < 6; i++) {
        assert_int_equal(pipe_grid_place(6, 3, i, &g, err, sizeof(err)), 0);
        assert_int_equal(g.stages, 3);
        assert_int_equal(g.replicas, 2);
        assert_int_equal(g.stage, i % 3);
        assert_int_equal(g.replica, i / 3);
        assert_int_equal(pipe_grid_task(&g, g.stage, g.replica), i);
    }
    assert_int_equal(pipe_grid_place(6, 3, 0, &g, err, sizeof(err)), 0);
    assert_int_equal(g.stage, 0); /* the chief: stage 0 of replica 0 */
    assert_int_equal(pipe_grid_place(5, 2, 0, &g, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "5 training tasks"));
    assert_int_equal(pipe_grid_place(2, 3, 0, &g, err, sizeof(err)), -1);
    assert_int_equal(pipe_grid_place(4, 2, 4, &g, err, sizeof(err)), -1);
}

/* ---- the tables ---- */

/* Run the K tables with blocking receives and buffered sends: stage s starts
 * its next op when it is free and the op's input has arrived (F(j), s > 0:
 * stage s-1's F(j) done; B(j), s < K-1: stage s+1's B(j) done; the last
 * stage's B(j): its own F(j)). Ops take tf and tb. 0 and the makespan and
 * each stage's busy time, or -1 on a deadlock (no stage can go on). */
static int simulate(const pipe_slot *table, int K, int M, int tf, int tb, int *makespan, int *busy)
{
    int n = 2 * M, pc[PIPE_MAX_STAGES] = {0}, freeat[PIPE_MAX_STAGES] = {0};
    int fdone[PIPE_MAX_STAGES][PIPE_MAX_MICRO], bdone[PIPE_MAX_STAGES][PIPE_MAX_MICRO];
    for (int s = 0; s < K; s++)
        for (int j = 0; j < M; j++)
            fdone[s][j] = bdone[s][j] = -1;
    int left = K * n;
    while (left > 0) {
        int progressed = 0;
        for (int s = 0; s < K; s++) {
            while (pc[s] < n) {
                const pipe_slot *t = &table[s * n + pc[s]];
                int dep;
                if (t->op == PIPE_FWD)
                    dep = s == 0 ? 0 : fdone[s - 1][t->mb];
                else
                    dep = s == K - 1 ? fdone[s][t->mb] : bdone[s + 1][t->mb];
                if (dep < 0)
                    break; /* blocked on a receive */
                int start = freeat[s] > dep ? freeat[s] : dep;
                int end = start + (t->op == PIPE_FWD ? tf : tb);
                if (t->op == PIPE_FWD)
                    fdone[s][t->mb] = end;
                else
                    bdone[s][t->mb] = end;
                busy[s] += end - start;
                freeat[s] = end;
                pc[s]++;
                left--;
                progressed = 1;
            }
        }
        if (!progressed)
            return -1;
    }
    *makespan = 0;
    for (int s = 0; s < K; s++)
        *makespan = freeat[s] > *makespan ? freeat[s] : *makespan;
    return 0;
}

static void test_tables_are_well_formed(void **state)
{
    (void)state;
    for (int kind = PIPE_GPIPE; kind <= PIPE_1F1B; kind++)
        for (int K = 2; K <= 8; K++)
            for (int M = 1; M <= 16; M++) {
                pipe_schedule s;
                char err[128];
                assert_int_equal(pipe_schedule_build(&s, (pipe_schedule_kind)kind, K, M, err, sizeof(err)), 0);
                assert_int_equal(s.n, 2 * M);
                for (int st = 0; st < K; st++) {
                    int fseen[PIPE_MAX_MICRO] = {0}, bseen[PIPE_MAX_MICRO] = {0}, live = 0, most = 0;
                    for (int i = 0; i < s.n; i++) {
                        const pipe_slot *t = pipe_schedule_at(&s, st, i);
                        assert_true(t->mb >= 0 && t->mb < M);
                        if (t->op == PIPE_FWD) {
                            assert_int_equal(fseen[t->mb]++, 0);
                            live++;
                        } else {
                            assert_int_equal(fseen[t->mb], 1); /* its forward came first */
                            assert_int_equal(bseen[t->mb]++, 0);
                            live--;
                        }
                        most = live > most ? live : most;
                    }
                    assert_int_equal(most, s.max_inflight[st]);
                    if (kind == PIPE_GPIPE)
                        assert_int_equal(most, M);
                    else
                        assert_true(most <= K - st && most <= M); /* 1f1b's bound */
                }
                pipe_schedule_free(&s);
            }
}

static void test_tables_run_without_deadlock_and_meet_the_fill_drain_bound(void **state)
{
    (void)state;
    for (int kind = PIPE_GPIPE; kind <= PIPE_1F1B; kind++)
        for (int K = 2; K <= 8; K++)
            for (int M = 1; M <= 16; M++) {
                pipe_schedule s;
                char err[128];
                assert_int_equal(pipe_schedule_build(&s, (pipe_schedule_kind)kind, K, M, err, sizeof(err)), 0);
                int span, busy[PIPE_MAX_STAGES] = {0};
                /* unit-time ops: the fill-drain time 2(M + K - 1) */
                assert_int_equal(simulate(s.slot, K, M, 1, 1, &span, busy), 0);
                assert_int_equal(span, 2 * (M + K - 1));
                for (int st = 0; st < K; st++) {
                    assert_int_equal(busy[st], 2 * M);
                    /* idle fraction (span - 2M) / span == (K-1)/(M+K-1) */
                    assert_int_equal((int64_t)(span - busy[st]) * (M + K - 1),
                                         (int64_t)(K - 1) * span);
                }
                /* backward twice the forward: still no deadlock */
                int busy2[PIPE_MAX_STAGES] = {0};
                assert_int_equal(simulate(s.slot, K, M, 1, 2, &span, busy2), 0);
                pipe_schedule_free(&s);
            }
}

static void test_a_wrong_table_deadlocks_in_the_simulation(void **state)
{
    (void)state;
    /* stage 0 waits for B0 before sending F1; stage 1 wants F1 first */
    const pipe_slot t[] = {{PIPE_FWD, 0}, {PIPE_BWD, 0}, {PIPE_FWD, 1}, {PIPE_BWD, 1},
                           {PIPE_FWD, 1}, {PIPE_FWD, 0}, {PIPE_BWD, 0}, {PIPE_BWD, 1}};
    int span, busy[PIPE_MAX_STAGES] = {0};
    assert_int_equal(simulate(t, 2, 2, 1, 1, &span, busy), -1);
}

static void test_schedule_names_and_format(void **state)
{
    (void)state;
    pipe_schedule_kind k;
    assert_int_equal(pipe_schedule_from_name("gpipe", &k), 0);
    assert_int_equal(k, PIPE_GPIPE);
    assert_int_equal(pipe_schedule_from_name("1f1b", &k), 0);
    assert_int_equal(k, PIPE_1F1B);
    assert_int_equal(pipe_schedule_from_name("1F1B", &k), -1);
    pipe_schedule s;
    char err[128], buf[256];
    assert_int_equal(pipe_schedule_build(&s, PIPE_1F1B, 3, 4, err, sizeof(err)), 0);
    pipe_schedule_format(&s, 0, buf, sizeof(buf));
    assert_string_equal(buf, "F0 F1 F2 B0 F3 B1 B2 B3");
    pipe_schedule_format(&s, 1, buf, sizeof(buf));
    assert_string_equal(buf, "F0 F1 B0 F2 B1 F3 B2 B3");
    pipe_schedule_format(&s, 2, buf, sizeof(buf));
    assert_string_equal(buf, "F0 B0 F1 B1 F2 B2 F3 B3");
    pipe_schedule_free(&s);
    assert_int_equal(pipe_schedule_build(&s, PIPE_GPIPE, 2, 3, err, sizeof(err)), 0);
    pipe_schedule_format(&s, 1, buf, sizeof(buf));
    assert_string_equal(buf, "F0 F1 F2 B0 B1 B2");
    pipe_schedule_free(&s);
    assert_int_equal(pipe_schedule_build(&s, PIPE_GPIPE, 2, 0, err, sizeof(err)), -1);
    assert_int_equal(pipe_schedule_build(&s, PIPE_GPIPE, 9, 2, err, sizeof(err)), -1);
    assert_int_equal(pipe_schedule_build(&s, PIPE_GPIPE, 2, PIPE_MAX_MICRO + 1, err, sizeof(err)), -1);
}

/* ---- the receive buffer ---- */

static void test_mailbox_refusals_leave_nothing(void **state)
{
    (void)state;
    size_t params[3] = {0, 5, 7};
    pipe_mailbox *m = pipe_mailbox_new(2, 4, 3, 3, params, 1, 0);
    assert_non_null(m);
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, got[8];
    char msg[256];
    pipe_mailbox_set_step(m, 10);
    pipe_key k = {10, 1, PIPE_ACT};
    assert_int_equal(pipe_mailbox_check(m, &k, 4, msg, sizeof(msg)), 0);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){10, 2, PIPE_ACT}, a, 4, 0, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){10, -1, PIPE_ACT}, a, 4, 0, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){9, 1, PIPE_ACT}, a, 4, 0, msg, sizeof(msg)), 409);
    assert_non_null(strstr(msg, "step 9"));
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){12, 1, PIPE_ACT}, a, 4, 0, msg, sizeof(msg)), 409);
    assert_int_equal(pipe_mailbox_put(m, &k, a, 3, 0, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_put(m, &k, a, 5, 0, msg, sizeof(msg)), 413);
    /* parameters wait until stage 0 freed its training buffers: 503, then taken */
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){10, 1, PIPE_PARAMS}, a, 5, 0, msg, sizeof(msg)), 503);
    assert_non_null(strstr(msg, "retry"));
    assert_int_equal(pipe_mailbox_pending(m), 0);
    pipe_mailbox_open_params(m);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){10, 1, PIPE_PARAMS}, a, 5, 0, msg, sizeof(msg)), 0);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){10, 0, PIPE_PARAMS}, a, 0, 0, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){10, 3, PIPE_PARAMS}, a, 0, 0, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_pending(m), 1);
    /* accepted: this step and the next; a duplicate, before or after the take */
    assert_int_equal(pipe_mailbox_put(m, &k, a, 4, 0, msg, sizeof(msg)), 0);
    assert_int_equal(pipe_mailbox_put(m, &k, a + 4, 4, 0, msg, sizeof(msg)), 409);
    assert_non_null(strstr(msg, "duplicate"));
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){11, 1, PIPE_ACT}, a + 4, 4, 7700, msg, sizeof(msg)), 0);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){11, 0, PIPE_GRAD}, a + 1, 3, 0, msg, sizeof(msg)), 0);
    assert_int_equal(pipe_mailbox_pending(m), 4);
    assert_int_equal(pipe_mailbox_take(m, &k, got, NULL, clk_mono_secs() + 1, NULL), 0);
    assert_memory_equal(got, a, 4 * sizeof(float));
    assert_int_equal(pipe_mailbox_put(m, &k, a, 4, 0, msg, sizeof(msg)), 409);
    pipe_mailbox_set_step(m, 11);
    int64_t tag = -1;
    assert_int_equal(pipe_mailbox_take(m, &(pipe_key){11, 1, PIPE_ACT}, got, &tag, clk_mono_secs() + 1, NULL), 0);
    assert_int_equal(tag, 7700);
    assert_memory_equal(got, a + 4, 4 * sizeof(float));
    assert_int_equal(pipe_mailbox_take(m, &(pipe_key){11, 0, PIPE_GRAD}, got, NULL, clk_mono_secs() + 1, NULL), 0);
    assert_memory_equal(got, a + 1, 3 * sizeof(float));
    assert_int_equal(pipe_mailbox_take(m, &(pipe_key){10, 1, PIPE_PARAMS}, got, NULL, clk_mono_secs() + 1, NULL), 0);
    assert_memory_equal(got, a, 5 * sizeof(float));
    /* step 12 reuses step 10's slots */
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){12, 1, PIPE_ACT}, a, 4, 0, msg, sizeof(msg)), 0);
    assert_int_equal(pipe_mailbox_pending(m), 1);
    pipe_mailbox_free(m);
    /* the last stage takes no gradients, stage 0 no activations and no parameters elsewhere */
    m = pipe_mailbox_new(2, 0, 3, 3, NULL, 1, 0);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){0, 0, PIPE_ACT}, a, 0, 0, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){0, 1, PIPE_PARAMS}, a, 5, 0, msg, sizeof(msg)), 400);
    /* one replica takes no gradient sums; three take them from replicas 0..2, two steps at once */
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){0, 0, PIPE_REDUCE}, a, 3, 0, msg, sizeof(msg)), 400);
    pipe_mailbox_free(m);
    m = pipe_mailbox_new(2, 0, 3, 3, NULL, 3, 5);
    pipe_mailbox_set_step(m, 4);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){4, 3, PIPE_REDUCE}, a, 5, 0, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){4, 2, PIPE_REDUCE}, a, 4, 0, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){4, 2, PIPE_REDUCE}, a, 6, 0, msg, sizeof(msg)), 413);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){4, 2, PIPE_REDUCE}, a, 5, 0, msg, sizeof(msg)), 0);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){5, 2, PIPE_REDUCE}, a + 1, 5, 0, msg, sizeof(msg)), 0);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){4, 2, PIPE_REDUCE}, a, 5, 0, msg, sizeof(msg)), 409);
    assert_int_equal(pipe_mailbox_put(m, &(pipe_key){6, 2, PIPE_REDUCE}, a, 5, 0, msg, sizeof(msg)), 409);
    assert_int_equal(pipe_mailbox_take(m, &(pipe_key){4, 2, PIPE_REDUCE}, got, NULL, clk_mono_secs() + 1, NULL), 0);
    assert_memory_equal(got, a, 5 * sizeof(float));
    assert_int_equal(pipe_mailbox_take(m, &(pipe_key){5, 2, PIPE_REDUCE}, got, NULL, clk_mono_secs() + 1, NULL), 0);
    assert_memory_equal(got, a + 1, 5 * sizeof(float));
    assert_int_equal(pipe_mailbox_pending(m), 0);
    pipe_mailbox_free(m);
}

typedef struct late {
    pipe_mailbox *m;
    float v[4];
} late;

static void *put_later(void *arg)
{
    late *l = arg;
    char msg[128];
    usleep(100 * 1000);
    pipe_mailbox_put(l->m, &(pipe_key){0, 0, PIPE_GRAD}, l->v, 4, 0, msg, sizeof(msg));
    return NULL;
}

static void test_mailbox_take_waits_until_the_deadline(void **state)
{
    (void)state;
    pipe_mailbox *m = pipe_mailbox_new(1, 4, 4, 2, NULL, 1, 0);
    float got[4];
    double t0 = clk_mono_secs();
    assert_int_equal(pipe_mailbox_take(m, &(pipe_key){0, 0, PIPE_ACT}, got, NULL, t0 + 0.2, NULL), -1);
    double waited = clk_mono_secs() - t0;
    assert_true(waited >= 0.19 && waited < 5);
    late l = {m, {9, 8, 7, 6}};
    pthread_t th;
    pthread_create(&th, NULL, put_later, &l);
    assert_int_equal(pipe_mailbox_take(m, &(pipe_key){0, 0, PIPE_GRAD}, got, NULL, clk_mono_secs() + 10, NULL), 0);
    pthread_join(th, NULL);
    assert_memory_equal(got, l.v, sizeof(got));
    pipe_mailbox_free(m);
}

/* The ring between R replicas in one process: each thread is a replica
 * with its own mailbox, and a send puts the chunk straight into the right
 * neighbour's (what the link's HTTP thread does). */
typedef struct ring_peer {
    pipe_mailbox *box[PIPE_MAX_REPLICAS];
    int R, r, rc, drop_at; /* drop_at >= 0: replica 0 never sends that ring step */
    size_t n;
    float *buf, *tmp;
} ring_peer;

static int ring_put(void *ctx, int to, const pipe_key *k, const float *data, size_t n, double wait, char *err,
                    size_t errlen)
{
    (void)wait;
    ring_peer *p = ctx;
    if (p->r == 0 && k->mb == p->drop_at)
        return 0;
    unsigned st = pipe_mailbox_put(p->box[to], k, data, n, 0, err, errlen);
    return st ? -1 : 0;
}

static void *ring_run(void *arg)
{
    ring_peer *p = arg;
    double idle = 0;
    int t = -1;
    char err[256];
    for (int64_t step = 0; step < 3 && p->rc == 0; step++) {
        pipe_mailbox_set_step(p->box[p->r], step);
        p->rc = pipe_ring_allreduce(ring_put, p, p->box[p->r], p->R, p->r, step, p->buf + (size_t)step * p->n, p->n,
                                    p->tmp, p->drop_at >= 0 ? 0.3 : 10, NULL, &idle, &t, err, sizeof(err));
    }
    if (p->rc == -1)
        p->rc = -100 - t; /* which ring step it waited for */
    return NULL;
}

static void test_the_ring_sums_every_chunk_to_the_same_floats_on_every_replica(void **state)
{
    (void)state;
    /* the chunks tile the buffer, each replica sends and receives each once a phase */
    for (int R = 2; R <= PIPE_MAX_REPLICAS; R++) {
        assert_int_equal(ring_steps(R), 2 * (R - 1));
        for (size_t n = 0; n < 40; n += 13) {
            size_t at = 0, off;
            for (int c = 0; c < R; c++) {
                size_t len = ring_chunk(n, R, c, &off);
                assert_int_equal(off, at);
                assert_true(len + 1 >= n / (size_t)R && len <= n / (size_t)R + 1);
                at += len;
            }
            assert_int_equal(at, n);
        }
        for (int r = 0; r < R; r++) {
            int sent[PIPE_MAX_REPLICAS] = {0}, got[PIPE_MAX_REPLICAS] = {0};
            for (int t = 0; t < R - 1; t++) {
                sent[ring_send_chunk(R, r, t)]++;
                got[ring_recv_chunk(R, r, t)]++;
            }
            /* the reduce-scatter: every chunk but one's own arrives, the last being r + 1 (summed
             * here); every chunk but that one leaves */
            for (int c = 0; c < R; c++) {
                assert_int_equal(got[c], c != r);
                assert_int_equal(sent[c], c != (r + 1) % R);
            }
            assert_int_equal(ring_recv_chunk(R, r, R - 2), (r + 1) % R);
            /* the all-gather starts with the chunk summed here */
            assert_int_equal(ring_send_chunk(R, r, R - 1), (r + 1) % R);
        }
    }
    for (int R = 2; R <= PIPE_MAX_REPLICAS; R++)
        for (size_t n = 1; n <= 301; n += 100) {
            ring_peer p[PIPE_MAX_REPLICAS];
            pthread_t th[PIPE_MAX_REPLICAS];
            for (int r = 0; r < R; r++) {
                p[0].box[r] = pipe_mailbox_new(1, 0, 0, 2, NULL, R, n);
                assert_non_null(p[0].box[r]);
                pipe_mailbox_set_ring(p[0].box[r], r);
            }
            for (int r = 0; r < R; r++) {
                p[r] = p[0];
                p[r].R = R, p[r].r = r, p[r].rc = 0, p[r].drop_at = -1, p[r].n = n;
                p[r].buf = malloc(sizeof(float) * n * 3);
                p[r].tmp = malloc(sizeof(float) * (n / (size_t)R + 1));
                for (size_t u = 0; u < n * 3; u++) /* values whose float sum depends on the order */
                    p[r].buf[u] = (float)((double)((u * 7919 + (size_t)r * 104729) % 1000) / 997.0 - 0.5) *
                                  (r % 2 ? 1e-3f : 1.0f);
            }
            double want[3 * 301];
            for (size_t u = 0; u < n * 3; u++) {
                want[u] = 0;
                for (int r = 0; r < R; r++)
                    want[u] += p[r].buf[u];
            }
            for (int r = 0; r < R; r++)
                assert_int_equal(pthread_create(&th[r], NULL, ring_run, &p[r]), 0);
            for (int r = 0; r < R; r++)
                pthread_join(th[r], NULL);
            for (int r = 0; r < R; r++) {
                assert_int_equal(p[r].rc, 0);
                assert_memory_equal(p[r].buf, p[0].buf, sizeof(float) * n * 3); /* bit for bit */
            }
            for (size_t u = 0; u < n * 3; u++)
                assert_true(fabs(p[0].buf[u] - want[u]) <= 1e-6 * (1 + fabs(want[u])));
            for (int r = 0; r < R; r++) {
                free(p[r].buf);
                free(p[r].tmp);
                pipe_mailbox_free(p[0].box[r]);
            }
        }
}

static void test_a_ring_chunk_that_never_comes_times_out_naming_its_step(void **state)
{
    (void)state;
    const int R = 3;
    const size_t n = 30;
    ring_peer p[3];
    pthread_t th[3];
    char msg[256];
    for (int r = 0; r < R; r++) {
        p[0].box[r] = pipe_mailbox_new(1, 0, 0, 2, NULL, R, n);
        pipe_mailbox_set_ring(p[0].box[r], r);
    }
    /* a box without the ring takes no ring chunk, one with it no whole sum, nor a step past the ring's */
    pipe_mailbox *plain = pipe_mailbox_new(1, 0, 0, 2, NULL, R, n);
    assert_int_equal(pipe_mailbox_check(plain, &(pipe_key){0, 0, PIPE_RING}, 10, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_check(p[0].box[1], &(pipe_key){0, 0, PIPE_REDUCE}, n, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_check(p[0].box[1], &(pipe_key){0, 4, PIPE_RING}, 10, msg, sizeof(msg)), 400);
    assert_int_equal(pipe_mailbox_check(p[0].box[1], &(pipe_key){0, 0, PIPE_RING}, 11, msg, sizeof(msg)), 413);
    assert_int_equal(pipe_mailbox_check(p[0].box[1], &(pipe_key){0, 0, PIPE_RING}, 10, msg, sizeof(msg)), 0);
    pipe_mailbox_free(plain);
    for (int r = 0; r < R; r++) {
        p[r] = p[0];
        p[r].R = R, p[r].r = r, p[r].rc = 0, p[r].drop_at = 1, p[r].n = n;
        p[r].buf = calloc(n * 3, sizeof(float));
        p[r].tmp = calloc(n / R + 1, sizeof(float));
        assert_int_equal(pthread_create(&th[r], NULL, ring_run, &p[r]), 0);
    }
    for (int r = 0; r < R; r++)
        pthread_join(th[r], NULL);
    /* replica 0 drops its ring step 1: replica 1 waits for it; the others then for what 1 would pass on */
    assert_int_equal(p[1].rc, -100 - 1);
    assert_true(p[2].rc <= -100 - 1);
    assert_true(p[0].rc <= -100 - 1);
    for (int r = 0; r < R; r++) {
        free(p[r].buf);
        free(p[r].tmp);
        pipe_mailbox_free(p[0].box[r]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flops_and_split_of_the_mlp),
        cmocka_unit_test(test_flops_and_split_of_a_cnn),
        cmocka_unit_test(test_the_cost_counts_no_input_gradient_below_the_first_parameters),
        cmocka_unit_test(test_a_range_layout_is_the_stages_part_of_the_whole),
        cmocka_unit_test(test_the_balanced_split_is_optimal_and_deterministic),
        cmocka_unit_test(test_stage_layers_and_its_refusals),
        cmocka_unit_test(test_the_grid_rule),
        cmocka_unit_test(test_tables_are_well_formed),
        cmocka_unit_test(test_tables_run_without_deadlock_and_meet_the_fill_drain_bound),
        cmocka_unit_test(test_a_wrong_table_deadlocks_in_the_simulation),
        cmocka_unit_test(test_schedule_names_and_format),
        cmocka_unit_test(test_mailbox_refusals_leave_nothing),
        cmocka_unit_test(test_mailbox_take_waits_until_the_deadline),
        cmocka_unit_test(test_the_ring_sums_every_chunk_to_the_same_floats_on_every_replica),
        cmocka_unit_test(test_a_ring_chunk_that_never_comes_times_out_naming_its_step),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
