#!/usr/bin/env bash
# Launch a ringctx command on several hosts with torchrun. Run the SAME command on every host.
#
#   scripts/launch_multihost.sh --hosts 10.0.0.1,10.0.0.2 --nproc-per-host 2 --iface eth0 \
#       -- prefill --model smollm2-135m --tokens 100000 --json out.json
#
#   scripts/launch_multihost.sh --rdzv-endpoint 10.0.0.1:29400 --nnodes 2 --nproc-per-host 2 --iface eth0 \
#       -- ingest report.txt --save report.kv
#
# Knobs (all before `--`; `--help` lists them):
#   --hosts H0,H1,...          every host, host 0 first (static rendezvous at H0:--port, default 29400);
#                              each host finds its place in the list by its own addresses (or --node-rank)
#   --rdzv-endpoint HOST:PORT  a c10d rendezvous instead; with --nnodes N
#   --nproc-per-host K         ranks per host (one per GPU; on CPU, cores are split between them)
#   --iface IFACE              NIC for gloo/NCCL (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) and this host's address
#   --rdzv-timeout S           seconds to wait for every host (default 300); then a clear error, exit 3
#   --run-id ID, --local-addr ADDR, --node-rank I, --threads T, --dry-run (print the torchrun command)
# Host 0 runs ranks 0..K-1; rank 0 is the decode rank and writes the outputs (--json, --save, ...).
# The ringctx command's own --timeout bounds how long a dead or stuck rank can hold the others.
# Environment: PYTHON (default python3) picks the interpreter that has ringctx installed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
# Use the checkout this script lives in when ringctx is not installed.
if ! "$py" -c "import ringctx" >/dev/null 2>&1; then
  export PYTHONPATH="${here}${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$py" -m ringctx.parallel.multihost "$@"
