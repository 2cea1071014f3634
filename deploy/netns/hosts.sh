#!/bin/sh
# hosts.sh - many hosts on one machine: N network namespaces on one bridge,
# each host with its own address and a veth "NIC" shaped to a rate in both
# directions (tbf), so that psd and workerd run unchanged, each on its own
# host, and what crosses a network (a NIC's bandwidth, a cut link) is real.
# Needs root and iproute2 (ip, tc).
#
#   hosts.sh up N [--rate=1gbit] [--names=A,B,..]
#                                  make hosts host0..host(N-1) (addresses below);
#                                  --names: more names for them, in order
#   hosts.sh down                  remove every namespace and file this tag made
#   hosts.sh list                  "name address" per host
#   hosts.sh addr HOST             HOST's address
#   hosts.sh exec HOST CMD...      run CMD on HOST (ip netns exec)
#   hosts.sh cut HOST              pull HOST's cable (its switch port down)
#   hosts.sh restore HOST          plug it back in
#   hosts.sh rate HOST RATE        HOST's NIC at RATE both ways (tc's units:
#                                  100mbit, 1gbit; "none" for unshaped)
#
# --name=TAG (or RESTPS_HOSTS_TAG) names the set: namespaces TAG-sw (the
# switch: a bridge) and TAG-host0..; several sets may exist side by side.
# Each host resolves every host's name (host0, host1, ...) through its own
# /etc/hosts (ip netns exec mounts /etc/netns/TAG-hostI/hosts over it).
# A failed or interrupted `up` removes what it made.
set -eu

# The one place the address range is named: a /24 that exists only inside
# the namespaces this script makes (each set has its own bridge, so sets
# side by side may use the same range). host I is $SUBNET.(10+I).
SUBNET=${RESTPS_HOSTS_SUBNET:-10.231.0}
FIRST=10
MAX_HOSTS=200

TAG=${RESTPS_HOSTS_TAG:-restps}
RATE=1gbit
NAMES=""
# options anywhere before the command's own arguments (exec HOST CMD...: CMD's are its own)
pos=""
npos=0
while [ $# -gt 0 ]; do
  a=$1
  if [ "${pos%% *}" = exec ] && [ $npos -ge 2 ]; then break; fi
  shift
  case "$a" in
    --name=*) TAG=${a#--name=} ;;
    --rate=*) RATE=${a#--rate=} ;;
    --names=*) NAMES=${a#--names=} ;;
    --help|-h) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --*) echo "hosts.sh: unknown option $a (see --help)" >&2; exit 2 ;;
    *) case "$a" in *[!A-Za-z0-9._-]*) echo "hosts.sh: '$a' is no command, host or number" >&2; exit 2 ;; esac
       pos="${pos:+$pos }$a"; npos=$((npos + 1)) ;;
  esac
done
# shellcheck disable=SC2086
set -- $pos "$@"
case "$TAG" in
  ''|*[!a-z0-9]*) echo "hosts.sh: --name must be lower-case letters and digits: '$TAG'" >&2; exit 2 ;;
esac
[ ${#TAG} -le 24 ] || { echo "hosts.sh: --name is at most 24 characters" >&2; exit 2; }
SW=$TAG-sw

die() { echo "hosts.sh: $*" >&2; exit 1; }
need_root() {
  [ "$(id -u)" = 0 ] || die "network namespaces need root (ip netns add); run as root"
  command -v ip >/dev/null || die "iproute2's ip is not installed (apt-get install iproute2)"
  command -v tc >/dev/null || die "tc is not installed (apt-get install iproute2)"
}
host_index() {
  local i
  case "$1" in
    host[0-9]*) i=${1#host} ;;
    *) die "no host '$1' (hosts are host0, host1, ...)" ;;
  esac
  case "$i" in *[!0-9]*) die "no host '$1'" ;; esac
  ip netns list | grep -q "^$TAG-$1\( \|\$\)" || die "no host '$1' in set '$TAG' (hosts.sh up first)"
  echo "$i"
}
addr_of() { echo "$SUBNET.$((FIRST + $1))"; }

