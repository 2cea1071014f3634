"""Read a TensorBoard log folder with TensorBoard's own code and print JSON.

usage: build/venv/bin/python tests/helpers/read_tfevents.py LOGDIR

Runs (found as `tensorboard --logdir=LOGDIR` finds them: every folder below
LOGDIR holding an events.out.tfevents.* file) are read by TensorBoard's
EventMultiplexer and EventAccumulator, keeping every scalar; each event file
is also read record by record with TensorBoard's own TFRecord reader, which
checks both masked CRC-32Cs of every record, because the accumulator stops
silently at a bad record (it treats it as a record still being written).

Prints {"runs": {RUN: {TAG: [[step, value, wall_time], ...]}},
        "files": {PATH: {"records": N, "first": FILE_VERSION, "error": null or "..."}}}
(tests/system/test_tensorboard.py runs it: the suite's pytest-3 has no
tensorboard).
"""
import json
import math
import os
import sys

from tensorboard.backend.event_processing import event_accumulator, event_multiplexer
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New


def finite(x):
    return x if math.isfinite(x) else repr(x)


def read_records(path):
    """Every record of one file with TensorBoard's TFRecord reader."""
    reader = PyRecordReader_New(path)
    n, first, error = 0, None, None
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            break
        except errors.DataLossError as e:
            error = str(e)
            break
        ev = event_pb2.Event.FromString(reader.record())
        if n == 0:
            first = ev.file_version
        n += 1
    return {"records": n, "first": first, "error": error}


def main():
    logdir = sys.argv[1]
    mux = event_multiplexer.EventMultiplexer(size_guidance={event_accumulator.SCALARS: 0})
    mux.AddRunsFromDirectory(logdir)
    mux.Reload()
    runs = {}
    for run in sorted(mux.Runs()):
        acc = mux.GetAccumulator(run)
        runs[run] = {tag: [[e.step, finite(e.value), e.wall_time] for e in acc.Scalars(tag)]
                     for tag in acc.Tags()[event_accumulator.SCALARS]}
    files = {}
    for root, _, names in os.walk(logdir):
        for name in sorted(names):
            if "tfevents" in name:
                path = os.path.join(root, name)
                files[os.path.relpath(path, logdir)] = read_records(path)
    json.dump({"runs": runs, "files": files}, sys.stdout)


if __name__ == "__main__":
    main()
