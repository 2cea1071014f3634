#!/bin/sh
# Training speed: the CPU step against plain sgemm (bench_mlp), workerd --local
# against 1 worker + 1 ps on loopback (the distributed overhead), and PyTorch
# on the CPU when Debian's python3-torch is installed. Prints ratios.
set -u
cd "$(dirname "$0")/.."
DATA=/usr/share/datasets/fashion-mnist
echo "== training step vs OpenBLAS sgemm (OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset})"
bin/bench_mlp --seconds=1 --reps=3
fp() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rate() { sed -n 's/.* \([0-9.]*\) steps\/s$/\1/p' | tail -1; }
run_pair() { # name hidden batch steps
  name=$1; hidden=$2; batch=$3; steps=$4
  args="--data_dir=$DATA --hidden_units=$hidden --batch_size=$batch --optimizer=sgd --learning_rate=0.01 --train_steps=$steps --log_every=0"
  local_rate=$(bin/workerd --local $args 2>&1 | rate)
  P=$(fp)
  bin/psd --ps_hosts=127.0.0.1:$P --logdir= >/dev/null 2>&1 &
  pid=$!
  dist_rate=$(bin/workerd --ps_hosts=127.0.0.1:$P --worker_hosts=127.0.0.1:$(fp) $args 2>&1 | grep finished | rate)
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  /usr/bin/python3 - "$name" "$local_rate" "$dist_rate" <<'PY'
import sys
name, l, d = sys.argv[1], float(sys.argv[2] or 0), float(sys.argv[3] or 0)
over = (1 - d / l) * 100 if l else float("nan")
print(f"{name:28s} local {l:8.1f} steps/s   1 worker + 1 ps {d:8.1f} steps/s   "
      f"distributed overhead {over:5.1f}%   (target <= 15% for the big model)")
PY
}
# The BLAS kernel (client/blas_kernel.c): workerd --local on the example's
# model with the kernel restps chooses against Prescott (OpenBLAS's fallback
# for a cpu model it does not know), 3 interleaved runs each, the median.
echo "== the BLAS kernel: workerd --local 784-100-10 batch 100 sgd, 1 thread, restps's choice vs Prescott"
kernel_rates=""
for i in 1 2 3; do
  for ct in chosen Prescott; do
    if [ $ct = chosen ]; then set -- env -u OPENBLAS_CORETYPE; else set -- env OPENBLAS_CORETYPE=$ct; fi
    out=$("$@" bin/workerd --local --data_dir=$DATA --hidden_units=100 --batch_size=100 --optimizer=sgd \
          --learning_rate=0.01 --train_steps=3000 --log_every=0 2>&1)
    k=$(echo "$out" | sed -n 's/.*cpu backend (OpenBLAS \([A-Za-z0-9_]*\),.*/\1/p' | head -1)
    kernel_rates="$kernel_rates $ct:${k:-?}:$(echo "$out" | rate)"
  done
done
/usr/bin/python3 - $kernel_rates <<'PY'
import statistics, sys
runs = {}
for item in sys.argv[1:]:
    ct, kernel, rate = item.split(":")
    runs.setdefault(ct, (kernel, []))[1].append(float(rate or 0))
(ck, cr), (pk, pr) = runs["chosen"], runs["Prescott"]
c, p = statistics.median(cr), statistics.median(pr)
print(f"{'restps chooses':28s} {ck:10s} {c:8.1f} steps/s")
print(f"{'OPENBLAS_CORETYPE=Prescott':28s} {pk:10s} {p:8.1f} steps/s   chosen/Prescott {c / p if p else float('nan'):.2f}x")
PY
echo "== workerd --local vs 1 worker + 1 ps (async, sgd)"
run_pair "784-100-10 batch 100" 100 100 3000
run_pair "784-1024-1024-10 batch 256" 1024,1024 256 60
echo "== PyTorch on the CPU (same model, 1 thread)"
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  /usr/bin/python3 bench/torch_mlp.py
else
  echo "python3-torch is not installed (apt-get install python3-torch to compare)"
fi
