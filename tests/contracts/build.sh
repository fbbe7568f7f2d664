#!/usr/bin/env bash
# Regenerates Store.bin / Store.abi with solcjs from npm (installed by .ci/run under .tools/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
solcjs="$here/../../.tools/node_modules/.bin/solcjs"
out=$(mktemp -d)
"$solcjs" --bin --abi --optimize -o "$out" "$here/Store.sol" >/dev/null
cp "$out"/*Store.bin "$here/Store.bin"
cp "$out"/*Store.abi "$here/Store.abi"
rm -rf "$out"
