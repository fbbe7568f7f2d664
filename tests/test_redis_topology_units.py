"""Redis topology URLs and Cluster hash tags, unit by unit: what a URL names, the ConfigErrors of a
malformed one (never echoing it), and keys that a multi-key command touches sharing one slot."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.cache.tiers import cache_key, shared_keys
from proxy.cli import main
from proxy.config import ConfigError, build_settings
from proxy.credits.lease_exchange import ledger_key, rate_key
from proxy.logs import redacted
from proxy.metrics import Metrics
from proxy.redis_link import RedisLink, RedisUnavailable, SentinelManagedRedis, connect, of_one_key
from proxy.redis_topology import RedisTopology, slot_tag, topology_of

SECRET = "s3cr%40t"  # percent-encoded "s3cr@t"


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


def test_a_plain_redis_url_is_a_single_server() -> None:
    assert topology_of("redis://127.0.0.1:6379/0").kind == "single"
    assert topology_of("unix:///run/redis.sock").kind == "single"


def test_a_cluster_url_lists_its_seed_nodes_and_credentials() -> None:
    topology = topology_of(f"rediss+cluster://app:{SECRET}@10.0.0.1:7000,[::1]:7001,redis-2:7002")
    assert topology == RedisTopology(
        "cluster", (("10.0.0.1", 7000), ("::1", 7001), ("redis-2", 7002)), username="app", password="s3cr@t", tls=True
    )
    assert topology_of("redis+cluster://h:7000/0").nodes == (("h", 7000),)


def test_a_sentinel_url_names_its_sentinels_service_and_database() -> None:
    topology = topology_of(f"redis+sentinel://:{SECRET}@s1:26380,s2/mymaster/3?sentinel_password=x")
    assert topology == RedisTopology(
        "sentinel", (("s1", 26380), ("s2", 26379)), "mymaster", 3, None, "s3cr@t", False, None, "x"
    )


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis+cluster://h:7000/2", "only database 0"),
        ("redis+cluster://h", "without a port"),
        ("redis+cluster://h:7000,,h:7001", "empty or malformed host"),
        ("redis+cluster://h:99999", "invalid port"),
        ("redis+cluster://h:0", "port 0"),
        ("redis+cluster://h:7000?socket_timeout=1", "does not take: socket_timeout"),
        ("redis+sentinel://s1:26379", "names no Sentinel service"),
        ("redis+sentinel://s1:26379/", "names no Sentinel service"),
        ("redis+sentinel://s1:26379/svc/x", "/service_name[/db]"),
        ("redis+sentinel://s1:26379/svc/0/1", "/service_name[/db]"),
        ("redis+sentinel://s1:26379/svc?password=x", "does not take: password"),
        ("redis+sentinel://s1:26379/svc#frag", "fragment"),
        ("redis+clusterx://h:7000", "is not a valid"),
        ("redis://h:6379/db5", "a database number"),  # redis-py would read it as database 0
        ("rediss://h:6379/0/1", "a database number"),
    ],
)
def test_malformed_topology_urls_are_one_line_config_errors_that_never_echo_them(url: str, fragment: str) -> None:
    for name in ("REDIS_URL", "CREDITS_REDIS_URL"):
        with_secret = url.replace("://", f"://:{SECRET}@", 1)
        with pytest.raises(ConfigError) as caught:
            build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", name: with_secret})
        message = str(caught.value)
        assert message.startswith(name) and fragment in message, message
        assert SECRET not in message and "s3cr" not in message


@pytest.mark.parametrize(
    ("url", "option"),
    [("redis://127.0.0.1:6379/1?x=y", "x"), ("redis://h:6379/0?ssl_ca_certs=/ca.pem", "ssl_ca_certs")],
)
def test_a_query_option_redis_py_does_not_take_is_refused_by_serve_and_check_naming_it(
    url: str, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule: an unknown option in a single server's URL (which every connect would fail on, for ever)
    is a configuration error naming the setting and the option, never the URL; check exits 2 alike."""
    _refused_in_serve_and_check(url, "has a query option redis-py does not take: " + option, capsys)


