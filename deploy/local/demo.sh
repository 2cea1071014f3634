#!/bin/sh
# make demo: training on Fashion-MNIST is not built yet. Until it is, show what
# works: start psd, store a tensor, and read it back with curl.
set -eu
cd "$(dirname "$0")/../.."
echo "demo: training (workerd) is not built yet; showing psd alone."
tmp=$(mktemp -d)
bin/psd --port=0 >"$tmp/psd.out" 2>"$tmp/psd.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in 1 2 3 4 5 6 7 8 9 10; do
  url=$(sed -n 's/^psd: listening on //p' "$tmp/psd.out")
  [ -n "$url" ] && break
  sleep 0.2
done
[ -n "$url" ] || { echo "demo: psd did not start:"; cat "$tmp/psd.log"; exit 1; }
echo "psd listening on $url"
printf '\000\000\200\077\000\000\000\100\000\000\100\100' >"$tmp/w.bin"   # 1.0 2.0 3.0 as float32
set -x
curl -sS --noproxy '*' -X PUT -H 'X-Shape: 3' --data-binary @"$tmp/w.bin" "$url/v1/vars/demo_w"; echo
curl -sS --noproxy '*' "$url/v1/vars/demo_w?format=json"; echo
curl -sS --noproxy '*' "$url/v1/status"; echo
set +x
echo "demo: see README.md for more curl examples; training arrives with workerd."
exit 1
