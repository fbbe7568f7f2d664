#!/usr/bin/env bash
# Regenerates NAME.bin / NAME.abi of the test contracts (default: Store and Token) with solcjs from
# npm (installed by the test command under .tools/). Usage: build.sh [NAME...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
solcjs="$here/../../.tools/node_modules/.bin/solcjs"
for name in "${@:-Store Token}"; do
  for one in $name; do
    out=$(mktemp -d)
    "$solcjs" --bin --abi --optimize -o "$out" "$here/$one.sol" >/dev/null
    cp "$out"/*"$one".bin "$here/$one.bin"
    cp "$out"/*"$one".abi "$here/$one.abi"
    rm -rf "$out"
  done
done
