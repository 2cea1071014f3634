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

import pytest

from conftest import BIN, HELPERS


def test_hostile_campaign_short_form():
    out = subprocess.run([sys.executable, os.path.join(HELPERS, "campaign.py"),
                          "--bin", BIN], capture_output=True, text=True, timeout=120)
    print(out.stdout[-4000:])
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-3000:]
    assert "0 finding(s)" in out.stdout


@pytest.mark.parametrize("surface", ["ring", "stage", "files"])
def test_hostile_endpoints_campaign(surface):
    """The campaign's other surfaces (tests/helpers/campaign_endpoints.py,
    issue 37 part 6): the ring's endpoint (then the real neighbour: the sum
    is numpy's, so no refused piece landed), a pipeline stage's (after each
    request it waits for the same message with nothing buffered), and the
    files a user hands over (--evaluate_model and psd's restore on mutated
    files). On the build before: the ring took a piece whose head had a
    space before a colon, a stage took NaN activations."""
    if not os.path.isdir("/usr/share/datasets/fashion-mnist") and surface != "ring":
        pytest.skip("/usr/share/datasets/fashion-mnist is missing: make deps installs dataset-fashion-mnist")
    out = subprocess.run([sys.executable, os.path.join(HELPERS, "campaign_endpoints.py"), "--bin", BIN,
                          "--only", surface], capture_output=True, text=True, timeout=240)
    print(out.stdout[-4000:])
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-3000:]
    assert "0 finding(s)" in out.stdout
