// ethers v6 through the proxy: send a transaction, wait for its receipt, read at `latest`.
// Usage: TOOLS=<dir holding node_modules/ethers> node write_then_read.mjs <proxy url> <store address> <abi> <rounds>
// Prints one JSON line: {"rounds": n, "stale": [descriptions of stale reads]}.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { join } from "node:path";

// ethers is installed under .tools/ (scripts/test.sh), not beside this file.
const { ethers } = createRequire(join(process.env.TOOLS, "package.json"))("ethers");

const [url, address, abiPath, rounds] = process.argv.slice(2);
const provider = new ethers.JsonRpcProvider(url, undefined, { batchMaxCount: 1, cacheTimeout: -1 });
provider.pollingInterval = 100;
const signer = await provider.getSigner(0);
const store = new ethers.Contract(address, JSON.parse(readFileSync(abiPath, "utf8")), signer);
const stale = [];
for (let i = 0; i < Number(rounds); i++) {
  if (i % 2 === 0) {
    const receipt = await (await store.setX(1000 + i)).wait();
    const x = await store.x();
    if (x !== BigInt(1000 + i)) stale.push(`round ${i}: x() = ${x} after block ${receipt.blockNumber}`);
    const slot = await provider.getStorage(address, 0);
    if (BigInt(slot) !== BigInt(1000 + i)) stale.push(`round ${i}: storage = ${slot}`);
  } else {
    const receipt = await (await store.emitMany(1)).wait();
    const events = await store.queryFilter("Emitted", receipt.blockNumber, "latest");
    if (events.length === 0) stale.push(`round ${i}: no event at block ${receipt.blockNumber}..latest`);
  }
}
console.log(JSON.stringify({ rounds: Number(rounds), stale }));
provider.destroy();
