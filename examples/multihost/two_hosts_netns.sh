#!/usr/bin/env bash
# Two "hosts" on this machine, then a multi-host ringctx prefill across them, checked against one
# process. Needs root (it creates network namespaces). Everything it creates is removed on exit.
#
#   sudo examples/multihost/two_hosts_netns.sh              # one rank per host
#   sudo NPROC=2 examples/multihost/two_hosts_netns.sh      # two ranks per host (4 in all)
#   sudo KILL=1:chunk2 examples/multihost/two_hosts_netns.sh   # see a lost rank reported (test hook)
#
# Host 0 is the namespace with 10.231.0.1, host 1 the one with 10.231.0.2 (private test addresses
# that exist only inside these namespaces), joined by a veth pair. Each host runs the same
# scripts/launch_multihost.sh command in its own directory (OUT/host0, OUT/host1), with gloo bound
# to its veth interface, so all traffic, the KV hand-off to rank 0 included, crosses the pair.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NPROC="${NPROC:-1}"
OUT="${OUT:-$(mktemp -d /tmp/ringctx-two-hosts.XXXXXX)}"
PY="${PYTHON:-python3}"
tag="rcx$(printf '%04x' $((RANDOM)))"
ns=("${tag}h0" "${tag}h1"); veth=("${tag}v0" "${tag}v1"); addr=(10.231.0.1 10.231.0.2)

cleanup() {
  for n in "${ns[@]}"; do
    for pid in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null || true
  done
}
trap cleanup EXIT

if ! ip netns add "${ns[0]}" 2>/dev/null; then
  echo "cannot create network namespaces here (needs root and CAP_SYS_ADMIN/CAP_NET_ADMIN)" >&2; exit 1
fi
ip netns add "${ns[1]}"
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for i in 0 1; do
  ip link set "${veth[$i]}" netns "${ns[$i]}"
  ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${veth[$i]}"
  ip -n "${ns[$i]}" link set "${veth[$i]}" up
  ip -n "${ns[$i]}" link set lo up
done
echo "host 0: ${ns[0]} ${veth[0]} ${addr[0]}    host 1: ${ns[1]} ${veth[1]} ${addr[1]}    outputs: $OUT"

# The same command on both hosts (docs/MULTIHOST.md); only the interface differs.
pids=()
for i in 0 1; do
  mkdir -p "$OUT/host$i"
  ( cd "$OUT/host$i" && exec env ${KILL:+RINGCTX_TEST_KILL=$KILL} PYTHON="$PY" ip netns exec "${ns[$i]}" \
      "$repo/scripts/launch_multihost.sh" --rdzv-endpoint 10.231.0.1:29400 --nnodes 2 --nproc-per-host "$NPROC" \
      --iface "${veth[$i]}" -- \
      prefill --model tiny --tokens 301 --chunk-tokens 64 --dtype float32 --timeout 60 \
      --json out.json --save-logits logits.safetensors --save-kv doc.kv ) > "$OUT/host$i/log.txt" 2>&1 &
  pids+=($!)
done
status=0
for i in 0 1; do
  if ! wait "${pids[$i]}"; then status=1; echo "--- host $i failed; its log ($OUT/host$i/log.txt) ends with:"; \
    grep -v 'socket.cpp' "$OUT/host$i/log.txt" | tail -n 6; fi
done
[ "$status" = 0 ] || exit 1
grep -v 'socket.cpp' "$OUT/host0/log.txt" | head -n 20

# Rank 0 (host 0) wrote the outputs; compare them with one process doing the same prefill.
cd "$OUT" && PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'PYEOF'
import json, os, torch
from safetensors.torch import load_file
from ringctx.engine import Engine
from ringctx.runtime.documents import read_document

assert not os.path.exists("host1/out.json"), "outputs belong to host 0"
stats = json.load(open("host0/out.json"))
saved = load_file("host0/logits.safetensors")
engine = Engine("tiny", dtype="float32")
one = engine.prefill(saved["token_ids"], chunk_tokens=64)
cache, _, _ = load_kv_cache("host0/kv.safetensors", engine.model)
dl = (saved["logits"] - one.logits).abs().max().item()
dkv = max((cache.k[l][:301] - one.cache.k[l][:301]).abs().max().item() for l in range(2))
print(f"{stats['world_size']} ranks on 2 hosts, bytes sent per rank {stats['bytes_sent_per_rank']}")
print(f"last-token logits vs one process: max |diff| {dl:.2e}; KV cache on host 0 vs one process: {dkv:.2e}")
assert dl < 2e-5 and dkv < 2e-5
print("OK: same logits as one process, and the KV cache reached host 0")
PYEOF
