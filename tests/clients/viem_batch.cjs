// viem's http({ batch: true }): concurrent calls go out as JSON-RPC batches of up to 1,000 (viem's
// default batchSize). Usage: node viem_batch.cjs <http url> <calls>; prints the balances seen.
const { createPublicClient, http } = require("viem");

async function main() {
  const [url, calls] = process.argv.slice(2);
  const client = createPublicClient({ transport: http(url, { batch: true }) });
  const addresses = Array.from({ length: Number(calls) }, (_, i) => `0x${(i + 1).toString(16).padStart(40, "0")}`);
  addresses[0] = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266"; // a funded account: not every answer is 0
  const balances = await Promise.all(addresses.map((address) => client.getBalance({ address })));
  console.log(JSON.stringify({ balances: balances.map(String) }));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
