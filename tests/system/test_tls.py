"""HTTPS between hosts (issue 8, the TLS part): psd --tls_cert/--tls_key
serves HTTPS (libmicrohttpd with GnuTLS); workerd --tls_ca verifies it; the
bearer token is required on writes. A CA and a server certificate are made
here with Debian's openssl. A worker trains over HTTPS; a wrong CA or a
missing token fails at once with a clear message and creates nothing."""
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import binary, curl, http
from procs import free_port
from test_recovery import accuracy_of

DATA = "/usr/share/datasets/fashion-mnist"
pytestmark = [
    pytest.mark.skipif(not shutil.which("openssl"), reason="openssl is missing: make deps installs it"),
    pytest.mark.skipif(not os.path.isdir(DATA),
                       reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist"),
]
TOKEN = "tls-test-token-0123456789abcdef"


def openssl(*args, cwd):
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def pki(tmp_path):
    d = tmp_path / "pki"
    d.mkdir()
    for ca in ("ca", "other"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out",
                f"{ca}.pem", "-days", "2", "-subj", f"/CN=restps test {ca}", cwd=d)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj",
            "/CN=127.0.0.1", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "srv.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    (d / "token").write_text(TOKEN + "\n")
    return d


def start_tls_psd(start_psd, pki, port):
    return start_psd(f"--ps_hosts=127.0.0.1:{port}", f"--tls_cert={pki}/srv.pem",
                     f"--tls_key={pki}/srv.key", f"--auth_token_file={pki}/token", port0=False)


def workerd(port, *args, timeout=300):
    argv = [binary("workerd"), f"--ps_hosts=127.0.0.1:{port}", f"--worker_hosts=127.0.0.1:{free_port()}",
            f"--data_dir={DATA}", "--hidden_units=32", "--train_steps=200", "--log_every=0",
            "--keep_ps", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def variables(pki, url):
    r = curl("--cacert", f"{pki}/ca.pem", url + "/v1/status")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["variables"]


def test_a_worker_trains_over_https_and_curl_reads_it(start_psd, pki):
    port = free_port()
    p = start_tls_psd(start_psd, pki, port)
    assert p.url.startswith("https://")
    # curl: trusted with the CA, refused without
    r = curl("--cacert", f"{pki}/ca.pem", p.url + "/healthz")
    assert r.returncode == 0 and json.loads(r.stdout) == {"status": "ok"}
    r = curl(p.url + "/healthz")
    assert r.returncode == 60, r  # peer certificate cannot be authenticated
    # plain HTTP to an HTTPS port gets nothing useful
    st = None
    try:
        st, _, _ = http("GET", f"http://127.0.0.1:{port}/healthz", timeout=3)
    except Exception:
        pass
    assert st != 200
    w = workerd(port, f"--tls_ca={pki}/ca.pem", f"--auth_token_file={pki}/token", "--sync=1")
    assert w.returncode == 0, w.stdout[-2000:] + w.stderr[-2000:]
    assert accuracy_of(w.stdout) >= 0.6
    assert variables(pki, p.url) == 4
    r = curl("--cacert", f"{pki}/ca.pem", "-o", "/dev/null", "-w", "%{http_code}",
             "-H", f"Authorization: Bearer {TOKEN}", "-X", "POST", p.url + "/v1/checkpoint")
    assert r.stdout == b"200", r


def test_a_wrong_ca_or_a_missing_token_fails_clearly_and_changes_nothing(start_psd, pki):
    port = free_port()
    p = start_tls_psd(start_psd, pki, port)
    w = workerd(port, f"--tls_ca={pki}/other.pem", f"--auth_token_file={pki}/token", timeout=60)
    assert w.returncode == 1, w
    assert "certificate" in w.stderr.lower() and "127.0.0.1" in w.stderr, w.stderr
    assert len(w.stderr.strip().splitlines()) == 1, w.stderr
    w = workerd(port, "--tls", f"--auth_token_file={pki}/token", timeout=60)  # the system's CAs
    assert w.returncode == 1 and "certificate" in w.stderr.lower(), w.stderr
    w = workerd(port, f"--tls_ca={pki}/ca.pem", timeout=60)  # no token
    assert w.returncode == 1 and "401" in w.stderr and "token" in w.stderr, w.stderr
    assert variables(pki, p.url) == 0
    w = workerd(port, f"--tls_ca={pki}/missing.pem", timeout=60)
    assert w.returncode == 2 and "missing.pem" in w.stderr


@pytest.mark.parametrize("args,words", [
    (["--tls_cert=/nonexistent.pem", "--tls_key=/nonexistent.key"], "/nonexistent.pem"),
    (["--tls_cert=/etc/hostname", "--tls_key=/etc/hostname"], "not a PEM file"),
    (["--tls_key=x.key"], "--tls_cert and --tls_key go together"),
    (["--tls_priorities=NORMAL"], "--tls_priorities need them"),
])
def test_bad_tls_flags_exit_2(args, words):
    r = subprocess.run([binary("psd"), "--port=0", *args], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def handshake(host_port, pki, *args):
    """openssl s_client (OpenSSL: an implementation apart from psd's GnuTLS)
    offering only what args allow; (protocol, suite) agreed, or None when psd
    refused the handshake."""
    r = subprocess.run(["openssl", "s_client", "-brief", "-connect", host_port, "-CAfile",
                        f"{pki}/ca.pem", "-verify_return_error", *args], input="",
                       capture_output=True, text=True, timeout=20)
    m = re.search(r"^Protocol version: (\S+)\nCiphersuite: (\S+)$", r.stderr, re.M)
    if r.returncode != 0 or not m:
        assert "CONNECTION ESTABLISHED" not in r.stderr, r.stderr
        return None
    assert "Verification: OK" in r.stderr, r.stderr
    return m.group(1), m.group(2)


# OpenSSL 3 offers TLS 1.0/1.1 and SHA-1 suites only at security level 0:
# psd with libmicrohttpd's own GnuTLS default agreed to each of these.
OLD = "ALL:@SECLEVEL=0"


def test_the_default_takes_only_tls12_and_13_with_aead_suites_in_psds_order(start_psd, pki):
    p = start_psd(f"--tls_cert={pki}/srv.pem", f"--tls_key={pki}/srv.key")
    hp = p.host_port
    # refused: old versions, CBC/SHA suites, RSA key exchange (no forward secrecy)
    assert handshake(hp, pki, "-tls1", "-cipher", OLD) is None
    assert handshake(hp, pki, "-tls1_1", "-cipher", OLD) is None
    assert handshake(hp, pki, "-tls1_2", "-cipher", "ECDHE-RSA-AES256-SHA:@SECLEVEL=0") is None
    assert handshake(hp, pki, "-tls1_2", "-cipher", "ECDHE-RSA-AES128-SHA256") is None
    assert handshake(hp, pki, "-tls1_2", "-cipher", "AES128-GCM-SHA256") is None
    # taken: TLS 1.3, TLS 1.2 with ECDHE and an AEAD suite
    assert handshake(hp, pki) == ("TLSv1.3", "TLS_AES_256_GCM_SHA384")
    assert handshake(hp, pki, "-tls1_2") == ("TLSv1.2", "ECDHE-RSA-AES256-GCM-SHA384")
    assert handshake(hp, pki, "-tls1_2", "-cipher", "ECDHE-RSA-AES128-GCM-SHA256") == \
        ("TLSv1.2", "ECDHE-RSA-AES128-GCM-SHA256")
    # a client listing ChaCha20 first gets AES-GCM (GnuTLS's ChaCha20 is
    # several times slower than AES-GCM on AES-NI CPUs), yet one offering
    # only ChaCha20 is served
    assert handshake(hp, pki, "-ciphersuites", "TLS_CHACHA20_POLY1305_SHA256:TLS_AES_128_GCM_SHA256") == \
        ("TLSv1.3", "TLS_AES_128_GCM_SHA256")
    assert handshake(hp, pki, "-tls1_2", "-cipher",
                     "ECDHE-RSA-CHACHA20-POLY1305:ECDHE-RSA-AES128-GCM-SHA256") == \
        ("TLSv1.2", "ECDHE-RSA-AES128-GCM-SHA256")
    assert handshake(hp, pki, "-ciphersuites", "TLS_CHACHA20_POLY1305_SHA256") == \
        ("TLSv1.3", "TLS_CHACHA20_POLY1305_SHA256")


def test_tls_priorities_sets_what_psd_takes_and_a_bad_one_stops_it(start_psd, pki):
    p = start_psd(f"--tls_cert={pki}/srv.pem", f"--tls_key={pki}/srv.key",
                  "--tls_priorities=NORMAL:-VERS-ALL:+VERS-TLS1.2")
    assert handshake(p.host_port, pki, "-tls1_3") is None
    assert handshake(p.host_port, pki) == ("TLSv1.2", "ECDHE-RSA-AES256-GCM-SHA384")
    r = subprocess.run([binary("psd"), "--port=0", "--logdir=", f"--tls_cert={pki}/srv.pem",
                        f"--tls_key={pki}/srv.key", "--tls_priorities=NORMAL:+NO-SUCH-THING"],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "--tls_priorities" in r.stderr and "rejects it at '+NO-SUCH-THING'" in r.stderr, r.stderr
    assert "listening" not in r.stdout
