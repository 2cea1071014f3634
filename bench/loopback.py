"""bench/loopback.py - the loopback's TCP bandwidth, measured now: one
process sends blocks over 127.0.0.1 to another that reads them (each side a
separate process, as a worker and a ps are), in 64 KiB and in 1 MiB blocks
(on this VM 64 KiB blocks went 1.3-2.2 GB/s, 1 MiB blocks 0.7-1.1: the
buffers stay in the cache), best of `reps` runs of each.
The benchmarks divide bytes by it for the limit a figure is held against.

    /usr/bin/python3 bench/loopback.py [MiB] [reps]
"""
import os
import socket
import subprocess
import sys
import time

READER = r"""
import socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
want = int(sys.argv[1])
buf = bytearray(int(sys.argv[2]))
view = memoryview(buf)
got = 0
while got < want:
    n = c.recv_into(view)
    if n == 0:
        break
    got += n
c.sendall(b"k")
print(got, flush=True)
"""


def bandwidth(mib=256, reps=3):
    """Bytes per second over loopback TCP, best of reps runs of mib MiB in
    each block size."""
    total = mib << 20
    best = 0.0
    for _, size in [(r, s) for r in range(reps) for s in (64 << 10, 1 << 20)]:
        block = b"\0" * size
        r = subprocess.Popen(["/usr/bin/python3", "-c", READER, str(total), str(size)], stdout=subprocess.PIPE,
                             text=True)
        try:
            port = int(r.stdout.readline())
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            sent = 0
            while sent < total:
                s.sendall(block)
                sent += len(block)
            s.recv(1)  # the reader has everything
            secs = time.perf_counter() - t0
            s.close()
            if int(r.stdout.readline()) == total:
                best = max(best, total / secs)
        finally:
            if r.poll() is None:
                r.kill()
            r.wait()
    if best <= 0:
        raise RuntimeError("loopback bandwidth: no run completed")
    return best


if __name__ == "__main__":
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    bw = bandwidth(mib, reps)
    print(f"loopback TCP, one stream, {mib} MiB, best of {reps}: {bw / 1e9:.2f} GB/s "
          f"(load {os.getloadavg()[0]:.2f})")