# shape DEV in namespace NS (its egress) to RATE; "none" removes the shaping
shape() {
  local ns=$1 dev=$2 rate=$3 bps burst
  if [ "$rate" = none ]; then
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
    return
  fi
  # burst: 1 ms at the rate, at least 128 KiB (GSO segments of 64 KiB must
  # fit: TCP's goodput through it is 0.96 of the rate at 1gbit here, 0.78 at
  # a 16 KB burst); a bigger one lets a phase's first MB through at once
  bps=$(rate_bps "$rate")
  burst=$((bps / 8 / 1000))
  [ "$burst" -ge 131072 ] || burst=131072
  ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 100ms
}
rate_bps() {
  local r=$1 n m
  case "$r" in
    *gbit) n=${r%gbit}; m=1000000000 ;;
    *mbit) n=${r%mbit}; m=1000000 ;;
    *kbit) n=${r%kbit}; m=1000 ;;
    *) die "rate '$r': give it as Nkbit, Nmbit or Ngbit (or none)" ;;
  esac
  case "$n" in ''|*[!0-9]*) die "rate '$r': a whole number before the unit" ;; esac
  echo $((n * m))
}

down() {
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep "^$TAG-" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
}

up() {
  local n=${1:-} hosts i ns names alias
  case "$n" in ''|*[!0-9]*) die "up N: N hosts, a number (1..$MAX_HOSTS)" ;; esac
  [ "$n" -ge 1 ] && [ "$n" -le $MAX_HOSTS ] || die "up N: N from 1 to $MAX_HOSTS"
  [ "$RATE" = none ] || rate_bps "$RATE" >/dev/null
  if ip netns list | grep -q "^$SW\( \|\$\)"; then
    die "set '$TAG' exists already (hosts.sh down --name=$TAG first)"
  fi
  trap 'echo "hosts.sh: up failed, removing what it made" >&2; down' EXIT
  trap 'exit 130' INT TERM
  ip netns add "$SW"
  ip -n "$SW" link add br0 type bridge
  ip -n "$SW" link set br0 up
  hosts="127.0.0.1 localhost"
  names=$NAMES
  i=0
  while [ $i -lt "$n" ]; do
    alias=${names%%,*}
    case "$names" in *,*) names=${names#*,} ;; *) names="" ;; esac
    case "$alias" in *[!A-Za-z0-9.-]*) die "--names: '$alias' is no host name" ;; esac
    hosts="$hosts
$(addr_of $i) host$i${alias:+ $alias}${alias:+ ${alias%%.*}}"
    i=$((i + 1))
  done
  [ -z "$names" ] || die "--names: more names than hosts ($n)"
  i=0
  while [ $i -lt "$n" ]; do
    ns=$TAG-host$i
    ip netns add "$ns"
    mkdir -p "/etc/netns/$ns"
    printf '%s\n' "$hosts" > "/etc/netns/$ns/hosts"
    ip -n "$SW" link add "p$i" type veth peer name eth0 netns "$ns"
    ip -n "$SW" link set "p$i" master br0 up
    ip -n "$ns" addr add "$(addr_of $i)/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    # both directions: the host's sends (eth0's egress), its receives (the port's)
    shape "$ns" eth0 "$RATE"
    shape "$SW" "p$i" "$RATE"
    i=$((i + 1))
  done
  trap - EXIT INT TERM
  echo "hosts.sh: $n hosts in set '$TAG' at $RATE each way: host0 = $(addr_of 0) .. host$((n - 1)) = $(addr_of $((n - 1)))"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  up) need_root; up "$@" ;;
  down) need_root; down ;;
  list)
    for ns in $(ip netns list | awk '{print $1}' | grep "^$TAG-host" | sort -V); do
      h=${ns#"$TAG"-}; echo "$h $(addr_of "${h#host}")"
    done ;;
  addr) [ $# -eq 1 ] || die "addr HOST"; addr_of "$(host_index "$1")" ;;
  exec)
    [ $# -ge 2 ] || die "exec HOST CMD..."
    h=$1; shift; host_index "$h" >/dev/null
    exec ip netns exec "$TAG-$h" "$@" ;;
  cut|restore)
    [ $# -eq 1 ] || die "$cmd HOST"
    i=$(host_index "$1")
    if [ "$cmd" = cut ]; then state=down; else state=up; fi
    ip -n "$SW" link set "p$i" "$state" ;;
  rate)
    [ $# -eq 2 ] || die "rate HOST RATE"
    i=$(host_index "$1")
    shape "$TAG-host$i" eth0 "$2"
    shape "$SW" "p$i" "$2" ;;
  ''|help) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
  *) die "unknown command '$cmd' (up, down, list, addr, exec, cut, restore, rate; --help)" ;;
esac