def _refused_in_serve_and_check(url: str, refusal: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`url` with a password, as REDIS_URL and as CREDITS_REDIS_URL: a configuration error saying
    `refusal` after the setting's name, and `check --offline` exits 2 on one line, neither with the
    password nor the URL's query value."""
    for name in ("REDIS_URL", "CREDITS_REDIS_URL"):
        with_secret = url.replace("://", f"://:{SECRET}@", 1)
        with pytest.raises(ConfigError) as caught:
            build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", name: with_secret})
        message = str(caught.value)
        assert message == f"{name} {refusal}", message
        assert main(["check", "--offline"], environ={"EVM_UPSTREAM": "http://127.0.0.1:1", name: with_secret}) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert f"{name} has a query option" in line and SECRET not in line and "bogus" not in line


@pytest.mark.parametrize(
    ("url", "option"),
    [
        ("rediss://h:6380/0?ssl_cert_reqs=bogus", "ssl_cert_reqs"),
        ("rediss://h:6380/0?ssl_cert_reqs=CERT_NONE", "ssl_cert_reqs"),
        ("redis://h:6379/0?protocol=9", "protocol"),
        ("redis://h:6379/0?socket_timeout=1&db=x", "db"),
        ("redis://h:6379/0?health_check_interval=soon", "health_check_interval"),
    ],
)
def test_a_query_option_value_redis_py_refuses_is_a_config_error_naming_it_in_serve_and_check(
    url: str, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule: any error redis-py raises building a connection from the URL (a RedisError as much as a
    ValueError) is a configuration error naming the setting and the option, never the URL, not a
    traceback; cluster and Sentinel URLs refuse every option they do not take."""
    _refused_in_serve_and_check(url, "has a query option whose value redis-py refuses: " + option, capsys)
    for url in ("rediss+cluster://h:7000?ssl_cert_reqs=bogus", "redis+sentinel://s:26379/svc?protocol=9"):
        with pytest.raises(ConfigError, match="does not take"):
            build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "REDIS_URL": url})


def test_a_single_server_url_with_options_redis_py_takes_is_accepted() -> None:
    for url in (
        "redis://h:6379/0?socket_timeout=2&client_name=p&protocol=3",
        "rediss://h:6379/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none",
    ):
        assert build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "REDIS_URL": url}).redis_url == url


def test_a_single_server_url_with_a_numbered_database_or_none_is_accepted() -> None:
    for url in ("redis://h:6379/5", "redis://h:6379/", "redis://h:6379", "unix:///run/redis.sock?db=2"):
        assert build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "REDIS_URL": url}).redis_url == url


def test_valid_topology_urls_are_accepted_as_written() -> None:
    cluster, sentinel = "redis+cluster://a:1,b:2", "redis+sentinel://s:26379/svc/1"
    settings = build_settings(
        {"EVM_UPSTREAM": "http://127.0.0.1:1", "REDIS_URL": cluster, "CREDITS_REDIS_URL": sentinel}
    )
    assert (settings.redis_url, settings.credits_redis_url) == (cluster, sentinel)


def test_log_lines_never_carry_the_credentials_of_any_redis_url_form() -> None:
    for url in (
        f"redis+sentinel://user:{SECRET}@s1:26379,s2:26379/mymaster/0",
        f"rediss+cluster://:{SECRET}@h1:7000,h2:7001",
        "redis://:p@ss@h:6379/0",
    ):
        line = redacted(f"connecting to {url} failed")
        assert "<credentials>@" in line and "s3cr" not in line and "p@ss" not in line


# --- hash tags: every multi-key command's keys share a slot --------------------------------


@pytest.mark.parametrize("name", ["alice", "key-0123456789ab", "a{b}c", "}x", "{", "", "100%", "Ünïcode"])
def test_the_lease_scripts_two_keys_share_a_slot_whatever_the_key_name(name: str) -> None:
    day = 20_000
    assert slot(ledger_key(name, day)) == slot(rate_key(name))


def test_slot_tags_of_different_names_differ() -> None:
    assert len({slot_tag(n) for n in ("a{", "a%7B", "a}", "a%7D", "", "%")}) == 6


def test_an_answer_and_its_fill_lock_share_a_slot_while_answers_spread_over_slots() -> None:
    keys = [cache_key("evm@1:00", "eth_getStorageAt", ["0x11", hex(i), {"n": i}]) for i in range(2000)]
    for key in keys[:200]:
        answer, lock = shared_keys(key)
        assert slot(answer) == slot(lock) and answer != lock
    slots = {slot(shared_keys(key)[0]) for key in keys}
    assert len(slots) > 1800  # 2000 keys over 16384 slots: nearly all distinct, none piled on one


async def test_each_url_form_gets_the_client_of_its_topology_with_the_links_short_timeouts() -> None:
    single = connect("redis://127.0.0.1:1/2", 0.25)
    cluster = connect(f"redis+cluster://:{SECRET}@127.0.0.1:1,127.0.0.1:2", 0.25)
    sentinel = connect(f"rediss+sentinel://app:{SECRET}@127.0.0.1:3/svc/4?sentinel_password=sp", 0.25)
    try:
        assert type(single) is aioredis.Redis
        assert isinstance(cluster, RedisCluster)
        assert [n.name for n in cluster.nodes_manager.startup_nodes.values()] == ["127.0.0.1:1", "127.0.0.1:2"]
        assert cluster.nodes_manager.connection_kwargs["password"] == "s3cr@t"
        assert cluster.nodes_manager.connection_kwargs["socket_timeout"] == 0.25
        assert isinstance(sentinel, SentinelManagedRedis) and sentinel.sentinels is not None
        pool = sentinel.connection_pool
        assert pool.service_name == "svc"  # type: ignore[attr-defined]
        assert (
            pool.connection_kwargs["db"],
            pool.connection_kwargs["username"],
            pool.connection_kwargs["password"],
        ) == (4, "app", "s3cr@t")
        [watcher] = sentinel.sentinels.sentinels
        assert watcher.connection_pool.connection_kwargs["password"] == "sp"
        assert watcher.connection_pool.connection_kwargs["socket_timeout"] == 0.25
    finally:
        for client in (single, cluster, sentinel):
            await client.aclose()


@pytest.mark.parametrize(
    ("failure", "one_key"),
    [
        (TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"), True),
        (AskError("1234 127.0.0.1:7001"), True),
        (ClusterError("TTL exhausted."), True),
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), True),
        (ResponseError("OOM command not allowed when used memory > 'maxmemory'"), False),
        (RedisConnectionError("Connection refused"), False),
        (TimeoutError(), False),
    ],
)
async def test_a_failure_of_one_key_or_slot_leaves_the_breaker_shut(failure: Exception, one_key: bool) -> None:
    # Rule (docs/scaling.md): a key of another type, or a slot being resharded, fails that key's command
    # alone; each had opened the breaker, and Redis was skipped for every key.
    assert of_one_key(failure) is one_key
    link = RedisLink(aioredis.Redis(), timeout=1.0, metrics=Metrics(CollectorRegistry()))

    async def failing(_client: object) -> None:
        raise failure

    with pytest.raises(RedisUnavailable):
        await link.run("cache_get", failing)
    assert link.up is one_key
    await link.close()
