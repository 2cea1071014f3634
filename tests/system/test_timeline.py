"""The step timeline (issue 33, part 5): each workerd reports, with its
heartbeat, when its steps pulled, waited (and for what), computed and pushed;
psd's GET /v1/timeline gives them back on its own clock. Checked against what
the job is made to do: a worker slowed by --step_delay_ms computes that long,
and the other's sync pull waits about as long for the step's gradients; spans
follow each other; the heartbeat's timeline is checked whole (a bad span is
400, nothing of it kept). The page's panel is tested in the real browser
(test_browser.py)."""
import json
import subprocess

import pytest

from conftest import binary, http
from procs import finish, free_port, kill_all

DELAY_MS = 30


def get_timeline(url, secs=10):
    st, _, body = http("GET", f"{url}/v1/timeline?secs={secs}")
    assert st == 200, body
    return json.loads(body)


def test_a_sync_job_reports_its_steps_and_the_fast_worker_waits_for_the_slow_one(tmp_path):
    ps, w0, w1 = (free_port() for _ in range(3))
    cluster = [f"--ps_hosts=127.0.0.1:{ps}", f"--worker_hosts=127.0.0.1:{w0},127.0.0.1:{w1}"]
    url = f"http://127.0.0.1:{ps}"
    train = ["--sync=1", "--hidden_units=16", "--batch_size=20", "--train_steps=150", "--log_every=0"]
    procs = [subprocess.Popen([binary("psd"), "--job_name=ps", "--task_index=0", *cluster, "--logdir="],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
    try:
        procs.append(subprocess.Popen([binary("workerd"), "--task_index=1", *cluster, *train,
                                       f"--step_delay_ms={DELAY_MS}"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([binary("workerd"), "--task_index=0", *cluster, *train, "--keep_ps"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for p in procs[1:]:
            rc, out = finish(p, timeout=120)
            assert rc == 0, out[-2000:]
        t = get_timeline(url, secs=600)
    finally:
        kill_all(procs)
    by = {w["worker"]: w["spans"] for w in t["workers"]}
    assert set(by) == {0, 1}, t
    for w, spans in by.items():
        assert {s["kind"] for s in spans} >= {"pull", "compute", "push"}, (w, spans[:8])
        # one after the other, each on the ps's clock, none in the future; spans of different
        # heartbeats are anchored at their arrivals, whose delays differ by a few ms under load
        slack = 0.05
        for a, b in zip(spans, spans[1:]):
            assert a["start"] <= a["end"] <= b["start"] + slack, (w, a, b)
        assert spans[-1]["end"] <= t["now"] + slack
        steps = [s["step"] for s in spans]
        assert steps == sorted(steps), w
    mid = lambda spans, kind: sorted(s["end"] - s["start"] for s in spans if s["kind"] == kind)  # noqa: E731
    slow = mid(by[1], "compute")
    assert slow and slow[len(slow) // 2] >= DELAY_MS / 1000, slow[:5]  # the delay is in its compute
    fast = mid(by[0], "compute")
    assert fast[len(fast) // 2] < DELAY_MS / 1000 / 2, fast[:5]
    waits = [s for s in by[0] if s["kind"] == "wait"]
    # worker 0's pull waits for worker 1's gradient most steps, about one slow compute long
    assert len(waits) >= len([s for s in by[0] if s["kind"] == "pull"]) // 2, by[0][:12]
    assert all(s["for"] == "the step's gradients" for s in waits)
    w = sorted(s["end"] - s["start"] for s in waits)
    assert DELAY_MS / 1000 / 2 <= w[len(w) // 2] <= DELAY_MS / 1000 * 3, w
    print(f"\nworker 1 computes {slow[len(slow) // 2] * 1e3:.1f} ms (delay {DELAY_MS} ms); worker 0 waits "
          f"{w[len(w) // 2] * 1e3:.1f} ms a step for the step's gradients ({len(waits)} waits)")


def test_the_heartbeats_timeline_is_checked_whole(start_psd):
    p = start_psd()
    st, _, body = http("PUT", p.url + "/v1/config",
                       json.dumps({"optimizer": "sgd", "learning_rate": 0.1, "sync": True, "workers": 2}).encode(),
                       {"Content-Type": "application/json"})
    assert st == 200, body

    def beat(worker, spans):
        return http("POST", p.url + "/v1/heartbeat", json.dumps({"worker": worker, "timeline": spans}).encode(),
                    {"Content-Type": "application/json"})
    good = [["pull", 3, -50.0, -40.0], ["wait", 3, -40, -20, "the step's gradients"], ["compute", 3, -20, -5],
            ["push", 3, -5, 0]]
    assert beat(1, good)[0] == 200
    t = get_timeline(p.url)
    assert [w["worker"] for w in t["workers"]] == [1]
    spans = t["workers"][0]["spans"]
    assert [s["kind"] for s in spans] == ["pull", "wait", "compute", "push"]
    assert spans[1]["for"] == "the step's gradients" and "for" not in spans[0]
    assert abs((spans[0]["end"] - spans[0]["start"]) - 0.010) < 1e-5
    assert 0 <= t["now"] - spans[3]["end"] < 5
    bad = [([["sleep", 1, -2, -1]], "kind"), ([["pull", -1, -2, -1]], "step"), ([["pull", 1, -1, -2]], "start_ms"),
           ([["pull", 1, -1, 5]], "start_ms"), ([["pull", 1, -700000, -1]], "start_ms"),
           ([["pull", 1, "-2", -1]], "numbers"), ([["pull", 1, -2]], "must be"),
           ([["wait", 1, -2, -1, "x" * 48]], "47 bytes"), ([["wait", 1, -2, -1, "a\nb"]], "control"),
           ([["pull", 2 ** 60, -2, -1]], "step"), ("nope", "array"), ([["pull", 1, -2, -1]] * 1025, "at most 1024")]
    for spans, words in bad:
        # a good span first: the bad one after it refuses the whole heartbeat
        st, _, body = beat(0, good[:1] + spans if isinstance(spans, list) else spans)
        assert st == 400 and words in json.loads(body)["error"], (str(spans)[:80], body)
    # nothing of a refused heartbeat was kept (worker 0 has no span), and a worker past the run's is not kept
    assert beat(2, good)[0] == 200
    assert [w["worker"] for w in get_timeline(p.url)["workers"]] == [1]
    st, _, body = http("GET", p.url + "/v1/timeline?secs=0")
    assert st == 400, body
    st, _, body = http("GET", p.url + "/v1/timeline?secs=601")
    assert st == 400, body


@pytest.mark.parametrize("secs,seen", [(1, 0), (10, 4)])
def test_the_window_keeps_what_ended_within_it(start_psd, secs, seen):
    p = start_psd()
    st, _, _ = http("PUT", p.url + "/v1/config",
                    json.dumps({"optimizer": "sgd", "learning_rate": 0.1, "sync": True, "workers": 1}).encode(),
                    {"Content-Type": "application/json"})
    assert st == 200
    old = [["pull", 1, -5000, -4000], ["compute", 1, -4000, -3000], ["push", 1, -3000, -2500],
           ["pull", 2, -2500, -2000]]
    st, _, body = http("POST", p.url + "/v1/heartbeat", json.dumps({"worker": 0, "timeline": old}).encode(),
                       {"Content-Type": "application/json"})
    assert st == 200, body
    t = get_timeline(p.url, secs)
    assert sum(len(w["spans"]) for w in t["workers"]) == seen, t
