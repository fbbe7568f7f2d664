#!/usr/bin/env bash
# Regenerates Token.bin / Token.abi (the workload benchmark's token) with solcjs from .tools/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
solcjs="$here/../../.tools/node_modules/.bin/solcjs"
out=$(mktemp -d)
"$solcjs" --bin --abi --optimize -o "$out" "$here/Token.sol" >/dev/null
cp "$out"/*Token.bin "$here/Token.bin"
cp "$out"/*Token.abi "$here/Token.abi"
rm -rf "$out"
