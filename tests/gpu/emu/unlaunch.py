"""unlaunch.py - model_cuda.cu for the host emulation (tests/gpu/emu/run.sh):
every kernel launch `k<<<grid, threads, 0, stream>>>(args)` becomes
`LAUNCH(k, grid, threads, args)` (cuda_runtime.h here: every thread of every
block in turn), and k_sum_rows, the one kernel with shared memory and
__syncthreads, becomes its sequential sum (thread 0 of block 0).
    python3 unlaunch.py IN.cu OUT.cc"""
import re
import sys

src = open(sys.argv[1]).read()
out, i = [], 0
launch = re.compile(r"(\w+)<<<")
while True:
    m = launch.search(src, i)
    if not m:
        out.append(src[i:])
        break
    out.append(src[i:m.start()])
    j, depth, parts, cur = m.end(), 0, [], ""
    while not (depth == 0 and src.startswith(">>>", j)):
        ch = src[j]
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
        j += 1
    parts.append(cur)
    j += 3
    if src[j] != "(" or len(parts) < 2:
        sys.exit(f"unlaunch.py: a launch I cannot read at offset {m.start()}")
    out.append(f"LAUNCH({m.group(1)}, {parts[0].strip()}, {parts[1].strip()}, ")
    i = j + 1
src = "".join(out)
a = src.index("static __global__ void k_sum_rows")
b = src.index("\n}\n", a) + 3
src = src[:a] + """static void k_sum_rows(const double *rowloss, const int *rowright, int B, double *sums,
                       int accumulate)
{
    if (threadIdx.x || blockIdx.x)
        return;
    double l = 0, r = 0;
    for (int i = 0; i < B; i++) {
        l += rowloss[i];
        r += rowright[i];
    }
    sums[0] = (accumulate ? sums[0] : 0.0) + l;
    sums[1] = (accumulate ? sums[1] : 0.0) + r;
}
""" + src[b:]
open(sys.argv[2], "w").write(src)
