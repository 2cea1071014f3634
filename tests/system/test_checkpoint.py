"""Checkpoints of a ps shard (issue 5): the file format read back by an
independent reader (ckpt_check.py: hand-written safetensors parsing, CRC-32C
from python3-crcmod), the optimizer state checked against numpy's Adam,
restore at start, fallback past corrupt files, atomic writes, the folder of
checkpoints, save failures on a full and on a read-only filesystem,
GET/POST /v1/checkpoint with curl, and a clean stop that saves."""
import glob
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

import ckpt_check
from conftest import Psd, binary, curl, http

W = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
B = np.array([0.5, -1.0], dtype=np.float32)
ADAM = {"optimizer": "adam", "learning_rate": 0.1}


def put(url, name, arr):
    shape = ",".join(map(str, arr.shape))
    st, _, body = http("PUT", f"{url}/v1/vars/{name}", arr.astype("<f4").tobytes(), {"X-Shape": shape})
    assert st in (200, 201), body


def grad(url, name, g):
    st, _, body = http("POST", f"{url}/v1/vars/{name}/grad", g.astype("<f4").tobytes())
    assert st == 200, body
    return json.loads(body)["global_step"]


def status(url):
    st, _, body = http("GET", url + "/v1/status")
    assert st == 200, body
    return json.loads(body)


def raw(url, name):
    st, _, body = http("GET", f"{url}/v1/vars/{name}")
    assert st == 200, body
    return np.frombuffer(body, "<f4")


def save(url):
    st, _, body = http("POST", url + "/v1/checkpoint")
    assert st == 200, body
    return json.loads(body)


class NumpyAdam:
    """TensorFlow's Adam (beta1 0.9, beta2 0.999, epsilon 1e-8), in float32."""

    def __init__(self, w, lr):
        self.w, self.lr = w.astype(np.float32).copy(), np.float32(lr)
        self.m = np.zeros_like(self.w)
        self.v = np.zeros_like(self.w)
        self.t = 0

    def step(self, g):
        b1, b2, eps = np.float32(0.9), np.float32(0.999), np.float32(1e-8)
        self.t += 1
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        lr_t = self.lr * np.float32(np.sqrt(1 - 0.999 ** self.t) / (1 - 0.9 ** self.t))
        self.w = self.w - lr_t * self.m / (np.sqrt(self.v) + eps)


def grads(k):
    rng = np.random.default_rng(k)
    return rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(2).astype(np.float32)


