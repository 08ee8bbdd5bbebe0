"""Redis security, against private ``redis-server`` processes: AUTH, TLS (``rediss://``) and
per-replica ACL users under which a publisher can write only its own replica's keys
(docs/redis.md, "Access control").
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from router.bench.redis_server import LocalRedis
from router.core.index import PrefixIndex
from router.core.types import BlocksStored, Kind, ReplicaKey, Tier
from router.store.base import BatchChange, ReplicaInfo, ReplicaState
from router.store.codec import encode_change
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.sync import IndexSync
from tests.ports import free_port

PREFIX = "kvr"
SCHEMA = KeySchema(PREFIX, 8)


def acl_rules(replica: str, schema: KeySchema = SCHEMA) -> list[str]:
    """The ``ACL SETUSER`` rules of one publisher (docs/redis.md): its own replica's keys,
    its own change-stream shard, the registry set, the instance token and the stored shard
    count; data commands only."""
    p = schema.prefix
    return [
        "on",
        "resetkeys",
        f"~{p}:{{{replica}}}:*",
        f"~{schema.stream(schema.shard_of(replica))}",
        f"~{p}:replicas",
        f"~{p}:instance",
        f"~{schema.shards_key}",
        "resetchannels",
        "-@all",
        "+@read",
        "+@write",
        "+@stream",
        "+@transaction",
        "+@connection",
        "-@dangerous",
        "+eval",
        "+evalsha",
    ]


def _state(replica: str, hashes: list[int]) -> tuple[ReplicaState, tuple[BlocksStored, ...]]:
    st = ReplicaState(ReplicaKey(replica, 0), seq=1)
    events = (BlocksStored(tuple(hashes), Tier.GPU, Kind.KV),)
    st.apply(events)
    return st, events


def _names_on_different_shards() -> tuple[str, str]:
    a = "rack1-r1"
    for i in range(100):
        b = f"rack1-r{i + 2}"
        if SCHEMA.shard_of(b) != SCHEMA.shard_of(a):
            return a, b
    raise AssertionError("no two shards")


async def test_auth_required_and_wrong_password_is_a_clear_error(tmp_path: Path) -> None:
    with LocalRedis(tmp_path / "r", password="s3cret-pw") as server:
        good = RedisStore.from_url(server.url, SCHEMA)
        assert await good.instance_token()
        await good.close()
        for url in (
            f"redis://127.0.0.1:{server.port}/0",
            f"redis://:wrong@127.0.0.1:{server.port}/0",
        ):
            bad = RedisStore.from_url(url, SCHEMA)
            with pytest.raises(
                (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)
            ):
                await bad.instance_token()
            await bad.close()


async def test_acl_publisher_writes_only_its_own_replica(tmp_path: Path) -> None:
    mine, other = _names_on_different_shards()
    with LocalRedis(tmp_path / "r", password="admin-pw") as server:
        admin = aioredis.Redis.from_url(server.url)
        for name in (mine, other):
            await admin.execute_command(
                "ACL", "SETUSER", f"pub-{name}", f">pw-{name}", *acl_rules(name)
            )
        url = f"redis://pub-{mine}:pw-{mine}@127.0.0.1:{server.port}/0"
        pub = RedisStore.from_url(url, SCHEMA)
        # its own replica: the whole publisher protocol works
        assert await pub.settle_shards() is False  # the first to start: stores the count
        assert await admin.get(SCHEMA.shards_key) == b"8"
        await pub.register(ReplicaInfo(mine, url="http://x", model="m"), "owner-1", 10.0)
        state, events = _state(mine, [11, 12, 13])
        await pub.write([(state, events)])
        assert await pub.heartbeat(mine, "owner-1", 10.0)
        # another replica's keys: refused (meta, lease, state buckets)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await pub.register(ReplicaInfo(other, url="http://x", model="m"), "evil", 10.0)
        forged, forged_events = _state(other, [11, 12, 13])
        with pytest.raises(redis.exceptions.ResponseError):  # NOPERM inside MULTI: EXECABORT
            await pub.write([(forged, forged_events)])
        with pytest.raises(redis.exceptions.NoPermissionError):
            await pub.redis.hset(SCHEMA.kv(other, 0), "0", b"\x00" * 9)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await pub.redis.set(SCHEMA.lease(other), "evil")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await pub.redis.flushall()
        # the other replica's change-stream shard is closed to it
        with pytest.raises(redis.exceptions.NoPermissionError):
            await pub.redis.xadd(SCHEMA.stream(SCHEMA.shard_of(other)), {"t": "D", "r": other})

        # a forged entry naming the other replica on its *own* shard is dropped by routers
        router = RedisStore.from_url(server.url, SCHEMA)
        cursor = await router.cursor()
        forged_entry = encode_change(BatchChange(ReplicaKey(other, 0), 2, forged_events))
        await pub.redis.xadd(SCHEMA.stream(SCHEMA.shard_of(mine)), forged_entry)
        read = await router.read_changes(cursor, 0.2, 100)
        assert read.malformed == 1
        assert all(getattr(c, "key", None) != ReplicaKey(other, 0) for c in read.changes)

        # routers see the honest replica's blocks
        index = PrefixIndex()
        async with IndexSync(router, index):
            assert index.replica_size(ReplicaKey(mine, 0))[0] == 3
        await router.close()
        await pub.close()
        await admin.aclose()


async def test_a_publisher_cannot_register_in_another_replicas_name(tmp_path: Path) -> None:
    # publisher ``mine`` stores, in its own registration key (its ACL allows it), a
    # registration naming replica ``victim`` at an address of its choosing; routers
    # bootstrapping or auditing the registry must not route ``victim`` there
    victim, mine = "rack1-a", "rack1-z"  # (the forger's key sorts after the victim's)
    with LocalRedis(tmp_path / "r", password="admin-pw") as server:
        admin = aioredis.Redis.from_url(server.url)
        await admin.execute_command("ACL", "SETUSER", "pub", ">pw", *acl_rules(mine))
        honest = RedisStore.from_url(server.url, SCHEMA)
        await honest.register(ReplicaInfo(victim, url="http://10.0.0.2:8000", model="m"), "o", 30)
        pub = RedisStore.from_url(f"redis://pub:pw@127.0.0.1:{server.port}/0", SCHEMA)
        await pub.register(ReplicaInfo(mine, url="http://10.0.0.9:8000", model="m"), "o", 30)
        forged = ReplicaInfo(victim, url="http://169.254.169.254", model="m")
        await pub.redis.hset(SCHEMA.meta(mine), "info", forged.to_json())

        router = RedisStore.from_url(server.url, SCHEMA)
        index = PrefixIndex()
        async with IndexSync(router, index) as sync:
            assert sync.infos[victim].url == "http://10.0.0.2:8000"
            await sync.audit()
            assert sync.infos[victim].url == "http://10.0.0.2:8000"
        assert [i.url for i in await router.list_replicas() if i.replica == victim] == [
            "http://10.0.0.2:8000"
        ]
        for store in (router, pub, honest):
            await store.close()
        await admin.aclose()


async def test_a_publishers_deeply_nested_entry_is_malformed_not_a_stalled_stream(
    tmp_path: Path,
) -> None:
    # a publisher appends to its own shard an entry whose JSON (a load sample, a
    # registration) nests past the parser's recursion limit: routers count it malformed and
    # read on, rather than fail the same read forever
    mine = "rack1-r1"
    deep = b"[" * 100_000 + b"]" * 100_000
    with LocalRedis(tmp_path / "r", password="admin-pw") as server:
        admin = aioredis.Redis.from_url(server.url)
        await admin.execute_command("ACL", "SETUSER", "pub", ">pw", *acl_rules(mine))
        pub = RedisStore.from_url(f"redis://pub:pw@127.0.0.1:{server.port}/0", SCHEMA)
        router = RedisStore.from_url(server.url, SCHEMA)
        cursor = await router.cursor()
        stream = SCHEMA.stream(SCHEMA.shard_of(mine))
        await pub.redis.xadd(stream, {"t": "L", "r": mine, "d": "0", "l": deep})
        await pub.redis.xadd(stream, {"t": "U", "r": mine, "i": deep})
        honest = encode_change(BatchChange(ReplicaKey(mine, 0), 1, _state(mine, [5])[1]))
        await pub.redis.xadd(stream, honest)
        read = await router.read_changes(cursor, 0.2, 100)
        assert read.malformed == 2
        assert [getattr(c, "key", None) for c in read.changes] == [ReplicaKey(mine, 0)]
        await router.close()
        await pub.close()
        await admin.aclose()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _tls_files(d: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=d,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
        cwd=d,
    )
    return d / "ca.crt", d / "server.crt", d / "server.key"


async def test_tls_rediss_url_works_end_to_end(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make a throwaway CA")
    ca, cert, key = _tls_files(tmp_path / "tls")
    tls_port = free_port()
    server = LocalRedis(
        tmp_path / "r",
        password="tls-pw",
        extra_args=(
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(ca),
            "--tls-auth-clients",
            "no",
        ),
    )
    try:
        server.start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server build lacks TLS: {exc}")
        raise
    try:
        url = f"rediss://:tls-pw@127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}"
        store = RedisStore.from_url(url, SCHEMA)
        await store.register(ReplicaInfo("tls-r1", url="http://x", model="m"), "o", 10.0)
        state, events = _state("tls-r1", [5, 6])
        await store.write([(state, events)])
        index = PrefixIndex()
        async with IndexSync(store, index):
            assert index.replica_size(ReplicaKey("tls-r1", 0))[0] == 2
        await store.close()
        # plain TCP to the TLS port is refused; an unknown CA is refused
        plain = RedisStore.from_url(f"redis://:tls-pw@127.0.0.1:{tls_port}/0", SCHEMA)
        with pytest.raises(redis.exceptions.ConnectionError):
            await plain.instance_token()
        await plain.close()
        other_ca, _, _ = _tls_files(tmp_path / "other")
        wrong = RedisStore.from_url(
            f"rediss://:tls-pw@127.0.0.1:{tls_port}/0?ssl_ca_certs={other_ca}", SCHEMA
        )
        with pytest.raises(redis.exceptions.ConnectionError):
            await wrong.instance_token()
        await wrong.close()
    finally:
        server.stop()


def test_a_registration_with_more_ranks_than_a_replica_has_is_refused() -> None:
    """Every data-parallel rank of a registration becomes a routing key in every router: a
    publisher naming a million ranks (or one rank many times) is refused as a bad
    registration (skipped by discovery, as other bad ones are), not spread over the fleet.
    The configuration's own ``dp_ranks`` has the same bound."""
    import json

    from router.core.errors import ConfigError
    from router.service.config import build_settings
    from router.store.base import MAX_DP_RANKS, ReplicaInfo

    def info(ranks: list[int]) -> str:
        return json.dumps({"replica": "r", "model": "m", "dp_ranks": ranks})

    assert len(ReplicaInfo.from_json(info(list(range(MAX_DP_RANKS)))).dp_ranks) == MAX_DP_RANKS
    for bad in (list(range(MAX_DP_RANKS + 1)), [0, 0], [1 << 40]):
        with pytest.raises(ValueError, match="dp_ranks"):
            ReplicaInfo.from_json(info(bad))
    replica = {"url": "http://127.0.0.1:9", "model": "m", "dp_ranks": MAX_DP_RANKS + 1}
    with pytest.raises(ConfigError, match="dp_ranks"):
        build_settings({"replicas": [replica]})
