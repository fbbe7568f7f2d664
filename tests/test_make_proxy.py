"""The make_proxy fixture: every proxy a test started is closed when the test ends, passed or failed,
the last started first."""

from __future__ import annotations

import pytest

from tests.support import ROOT

pytest_plugins = ["pytester"]

FAILING_TEST = """
from tests.conftest import anvil, make_proxy

async def test_fails_with_two_proxies_open(anvil, make_proxy):
    for n in range(2):
        proxy = await make_proxy(EVM_UPSTREAM=anvil.url)
        close = proxy.close

        async def recorded(close=close, proxy=proxy, n=n):
            await close()
            with open("closed.txt", "a") as out:
                out.write(f"{n}:{proxy.session.closed}\\n")

        proxy.close = recorded
    assert False, "the test fails with both proxies open"
"""


def test_a_failing_test_still_has_every_proxy_it_started_closed_last_first(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_inner=FAILING_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert (pytester.path / "closed.txt").read_text().splitlines() == ["1:True", "0:True"]