def test_checkpoint_holds_variables_and_adam_state_and_restores(start_psd, tmp_path):
    logdir = str(tmp_path / "logs")
    p = start_psd(f"--logdir={logdir}")
    put(p.url, "w", W)
    put(p.url, "b", B)
    st, _, body = http("PUT", p.url + "/v1/config", json.dumps(ADAM).encode())
    assert st == 200, body
    ref_w, ref_b = NumpyAdam(W, 0.1), NumpyAdam(B, 0.1)
    for k in range(3):
        gw, gb = grads(k)
        grad(p.url, "w", gw)
        grad(p.url, "b", gb)
        ref_w.step(gw)
        ref_b.step(gb)
    got = save(p.url)
    assert got["global_step"] == 6 and got["file"] == "model.ckpt-6.safetensors"
    path = os.path.join(logdir, "ps-0", got["file"])
    assert got["path"] == path and os.path.exists(path)
    meta, t = ckpt_check.read(path)
    assert meta["global_step"] == "6" and meta["task"] == "ps:0"
    assert json.loads(meta["config"])["optimizer"] == "adam"
    assert json.loads(meta["placement"]) == {"ps_task": 0, "ps_tasks": 1, "variables": ["b", "w"],
                                             "map": None}
    assert json.loads(meta["variables"])["w"]["shape"] == [3, 4]
    assert set(t) == {"w", "w:adam_m", "w:adam_v", "b", "b:adam_m", "b:adam_v"}
    # the values are the served ones, bit for bit; the state is numpy's Adam
    assert t["w"].tobytes() == raw(p.url, "w").tobytes()
    assert t["b"].tobytes() == raw(p.url, "b").tobytes()
    np.testing.assert_allclose(t["w"], ref_w.w, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(t["w:adam_m"], ref_w.m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(t["w:adam_v"], ref_w.v, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(t["b:adam_v"], ref_b.v, rtol=1e-5, atol=1e-7)
    assert json.loads(meta["variables"])["w"]["updates"] == 3
    # GET /v1/checkpoint with curl: the same bytes as the file
    out = tmp_path / "dl.safetensors"
    r = curl("-f", "-o", str(out), "-D", "-", p.url + "/v1/checkpoint")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == open(path, "rb").read()
    assert b"x-global-step: 6" in r.stdout.lower()
    assert b'filename="model.ckpt-6.safetensors"' in r.stdout
    # a clean stop saves nothing new (nothing changed) and exits 0
    assert p.stop() == 0
    assert "nothing changed since" in p.read_stderr()
    # restart: the step, the values, the configuration and Adam's state are back
    q = start_psd(f"--logdir={logdir}")
    s = status(q.url)
    assert s["global_step"] == 6 and s["ready"] and s["optimizer"] == "adam"
    assert s["checkpoint"]["restored_from"]["global_step"] == 6
    assert raw(q.url, "w").tobytes() == t["w"].tobytes()
    assert "restored " + path in q.read_stderr()
    gw, gb = grads(99)
    grad(q.url, "w", gw)
    ref_w.step(gw)  # continues with m, v and t = 4: only right if the state came back
    np.testing.assert_allclose(raw(q.url, "w").reshape(3, 4), ref_w.w, rtol=1e-4, atol=2e-5)
    # the chief of a restarted job sends the same configuration: accepted
    st, _, body = http("PUT", q.url + "/v1/config", json.dumps(ADAM).encode())
    assert st == 200, body
    # and SIGTERM after a change saves it: the newest file holds step 7
    assert q.stop() == 0
    meta7, t7 = ckpt_check.read(os.path.join(logdir, "ps-0", "model.ckpt-7.safetensors"))
    np.testing.assert_allclose(t7["w"], ref_w.w, rtol=1e-4, atol=2e-5)


def test_periodic_saves_keep_the_newest_and_skip_when_idle(start_psd, tmp_path):
    logdir = str(tmp_path / "logs")
    p = start_psd(f"--logdir={logdir}", "--save_checkpoint_secs=1", "--keep_checkpoints=2")
    put(p.url, "w", W)
    for k in range(25):
        grad(p.url, "w", grads(k)[0])
        time.sleep(0.2)
    saves = status(p.url)["checkpoint"]["saves"]
    assert saves >= 3
    time.sleep(2.5)  # nothing changes: nothing is written
    s = status(p.url)["checkpoint"]
    assert s["saves"] in (saves, saves + 1)  # (one may have been due right at the last push)
    # the folder is looked at once no save can be running: a save writes a
    # .tmp.<pid> file, renames it, then prunes the oldest (3 files a moment)
    files = sorted(glob.glob(os.path.join(logdir, "ps-0", "*")))
    assert 1 <= len(files) <= 2, files
    for f in files:
        ckpt_check.read(f)
    time.sleep(2.2)
    assert status(p.url)["checkpoint"]["saves"] == s["saves"]
    st, _, body = http("GET", p.url + "/metrics")
    m = body.decode()
    assert "\nrestps_checkpoints_saved_total %d\n" % s["saves"] in m
    assert "\nrestps_checkpoint_failures_total 0\n" in m
    age = float(m.split("\nrestps_checkpoint_age_seconds ")[1].split("\n")[0])
    assert 2.0 <= age < 60, age


def test_restore_passes_over_truncated_and_corrupt_files(start_psd, tmp_path):
    logdir = str(tmp_path / "logs")
    folder = os.path.join(logdir, "ps-0")
    p = start_psd(f"--logdir={logdir}")
    put(p.url, "w", W)
    values = {}
    for k in range(1, 4):
        grad(p.url, "w", grads(k)[0])
        save(p.url)
        values[k] = raw(p.url, "w").tobytes()
    assert p.stop() == 0
    # newest (step 3): cut short; step 2: one byte of w's data flipped
    f3, f2 = (os.path.join(folder, f"model.ckpt-{k}.safetensors") for k in (3, 2))
    size = os.path.getsize(f3)
    with open(f3, "r+b") as f:
        f.truncate(size - 7)
    with open(f2, "r+b") as f:
        f.seek(size - 5)
        b = f.read(1)
        f.seek(size - 5)
        f.write(bytes([b[0] ^ 0x10]))
    # and a temp file a killed write left behind
    tmp = os.path.join(folder, "model.ckpt-4.safetensors.tmp.12345")
    open(tmp, "wb").write(b"\0" * 100)
    with pytest.raises(ckpt_check.Invalid):
        ckpt_check.read(f3)
    with pytest.raises(ckpt_check.Invalid):
        ckpt_check.read(f2)
    q = start_psd(f"--logdir={logdir}")
    s = status(q.url)
    assert s["global_step"] == 1
    assert raw(q.url, "w").tobytes() == values[1]
    err = q.read_stderr()
    print(err)
    assert f"passing over {f3}: " in err and "file is" in err.split(f"passing over {f3}: ")[1].split("\n")[0]
    line2 = err.split(f"passing over {f2}: ")[1].split("\n")[0]
    assert "checksum does not match" in line2 and "tensor 'w'" in line2
    assert "removed 1 temp file" in err
    assert not os.path.exists(tmp)
    assert os.path.exists(f3 + ".invalid") and os.path.exists(f2 + ".invalid")
    assert s["checkpoint"]["restored_from"]["global_step"] == 1
    assert s["checkpoint"]["invalid_set_aside"] == 2


def test_metadata_tampering_is_caught(start_psd, tmp_path):
    logdir = str(tmp_path / "logs")
    p = start_psd(f"--logdir={logdir}")
    put(p.url, "w", W)
    grad(p.url, "w", grads(1)[0])
    save(p.url)
    grad(p.url, "w", grads(2)[0])
    f = save(p.url)["path"]
    assert p.stop() == 0
    data = bytearray(open(f, "rb").read())
    at = data.index(b'"global_step":"2"')
    data[at + len('"global_step":"')] = ord("9")  # still valid JSON, still a number
    open(f, "wb").write(bytes(data))
    q = start_psd(f"--logdir={logdir}")
    assert status(q.url)["global_step"] == 1
    assert "metadata checksum does not match" in q.read_stderr()


def mount_tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")


def umount(path):
    subprocess.run(["umount", "-l", path], capture_output=True)


def test_full_and_read_only_filesystem_keep_psd_serving(start_psd, tmp_path):
    mnt = str(tmp_path / "small")
    mount_tmpfs(mnt, "256k")
    try:
        p = Psd([f"--logdir={mnt}", "--save_checkpoint_secs=1"])
        try:
            put(p.url, "w", W)
            first = save(p.url)["path"]  # fits
            # 40,000 floats with Adam's two slots: 480 KB, more than the 256 KiB
            st, _, body = http("PUT", p.url + "/v1/config", json.dumps(ADAM).encode())
            assert st == 200, body
            put(p.url, "big", np.ones(40000, np.float32))
            grad(p.url, "big", np.ones(40000, np.float32))
            st, _, body = http("POST", p.url + "/v1/checkpoint")
            assert st == 500 and b"No space left on device" in body, (st, body)
            time.sleep(1.5)  # the periodic save fails too, and says so
            s = status(p.url)["checkpoint"]
            assert s["failures"] >= 2 and "No space left" in s["last_error"]["message"]
            assert s["last"]["file"] == first
            st, _, body = http("GET", p.url + "/metrics")
            fails = int(body.decode().split("\nrestps_checkpoint_failures_total ")[1].split("\n")[0])
            assert fails >= 2
            # still serving; no temp file left; the previous checkpoint intact
            assert raw(p.url, "big").shape == (40000,)
            assert os.listdir(os.path.join(mnt, "ps-0")) == [os.path.basename(first)]
            ckpt_check.read(first)
            # read-only: remount, change something, save: refused, logged
            r = subprocess.run(["mount", "-o", "remount,ro", mnt], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            http("PUT", p.url + "/v1/vars/big", np.zeros(10, np.float32).tobytes(), {"X-Shape": "10"})
            st, _, body = http("POST", p.url + "/v1/checkpoint")
            assert st == 500 and b"Read-only file system" in body, (st, body)
            assert status(p.url)["global_step"] == 1
            ckpt_check.read(first)
            # a stop that cannot save says so and exits 1: the last changes are not on disk
            rc = p.stop()
            err = p.read_stderr()
            assert rc == 1 and "the final checkpoint failed" in err, err[-2000:]
            assert "save failed" in err
        finally:
            if p.alive():
                p.proc.kill()
                p.proc.wait()
    finally:
        umount(mnt)


def test_logdir_empty_means_no_checkpoints(start_psd, tmp_path):
    p = start_psd("--logdir=")
    put(p.url, "w", W)
    st, _, body = http("POST", p.url + "/v1/checkpoint")
    assert st == 409 and b"checkpoints are off" in body
    st, _, body = http("GET", p.url + "/v1/checkpoint")
    assert st == 404
    assert status(p.url)["checkpoint"] is None
    assert not os.path.exists("logs")


def test_default_logdir_is_logs_under_the_working_folder(start_psd, tmp_path):
    p = start_psd(own_logdir=False)
    put(p.url, "w", W)
    got = save(p.url)
    assert os.path.abspath(got["path"]) == str(tmp_path / "logs" / "ps-0" / "model.ckpt-0.safetensors")
    st, _, body = http("GET", p.url + "/v1/checkpoint")
    assert st == 200 and body == open(got["path"], "rb").read()


@pytest.mark.parametrize("flag", ["--save_checkpoint_secs=-1", "--keep_checkpoints=0"])
def test_bad_checkpoint_flags_exit_2(flag):
    r = subprocess.run([binary("psd"), "--port=0", flag], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "--keep_checkpoints" in r.stderr, r.stderr


def test_an_unconfigured_shard_restores_with_its_flags_learning_rate(start_psd, tmp_path):
    logdir = str(tmp_path / "logs")
    p = start_psd(f"--logdir={logdir}", "--learning_rate=0.5")
    put(p.url, "w", W)
    grad(p.url, "w", np.ones((3, 4), np.float32))
    assert p.stop() == 0
    q = start_psd(f"--logdir={logdir}", "--learning_rate=0.5")
    s = status(q.url)
    assert s["global_step"] == 1 and not s["ready"] and s["learning_rate"] == 0.5
    before = raw(q.url, "w")
    grad(q.url, "w", np.ones((3, 4), np.float32))
    np.testing.assert_allclose(raw(q.url, "w"), before - 0.5, rtol=0, atol=1e-6)


def test_a_shape_changed_in_the_header_is_caught(start_psd, tmp_path):
    logdir = str(tmp_path / "logs")
    p = start_psd(f"--logdir={logdir}")
    put(p.url, "w", W)
    save(p.url)
    grad(p.url, "w", grads(1)[0])
    f = save(p.url)["path"]
    assert p.stop() == 0
    data = bytearray(open(f, "rb").read())
    at = data.index(b'"shape":[3,4]')
    data[at:at + len(b'"shape":[3,4]')] = b'"shape":[4,3]'  # outside __metadata__
    open(f, "wb").write(bytes(data))
    q = start_psd(f"--logdir={logdir}")
    assert status(q.url)["global_step"] == 0
    assert "its shape in the header is not the one in the metadata" in q.read_stderr()


def test_another_tasks_checkpoint_is_passed_over_and_left_alone(start_psd, tmp_path):
    logdir = str(tmp_path / "logs")
    two = "--ps_hosts=127.0.0.1:1,127.0.0.1:2"
    p = start_psd(f"--logdir={logdir}", two)  # ps 0 of a 2-ps cluster
    put(p.url, "w", W)
    f = save(p.url)["path"]
    assert p.stop() == 0
    q = start_psd(f"--logdir={logdir}")  # ps 0 of a 1-ps cluster, same folder
    assert status(q.url)["variables"] == 0
    err = q.read_stderr()
    assert f"passing over {f}: it is ps:0 of a cluster of 2 ps tasks; this is ps:0 of 1" in err
    assert os.path.exists(f)  # valid, not set aside


def foreign_checkpoint(start_psd, tmp_path):
    """The bytes of a valid checkpoint of ps 0 of a 2-ps cluster (another
    cluster shape's, which a 1-ps psd passes over)."""
    other = str(tmp_path / "other-logs")
    p = start_psd(f"--logdir={other}", "--ps_hosts=127.0.0.1:1,127.0.0.1:2")
    put(p.url, "w", W)
    f = save(p.url)["path"]
    assert p.stop() == 0
    return open(f, "rb").read()


def test_pruning_counts_only_this_tasks_checkpoints_and_leaves_the_rest_alone(start_psd, tmp_path):
    """Issue 37: entries named model.ckpt-1000..1004 that psd passes over at
    its restore (another cluster shape's checkpoints, folders) used to count
    for --keep_checkpoints: the first save then removed the restored good
    ckpt-3 and the new ckpt-4, and GET /v1/checkpoint answered 500."""
    logdir = str(tmp_path / "logs")
    folder = os.path.join(logdir, "ps-0")
    p = start_psd(f"--logdir={logdir}", "--keep_checkpoints=2")
    put(p.url, "w", W)
    for k in range(3):
        grad(p.url, "w", grads(k)[0])
    assert save(p.url)["global_step"] == 3
    assert p.stop() == 0
    other = foreign_checkpoint(start_psd, tmp_path)
    foreign = {}
    for step in (1000, 1001, 1002):
        f = os.path.join(folder, f"model.ckpt-{step}.safetensors")
        open(f, "wb").write(other)
        foreign[f] = other
    for step in (1003, 1004):
        os.mkdir(os.path.join(folder, f"model.ckpt-{step}.safetensors"))
    q = start_psd(f"--logdir={logdir}", "--keep_checkpoints=2", "--save_checkpoint_secs=0")
    s = status(q.url)
    assert s["global_step"] == 3 and s["checkpoint"]["restored_from"]["global_step"] == 3, s
    ck = lambda k: os.path.join(folder, f"model.ckpt-{k}.safetensors")
    grad(q.url, "w", grads(3)[0])
    assert save(q.url)["global_step"] == 4
    assert os.path.exists(ck(3)) and os.path.exists(ck(4)), sorted(os.listdir(folder))
    grad(q.url, "w", grads(4)[0])
    got = save(q.url)
    assert got["global_step"] == 5
    # --keep_checkpoints=2 of this task's own: 4 and 5; 3 removed
    assert not os.path.exists(ck(3)) and os.path.exists(ck(4)), sorted(os.listdir(folder))
    st, _, body = http("GET", q.url + "/v1/checkpoint")
    assert st == 200, body
    assert body == open(ck(5), "rb").read()
    ckpt_check.read(ck(4))
    # the others untouched
    for f, data in foreign.items():
        assert open(f, "rb").read() == data, f
    for step in (1003, 1004):
        assert os.path.isdir(ck(step))
    assert not glob.glob(os.path.join(folder, "*.invalid")), sorted(os.listdir(folder))
    err = q.read_stderr()
    # said once (not at every save) which entries pruning leaves alone
    assert err.count("pruning leaves alone") == 1, err[-3000:]
    line = err.split("pruning leaves alone")[1].split("\n")[0]
    assert "5 entries" in line and "model.ckpt-1004.safetensors" in line, line


def test_a_fifo_named_like_a_checkpoint_is_passed_over_without_blocking(tmp_path):
    """Issue 37: psd's start-up used to block in open() on a FIFO named like a
    checkpoint (SIGTERM blocked meanwhile, so it did not even stop)."""
    import select
    logdir = str(tmp_path / "logs")
    p = Psd([f"--logdir={logdir}", "--save_checkpoint_secs=0"])
    put(p.url, "w", W)
    grad(p.url, "w", grads(1)[0])
    good = save(p.url)["path"]
    assert p.stop() == 0
    fifo = os.path.join(logdir, "ps-0", "model.ckpt-5.safetensors")
    os.mkfifo(fifo)
    err = tmp_path / "psd.err"
    proc = subprocess.Popen([binary("psd"), "--port=0", f"--logdir={logdir}",
                             "--save_checkpoint_secs=0"],
                            stdout=subprocess.PIPE, stderr=open(err, "wb"))
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 5)
        assert ready, "psd did not start within 5 s (blocked on the FIFO?)"
        line = proc.stdout.readline().decode()
        assert line.startswith("psd: listening on "), (line, err.read_text())
        url = line.split("listening on ", 1)[1].strip()
        st, _, body = http("GET", url + "/healthz", timeout=5)
        assert st == 200, body
        s = status(url)
        assert s["global_step"] == 1 and s["checkpoint"]["restored_from"]["file"] == good, s
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    log = err.read_text()
    assert f"passing over {fifo}: not a regular file (a fifo)" in log, log[-3000:]
    assert os.path.exists(fifo) and not os.path.exists(fifo + ".invalid")


def without_meta_checksum(path):
    """Rewrite the checkpoint at path without its meta_crc32c entry (every
    other byte as it was, the header re-encoded and padded to 8)."""
    import struct
    raw_ = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw_[:8])
    header = json.loads(raw_[8:8 + n])
    del header["__metadata__"]["meta_crc32c"]
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    open(path, "wb").write(struct.pack("<Q", len(hb)) + hb + raw_[8 + n:])


def test_a_checkpoint_without_its_metadata_checksum_is_set_aside(start_psd, tmp_path):
    """Issue 37: a checkpoint lacking meta_crc32c is treated as a corrupt one:
    passed over, renamed *.invalid, the older valid one restored."""
    logdir = str(tmp_path / "logs")
    p = start_psd(f"--logdir={logdir}")
    put(p.url, "w", W)
    grad(p.url, "w", grads(1)[0])
    save(p.url)
    one = raw(p.url, "w").tobytes()
    grad(p.url, "w", grads(2)[0])
    f = save(p.url)["path"]
    assert p.stop() == 0
    without_meta_checksum(f)
    with pytest.raises(ckpt_check.Invalid):
        ckpt_check.read(f)
    q = start_psd(f"--logdir={logdir}")
    s = status(q.url)
    assert s["global_step"] == 1 and raw(q.url, "w").tobytes() == one, s
    assert s["checkpoint"]["invalid_set_aside"] == 1
    assert os.path.exists(f + ".invalid") and not os.path.exists(f)
    err = q.read_stderr()
    assert f"passing over {f}: metadata checksum does not match (file says nothing" in err, err


def test_an_unwritable_logdir_serves_and_says_no_checkpoint_was_saved(start_psd, tmp_path):
    """Issue 37: a --logdir that cannot be created (under a regular file, which
    stops root too). psd serves anyway (test_openapi holds it to that: a failed
    save is a 500 and psd serves on), and its log no longer claims "the
    previous checkpoint is intact" when none was ever saved."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    logdir = str(blocker / "sub")
    p = start_psd(f"--logdir={logdir}")
    st, _, body = http("GET", p.url + "/healthz")
    assert st == 200, body
    st, _, body = http("POST", p.url + "/v1/checkpoint")
    assert st == 500, body
    st, _, body = http("GET", p.url + "/v1/checkpoint")
    assert st == 404, body
    err = p.read_stderr()
    start_line = [l for l in err.splitlines() if f"cannot create '{blocker}/sub" in l
                  or f"cannot create '{blocker}'" in l]
    assert start_line and "psd serves anyway" in start_line[0], err
    fail = [l for l in err.splitlines() if "save failed" in l]
    assert len(fail) == 1, err
    assert "no checkpoint has been saved yet" in fail[0], fail[0]
    assert "previous checkpoint is intact" not in err, err


def test_a_read_only_logdir_is_said_at_start(start_psd, tmp_path):
    """Issue 37: a checkpoint folder that exists but cannot be written (a
    read-only filesystem: chmod does not stop root) is logged at start; psd
    serves, and a save fails saying no checkpoint was saved yet."""
    mnt = str(tmp_path / "ro")
    mount_tmpfs(mnt, "64k")
    try:
        os.makedirs(os.path.join(mnt, "ps-0"))
        r = subprocess.run(["mount", "-o", "remount,ro", mnt], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        p = start_psd(f"--logdir={mnt}", "--save_checkpoint_secs=0")
        st, _, body = http("POST", p.url + "/v1/checkpoint")
        assert st == 500 and b"Read-only file system" in body, (st, body)
        assert p.stop() == 0
        err = p.read_stderr()
        assert f"cannot write in '{mnt}/ps-0': Read-only file system; psd serves anyway" in err, err
        assert "no checkpoint has been saved yet" in err and "previous checkpoint is intact" not in err
    finally:
        umount(mnt)
