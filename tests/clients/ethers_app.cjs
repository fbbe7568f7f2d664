// An ethers v6 app as a user would write it, pointed at HTTP_URL / WS_URL (the proxy or the node).
// Prints one JSON line of what it saw; tests/test_js_clients.py runs it against both and compares.
// CommonJS, so NODE_PATH finds the packages scripts/test.sh installs under .tools/node_modules.
const { readFileSync } = require("node:fs");
const { until, repeatUntil, sealed } = require("./wait.cjs");
const { ContractFactory, Contract, JsonRpcProvider, WebSocketProvider, Wallet } = require("ethers");

// NODE_URL drives the chain (Anvil mines only on demand); the app itself uses only HTTP_URL and WS_URL.
const [httpUrl, wsUrl, contracts, nodeUrl] = process.argv.slice(2);
const abi = JSON.parse(readFileSync(`${contracts}/Store.abi`, "utf8"));
const bytecode = "0x" + readFileSync(`${contracts}/Store.bin`, "utf8").trim();
const KEY = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80"; // anvil's first account
const EVENTS = 20;

async function main() {
  // Defaults but for a shorter polling interval (ethers polls every 4 s), so the test runs quickly.
  const http = new JsonRpcProvider(httpUrl, undefined, { pollingInterval: 100 });
  const ws = new WebSocketProvider(wsUrl);
  const out = {};
  try {
    // Deploy and write over WebSocket: waitForDeployment() and wait() ride on newHeads.
    // Nonces are counted here: ethers reuses an identical request's answer for 250 ms, so two quick
    // sends could otherwise share one "pending" count (with or without the proxy).
    const wallet = new Wallet(KEY, ws);
    let nonce = await http.getTransactionCount(wallet.address, "pending");
    const deploying = await new ContractFactory(abi, bytecode, wallet).deploy({ nonce: nonce++ });
    const deployed = await sealed(deploying.waitForDeployment(), nodeUrl, 30000, "deploy");
    const address = await deployed.getAddress();
    const tx = await deployed.setX(9, { nonce: nonce++ });
    out.setXStatus = (await sealed(tx.wait(), nodeUrl, 30000, "tx.wait")).status;

    // Read-only calls without a signer, over HTTP and WebSocket.
    out.httpX = (await new Contract(address, abi, http).x()).toString();
    out.wsX = (await new Contract(address, abi, ws).x()).toString();
    try {
      await new Contract(address, abi, http).boom();
      out.revert = "no revert";
    } catch (error) {
      out.revert = `${error.code}:${error.reason}`;
    }

    // Events: every one of 20 transactions' events arrives exactly once; blocks arrive consecutively.
    const seen = [];
    const blocks = [];
    const seenHttp = [];
    const watched = new Contract(address, abi, ws);
    await watched.on("Emitted", (i, event) => seen.push(`${event.log.transactionHash}:${event.log.index}`));
    // Over HTTP, ethers serves contract.on with a node-side filter (eth_newFilter, eth_getFilterChanges).
    const watchedHttp = new Contract(address, abi, http);
    await watchedHttp.on("Emitted", (i, event) => seenHttp.push(`${event.log.transactionHash}:${event.log.index}`));
    await ws.on("block", (n) => blocks.push(n));
    // ethers subscribes in the background, the logs first: a first block seen means both are live.
    const node = new JsonRpcProvider(nodeUrl);
    await repeatUntil(() => node.send("evm_mine", []), () => blocks.length > 0, 30000, "the block listener");
    const writer = new Contract(address, abi, new Wallet(KEY, http));
    const receipts = [];
    for (let i = 0; i < EVENTS; i++) {
      const sent = await writer.emitMany(1, { nonce: nonce++ });
      receipts.push(await sealed(sent.wait(), nodeUrl, 30000, "sent.wait"));
    }
    await until(() => seen.length >= EVENTS, 30000, "20 events");
    await until(() => seenHttp.length >= EVENTS, 30000, "20 events over HTTP");
    const last = receipts[receipts.length - 1].blockNumber;
    await until(() => blocks.length > 0 && blocks[blocks.length - 1] >= last, 30000, "the last block");
    await node.send("evm_mine", []);
    node.destroy();
    await until(() => blocks[blocks.length - 1] >= last + 1, 30000, "one more block");
    out.events = seen.length;
    out.uniqueEvents = new Set(seen).size;
    out.eventsMatchReceipts = receipts.every((r) => seen.some((s) => s.startsWith(r.hash)));
    out.httpEvents = seenHttp.length;
    out.httpEventsSameAsWs = new Set(seenHttp).size === seenHttp.length && seenHttp.every((s) => seen.includes(s));
    out.blocksConsecutive = blocks.every((n, i) => i === 0 || n === blocks[i - 1] + 1);
    out.blocksSeen = blocks.length >= EVENTS;

    // queryFilter over HTTP: the same 20 events, from the logs.
    const logs = await new Contract(address, abi, http).queryFilter("Emitted", 0, "latest");
    out.queryFilter = logs.length;
    await watched.removeAllListeners();
    await watchedHttp.removeAllListeners();
    await ws.removeAllListeners();
    await ws.getBlockNumber(); // a round trip after the eth_unsubscribe calls, so none is cut off by destroy()
    await http.send("eth_blockNumber", []); // likewise after eth_uninstallFilter
  } finally {
    http.destroy();
    await ws.destroy();
  }
  console.log(JSON.stringify(out));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
