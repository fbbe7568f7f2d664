// A viem app as a user would write it, pointed at HTTP_URL / WS_URL (the proxy or the node).
// CommonJS, so NODE_PATH finds the packages scripts/test.sh installs under .tools/node_modules.
// Prints one JSON line of what it saw; tests/test_js_clients.py runs it against both and compares.
const { readFileSync } = require("node:fs");
const { until, repeatUntil, sealed } = require("./wait.cjs");
const { createPublicClient, createWalletClient, http, webSocket, parseAbi } = require("viem");
const { privateKeyToAccount } = require("viem/accounts");
const { foundry } = require("viem/chains");

// The app's endpoints (proxy or node), and the node's own URL, which mines blocks on demand.
const [httpUrl, wsUrl, contracts, nodeUrl] = process.argv.slice(2);
const abi = JSON.parse(readFileSync(`${contracts}/Store.abi`, "utf8"));
const bytecode = "0x" + readFileSync(`${contracts}/Store.bin`, "utf8").trim();
const account = privateKeyToAccount("0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80");
const EVENTS = 5;

async function main() {
  const overHttp = createPublicClient({ chain: foundry, transport: http(httpUrl), pollingInterval: 100 });
  const overWs = createPublicClient({ chain: foundry, transport: webSocket(wsUrl) });
  const wallet = createWalletClient({ account, chain: foundry, transport: http(httpUrl) });
  const out = {};

  const deployHash = await wallet.deployContract({ abi, bytecode });
  const deployed = await sealed(overWs.waitForTransactionReceipt({ hash: deployHash, timeout: 30000 }), nodeUrl, 30000, "deploy");
  const address = deployed.contractAddress;
  out.deployStatus = deployed.status;

  out.httpX = String(await overHttp.readContract({ address, abi, functionName: "x" }));
  out.wsX = String(await overWs.readContract({ address, abi, functionName: "x" }));

  const blocks = [];
  const events = [];
  const stopBlocks = overWs.watchBlocks({ onBlock: (block) => blocks.push(Number(block.number)) });
  const stopEvents = overWs.watchContractEvent({
    address, abi, eventName: "Emitted", onLogs: (logs) => events.push(...logs.map((l) => `${l.transactionHash}:${l.logIndex}`)),
  });
  let emitted = 0;
  const emit = async () => {
    emitted += 1;
    const hash = await wallet.writeContract({ address, abi, functionName: "emitMany", args: [1n] });
    return (await sealed(overWs.waitForTransactionReceipt({ hash, timeout: 30000 }), nodeUrl, 30000, "receipt")).blockNumber;
  };
  // viem does not say when its subscriptions are live: emit until the first event shows they are.
  await repeatUntil(emit, () => events.length > 0 && blocks.length > 0, 30000, "the watchers to start");
  const before = events.length;
  let last = 0n;
  for (let i = 0; i < EVENTS; i++) last = await emit();
  await until(() => events.length >= before + EVENTS, 30000, "events");
  await until(() => blocks.length > 0 && blocks[blocks.length - 1] >= Number(last), 30000, "blocks");
  stopBlocks();
  stopEvents();
  out.events = events.length - before;
  out.uniqueEvents = new Set(events).size - before;
  out.blocksConsecutive = blocks.every((n, i) => i === 0 || n === blocks[i - 1] + 1);

  const event = parseAbi(["event Emitted(uint256 indexed i)"])[0];
  const warmUps = emitted - EVENTS; // every emitted event is in the logs, whether watched or not
  out.getLogs = (await overHttp.getLogs({ address, event, fromBlock: 0n, toBlock: "latest" })).length - warmUps;
  out.wsGetLogs = (await overWs.getLogs({ address, event, fromBlock: 0n, toBlock: "latest" })).length - warmUps;
  await (await overWs.transport.getRpcClient()).close();
  console.log(JSON.stringify(out));
}

main().then(() => process.exit(0), (error) => {
  console.error(error);
  process.exit(1);
});
