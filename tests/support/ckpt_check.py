"""An independent reader and validator of restps checkpoints (server/checkpoint.h),
written from the format's description: the safetensors layout parsed by hand
(struct + json + numpy), CRC-32C from Debian's python3-crcmod (not psd's code).

    /usr/bin/python3 tests/support/ckpt_check.py FILE...   # exit 1 when one is invalid
"""
import json
import struct
import sys

import crcmod.predefined
import numpy as np

crc32c = crcmod.predefined.mkCrcFun("crc-32c")


class Invalid(Exception):
    pass


def read(path):
    """(metadata dict, {name: float32 ndarray}) of a valid checkpoint; raises Invalid."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise Invalid(f"{path}: {len(raw)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise Invalid(f"{path}: header of {n} bytes does not fit in {len(raw)}")
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        raise Invalid(f"{path}: header is not JSON: {e}")
    data = raw[8 + n:]
    meta = header.pop("__metadata__", {})
    if meta.get("format") != "restps-checkpoint" or meta.get("format_version") != "1":
        raise Invalid(f"{path}: not a restps checkpoint: {meta.get('format')!r}")
    # the metadata checksum: every other entry, keys in byte order, key NUL value NUL
    blob = b"".join(k.encode() + b"\0" + meta[k].encode() + b"\0"
                    for k in sorted(meta, key=lambda k: k.encode()) if k != "meta_crc32c")
    if "%08x" % crc32c(blob) != meta.get("meta_crc32c"):
        raise Invalid(f"{path}: metadata checksum does not match")
    crcs = json.loads(meta["crc32c"])
    spans = []
    tensors = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        if t["dtype"] != "F32" or not 0 <= b <= e <= len(data):
            raise Invalid(f"{path}: tensor {name}: bad dtype or offsets")
        count = int(np.prod(t["shape"], dtype=np.int64))
        if e - b != 4 * count:
            raise Invalid(f"{path}: tensor {name}: {e - b} bytes for shape {t['shape']}")
        if crcs.get(name) != "%08x" % crc32c(data[b:e]):
            raise Invalid(f"{path}: tensor {name}: checksum does not match")
        spans.append((b, e))
        tensors[name] = np.frombuffer(data[b:e], dtype="<f4").reshape(t["shape"])
    spans.sort()
    at = 0
    for b, e in spans:
        if b != at:
            raise Invalid(f"{path}: data has a hole or an overlap at {at}")
        at = e
    if at != len(data):
        raise Invalid(f"{path}: {len(data) - at} bytes after the last tensor")
    variables = json.loads(meta["variables"])
    for name, info in variables.items():
        if name not in tensors:
            raise Invalid(f"{path}: variable {name} has no tensor")
        for slot in info["slots"]:
            if f"{name}:{slot}" not in tensors:
                raise Invalid(f"{path}: variable {name}: slot {slot} is missing")
    return meta, tensors


def main(paths):
    bad = 0
    for p in paths:
        try:
            meta, tensors = read(p)
            print(f"{p}: valid, global step {meta['global_step']}, {len(tensors)} tensors")
        except (Invalid, OSError, KeyError, ValueError) as e:
            print(f"INVALID {e}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
