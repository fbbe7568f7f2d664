// Waiting with a deadline, shared by the client apps: poll a condition, never sleep a fixed time.

async function until(check, ms, what) {
  const end = Date.now() + ms;
  while (!check()) {
    if (Date.now() > end) throw new Error(`timed out: ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

// Repeat `act` until `check` holds: for a subscription whose start a client does not report, act
// (mine a block, emit an event) until the first notification shows it is live.
async function repeatUntil(act, check, ms, what) {
  const end = Date.now() + ms;
  while (!check()) {
    if (Date.now() > end) throw new Error(`timed out: ${what}`);
    await act();
    const settle = Date.now() + 500;
    while (!check() && Date.now() < settle) await new Promise((r) => setTimeout(r, 20));
  }
}

// Anvil answers a write before it seals the write's block (tens of milliseconds on a busy machine). A client
// that asks for the receipt in between gets null and waits for the next block, which on a chain mined only
// on demand (as the tests' is) never comes. So while `pending` (a client's wait for a receipt) is unsettled,
// the node at `nodeUrl` mines a block each second: the write is in the first, if not already sealed.
async function sealed(pending, nodeUrl, ms, what) {
  let settled = false;
  pending.then(() => { settled = true; }, () => { settled = true; });
  const end = Date.now() + ms;
  let mineAt = Date.now() + 1000;
  while (!settled) {
    if (Date.now() > end) throw new Error(`timed out: ${what}`);
    if (Date.now() >= mineAt) {
      const body = JSON.stringify({ jsonrpc: "2.0", id: 1, method: "evm_mine", params: [] });
      await fetch(nodeUrl, { method: "POST", headers: { "content-type": "application/json" }, body });
      mineAt = Date.now() + 1000;
    }
    await new Promise((r) => setTimeout(r, 20));
  }
  return pending;
}

module.exports = { until, repeatUntil, sealed };
