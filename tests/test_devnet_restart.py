"""Devnet restarts: with no identity declared, a network whose every upstream agrees on a new chain
identity for ADOPT_AFTER rounds of checks adopts it (identity.py): new cache namespace, an ERROR
line, rpc_proxy_identity_adoptions_total, /readyz ready again; a declared identity is never replaced."""

from __future__ import annotations

import json
import logging

import pytest

from proxy.chain.identity import ADOPT_AFTER, adoption, agreed
from proxy.upstream.standing import ChainIdentity
from tests.support import Anvil, ProxyFactory, eventually, selector, word

OLD = ChainIdentity(31337, "0x" + "aa" * 32)
NEW = ChainIdentity(31337, "0x" + "bb" * 32)


class TestAdoptionRule:
    def test_every_upstream_must_agree_on_the_new_identity(self) -> None:
        assert agreed([NEW, NEW], OLD) == NEW
        assert agreed([NEW, OLD], OLD) is None
        assert agreed([NEW, None], OLD) is None  # an unreachable upstream has not agreed
        assert agreed([OLD, OLD], OLD) is None

    def test_adopted_after_consecutive_rounds_only_when_undeclared(self) -> None:
        streak: tuple[ChainIdentity | None, int] = (None, 0)
        for _ in range(ADOPT_AFTER - 1):
            streak, adopt = adoption(streak, NEW, None)
            assert not adopt
        assert adoption(streak, NEW, None)[1]
        assert adoption(streak, None, None) == ((None, 0), False)  # a round without agreement starts over
        assert not adoption((NEW, ADOPT_AFTER), NEW, 31337)[1]  # declared: never


async def test_anvil_restarted_under_a_running_proxy_is_adopted_and_never_served_from_the_old_cache(
    caplog: pytest.LogCaptureFixture,
    make_proxy: ProxyFactory,
) -> None:
    anvil = Anvil("--timestamp", "1700000000")
    # The default poll and identity-check intervals: ready again well within 30 s.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="2")
    try:
        address = anvil.deploy_store()
        anvil.send(address, selector("setX(uint256)") + word(11))
        block = anvil.block_number()
        await proxy.head_at(block)
        read = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", hex(block)]}
        assert (await proxy.post(read))[1]["result"] == "0x" + word(11)
        assert (await proxy.post(read))[2]["X-Cache"] == "HIT"
        heads = await proxy.session.ws_connect(proxy.ws_url())
        await heads.send_str(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "eth_subscribe", "params": ["newHeads"]}))
        assert "result" in json.loads((await heads.receive()).data)

        anvil.stop()  # a fresh devnet on the same URL: another genesis, the same chain id
        anvil = Anvil("--timestamp", "1700000500", port=anvil.port)
        anvil.deploy_store()
        anvil.send(address, selector("setX(uint256)") + word(22))
        assert anvil.block_number() == block

        async def ready() -> bool:
            async with proxy.session.get(proxy.base + "/readyz") as resp:
                return resp.status == 200 and proxy.metric("rpc_proxy_identity_adoptions_total", network="evm") == 1

        await eventually(ready, 30, "the restarted devnet to be adopted and /readyz ready")
        status, body, headers = await proxy.post(read)
        assert status == 200 and body["result"] == "0x" + word(22) and headers["X-Cache"] != "HIT"
        assert any(r.levelno == logging.ERROR and "adopted" in r.getMessage() for r in caplog.records)
        # A newHeads subscriber of the old chain goes on with the new one (its blocks come as a reorg's).
        new_block = anvil.mine()
        while True:
            notification = json.loads((await heads.receive(timeout=30)).data)
            if int(notification["params"]["result"]["number"], 16) == new_block:
                break
        assert (
            notification["params"]["result"]["hash"] == anvil.rpc("eth_getBlockByNumber", hex(new_block), False)["hash"]
        )
        await heads.close()
        assert anvil.url not in caplog.text
    finally:
        anvil.stop()
