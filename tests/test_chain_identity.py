"""Chain identity: every upstream must serve the network's chain (chain id and genesis hash), cache
keys carry that identity, and a finalized block whose hash changes invalidates the network's entries."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proxy.http.app_keys import SERVICE
from tests.fault_relay import FaultRelay
from tests.support import DEV_ACCOUNT, Anvil, ProxyFactory, eventually, selector, settings_for, start_proxy, word

CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


def storage(address: str, block: int) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", hex(block)]}


async def test_an_upstream_of_another_chain_is_taken_out_of_rotation(
    anvil: Anvil, caplog: pytest.LogCaptureFixture, make_proxy: ProxyFactory
) -> None:
    other = Anvil("--chain-id", "999")
    relay = await FaultRelay(anvil.url).start()
    proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{other.url}")
    try:
        assert (await proxy.post(CHAIN_ID))[1]["result"] == "0x7a69"
        assert proxy.metric("rpc_proxy_upstream_identity_mismatch", network="evm", upstream="0") == 0
        assert proxy.metric("rpc_proxy_upstream_identity_mismatch", network="evm", upstream="1") == 1
        assert any(
            r.levelno == logging.ERROR and "upstream #1 serves chain id 999" in r.getMessage() for r in caplog.records
        )
        assert other.url not in caplog.text
        relay.inject("http500", times=None)  # the primary fails: the other chain never answers instead
        for _ in range(3):
            status, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": "web3_clientVersion"})
            assert status == 502 and body["error"]["code"] == -32002
        # eth_chainId is the network's identity, held by the proxy: no upstream is asked for it.
        assert (await proxy.post(CHAIN_ID))[1]["result"] == "0x7a69"
    finally:
        await relay.close()
        other.stop()


async def test_a_declared_chain_id_refuses_upstreams_of_another_chain(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    networks = tmp_path / "networks.toml"
    networks.write_text(f'[networks.devnet]\nfamily = "evm"\nupstreams = ["{anvil.url}"]\nchain_id = 999\n')
    proxy = await make_proxy(NETWORKS_FILE=str(networks))
    status, body, _ = await proxy.post(CHAIN_ID, network="devnet")
    assert status == 502 and body["error"]["code"] == -32002
    async with proxy.session.get(proxy.base + "/readyz") as resp:
        assert resp.status == 503 and "no upstream serves" in (await resp.json())["networks"]["devnet"]


async def test_an_upstream_restarted_as_another_chain_is_taken_out_of_rotation(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # Declared: never adopted (an undeclared network adopts a chain all its upstreams agree on,
    # see test_devnet_restart.py).
    networks = tmp_path / "networks.toml"
    networks.write_text(f'[networks.evm]\nfamily = "evm"\nupstreams = ["{anvil.url}"]\nchain_id = 31337\n')
    proxy = await make_proxy(NETWORKS_FILE=str(networks))
    assert (await proxy.post(CHAIN_ID))[1]["result"] == "0x7a69"
    anvil.stop()

    async def outage_seen() -> bool:
        return proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="connect") > 0

    await eventually(outage_seen, 10, "the proxy to see the node go away")
    anvil.__init__("--chain-id", "999", port=anvil.port)  # type: ignore[misc]  # same URL, new chain

    async def refused() -> bool:
        status, body, _ = await proxy.post(CHAIN_ID)
        assert body.get("result") != "0x3e7" or status != 200, "an answer from the other chain"
        return proxy.metric("rpc_proxy_upstream_identity_mismatch", network="evm", upstream="0") == 1

    await eventually(refused, 10, "the restarted upstream to be refused")


async def test_cache_keys_carry_the_chain_identity_so_a_repointed_proxy_never_serves_the_old_chain(
    redis_url: str,
    make_proxy: ProxyFactory,
) -> None:
    old, new = Anvil(), Anvil("--chain-id", "999")
    try:
        for node, value in ((old, 11), (new, 22)):
            address = node.deploy_store()  # the same address on both: the same sender and nonce
            node.send(address, selector("setX(uint256)") + word(value))
            node.mine(70)
        block = 3
        # Inline, not make_proxy: closed mid-test, before a proxy repointed at another chain starts.
        first = await start_proxy(settings_for(EVM_UPSTREAM=old.url, REDIS_URL=redis_url))
        try:
            await first.head_at(block + 64)
            assert (await first.post(storage(address, block)))[1]["result"] == "0x" + word(11)
        finally:
            await first.close()
        second = await make_proxy(EVM_UPSTREAM=new.url, REDIS_URL=redis_url)
        await second.head_at(block + 64)
        _, body, headers = await second.post(storage(address, block))
        assert body["result"] == "0x" + word(22) and headers["X-Cache"] == "MISS"
    finally:
        old.stop()
        new.stop()


async def test_a_finalized_block_whose_hash_changes_is_an_error_that_invalidates_the_network(
    anvil: Anvil, caplog: pytest.LogCaptureFixture, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url)
    address = anvil.deploy_store()
    anvil.mine(80)
    await proxy.head_at(81)
    request = storage(address, 10)  # final: cached forever
    await proxy.post(request)
    assert (await proxy.post(request))[2]["X-Cache"] == "HIT"
    tracker = proxy.app[SERVICE].networks["evm"].tracker
    space = tracker.head.space if tracker.head else None

    anvil.rpc("anvil_reorg", 78, [])  # replaces blocks 4-81: 4-17 were final

    async def violation() -> bool:
        return proxy.metric("rpc_proxy_finality_violations_total", network="evm") >= 1

    await eventually(violation, 10, "the finality violation to be seen")
    assert any(r.levelno == logging.ERROR and "changed hash" in r.getMessage() for r in caplog.records)
    assert tracker.head is not None and tracker.head.space != space
    _, _, headers = await proxy.post(request)
    assert headers["X-Cache"] != "HIT"  # the old entry is left behind with the old epoch


async def test_a_poll_that_shows_the_finalized_block_with_another_hash_makes_the_window_unsure_before_it_is_believed(
    anvil: Anvil, caplog: pytest.LogCaptureFixture, make_proxy: ProxyFactory
) -> None:
    # Polls a second apart: the violation is believed at the third poll that shows it, two seconds on.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="1")
    address = anvil.deploy_store()
    anvil.mine(70)
    anvil.send(address, selector("setX(uint256)") + word(9))
    head = anvil.mine(10)
    await proxy.head_at(head)
    window = storage(address, head - 2)  # above the finalized block (head - 64)
    latest = {**storage(address, 0), "params": [address, "0x0", "latest"]}
    for request in (window, latest):
        await proxy.post(request)
        _, body, headers = await proxy.post(request)
        assert headers["X-Cache"] == "HIT" and body["result"] == "0x" + word(9)

    anvil.rpc("anvil_reorg", 66, [])  # the finalized block and the write's, replaced by empty blocks

    async def shown() -> bool:
        return any("such polls in a row" in r.getMessage() for r in caplog.records)

    await eventually(shown, 10, "a poll to show the finalized block's new hash")
    # From that poll on, no block of the old window is served: it is asked as it is, uncached.
    for request in (window, latest):
        _, body, headers = await proxy.post(request)
        assert body["result"] == "0x" + word(7) and headers["X-Cache"] != "HIT", (request, body, headers)


async def test_an_upstream_that_shows_two_forks_in_turn_invalidates_nothing_and_leaves_head_tracking(
    caplog: pytest.LogCaptureFixture, make_proxy: ProxyFactory
) -> None:
    # Two nodes with one genesis, each with its own blocks: block 136 is final on both, with other hashes.
    first, second = Anvil("--timestamp", "1700000000"), Anvil("--timestamp", "1700000000")
    relay = await FaultRelay(first.url).start()
    try:
        first.rpc("anvil_mine", "0xc8", "0xc")
        second.rpc("anvil_mine", "0xc8", "0xd")
        proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{first.url}")
        await proxy.head_at(200)
        balance = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": [DEV_ACCOUNT, "0x40"]}
        assert (await proxy.post(balance))[0] == 200
        # Every second head poll the relay answers from the other fork.
        relay.inject(
            "fork", method="eth_getBlockByNumber", batches_only=True, only=True, times=None, every=2, target=second.url
        )

        async def contradicted() -> bool:
            status, _, headers = await proxy.post(balance)
            assert status == 200 and headers["X-Cache"] == "HIT"  # final reads keep being served
            return proxy.metric("rpc_proxy_finality_contradictions_total", network="evm", upstream="0") >= 1

        await eventually(contradicted, 15, "the relay to be caught contradicting itself")
        for _ in range(20):  # polls go on; the relay, out of head tracking, moves nothing
            status, _, headers = await proxy.post(balance)
            assert status == 200 and headers["X-Cache"] == "HIT"
        await proxy.head_at(first.mine(3))
        assert proxy.metric("rpc_proxy_finality_violations_total", network="evm") == 0
        assert not any(r.levelno == logging.ERROR and "changed hash" in r.getMessage() for r in caplog.records)

        first.rpc("anvil_reorg", 150, [])  # a real reorg below finality, shown by every poll: believed

        async def violation() -> bool:
            return proxy.metric("rpc_proxy_finality_violations_total", network="evm") >= 1

        await eventually(violation, 15, "the finality violation to be seen")
    finally:
        await relay.close()
        first.stop()
        second.stop()
