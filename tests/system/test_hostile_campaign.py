"""The hostile campaign's short form (tests/helpers/campaign.py, issue 23):
a few hundred hostile requests of every kind (framing, headers, paths,
query values, shapes, dtypes, safetensors bodies, auth, floats, integers,
byte mutations of valid requests, partial sends, racing writes, anonymous
pulls acting for a worker, 16 MiB heads with no body, 1,100 idle
connections) against one psd, with its invariants checked after each: it
answers, a refused request changed nothing (GET /v1/vars and every
variable's bytes, the configuration), no sanitizer report, bounded memory.
On the psd before issue 23's fixes it reports 4 findings (the long query
unanswered, an anonymous pull moving worker 0's clock, 20 heads reserving
371 MB of address space, a normal client waiting 2.25 s behind 1,100 idle
connections). make hostile runs the long form."""
import os
import subprocess
import sys

from conftest import BIN, HELPERS


def test_hostile_campaign_short_form():
    out = subprocess.run([sys.executable, os.path.join(HELPERS, "campaign.py"),
                          "--bin", BIN], capture_output=True, text=True, timeout=120)
    print(out.stdout[-4000:])
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-3000:]
    assert "0 finding(s)" in out.stdout
