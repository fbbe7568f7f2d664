// Waiting with a deadline, shared by the client apps: poll a condition, never sleep a fixed time.

function deadline(ms, what) {
  return new Promise((_, reject) => setTimeout(() => reject(new Error(`timed out: ${what}`)), ms).unref());
}

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

module.exports = { deadline, until, repeatUntil };
