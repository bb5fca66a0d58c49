"""The embedded Redis of `kvrelay up` takes only the fleet's ACL user (kvrelay.index.redis_server); an external
Redis over TLS (`rediss://`) serves the index clients and the gateway's rate limits."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat

import pytest
import redis

from kvrelay.common.process import ChildProcess, ProcessStartError
from kvrelay.index.redis_server import redact, start_redis
from tests.helpers.tls import make_test_pki


def test_a_password_protected_redis_refuses_other_clients(tmp_path):
    with start_redis(tmp_path / "r.sock", workdir=tmp_path / "wd", password="s3cret-pass") as server:
        assert server.url == f"unix://kvrelay:s3cret-pass@{tmp_path / 'r.sock'}?db=0"
        assert redis.Redis.from_url(server.url).ping()
        for url in (f"unix://{tmp_path / 'r.sock'}?db=0", f"unix://kvrelay:wrong@{tmp_path / 'r.sock'}?db=0",
                    f"unix://default:s3cret-pass@{tmp_path / 'r.sock'}?db=0"):
            with pytest.raises(redis.AuthenticationError):
                redis.Redis.from_url(url).ping()
        assert "s3cret-pass" not in " ".join(server.process.argv)  # ps shows no password
        conf = tmp_path / "wd" / "redis-acl.conf"
        assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "r.sock").st_mode) & 0o077 == 0  # the socket: its owner only


def test_redact_hides_passwords_only():
    assert redact("redis://kvrelay:pw@127.0.0.1:6379/0") == "redis://kvrelay:***@127.0.0.1:6379/0"
    assert redact("unix://kvrelay:pw@/tmp/r.sock?db=0") == "unix://kvrelay:***@/tmp/r.sock?db=0"
    assert redact("rediss://h:6380/0") == "rediss://h:6380/0"


def _tls_redis(tmp_path, port: int) -> ChildProcess:
    pki = make_test_pki(tmp_path)
    argv = [shutil.which("redis-server"), "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(pki["server"]),
            "--tls-key-file", str(pki["server_key"]), "--tls-ca-cert-file", str(pki["ca"]), "--tls-auth-clients", "no",
            "--requirepass", "tls-pass", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    return ChildProcess.start("redis-tls", argv, log_dir=tmp_path)


def test_rediss_with_the_servers_ca_serves_the_index_and_the_rate_limits(tmp_path):
    from kvrelay.common.system import free_port
    from kvrelay.gateway.auth import Principal
    from kvrelay.gateway.ratelimit import RateLimiter, burst
    from kvrelay.index.redis_index import connect

    port = free_port()
    url = f"rediss://:tls-pass@127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'ca.pem'}"

    def answers() -> bool:
        try:
            return connect(url, 0.5).ping()
        except redis.ConnectionError:
            return False

    with _tls_redis(tmp_path, port) as server:
        try:
            server.wait_ready(answers, timeout_s=10)
        except ProcessStartError as e:
            if "TLS" in str(e) and "not" in str(e).lower():
                pytest.skip(f"this redis-server has no TLS: {e}")
            raise

        async def admit() -> int:
            # The limiter gives Redis 0.25 s (connect and TLS handshake included) before it falls back to its own
            # buckets; with the cores loaded by other tests that can run out, so a fallback is tried again with a
            # new limiter (its local buckets never touch Redis).
            for _ in range(5):
                limiter = RateLimiter(url, "gw-tls")
                await limiter.start()
                try:
                    decision = await limiter.admit(Principal("k-tls", rpm=60))
                    if limiter.redis_error is None:
                        return decision.requests.remaining
                finally:
                    await limiter.stop()
            raise AssertionError(f"the limiter never reached the TLS Redis: {limiter.redis_error}")

        assert asyncio.run(admit()) == burst(60) - 1  # a full burst, one taken, in the Redis behind TLS
        assert connect(url).exists("kvr:rl:{k-tls}:r")
        with pytest.raises(redis.ConnectionError):  # plain text to the TLS port
            connect(f"redis://:tls-pass@127.0.0.1:{port}/0", 0.5).ping()
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):  # a CA it does not trust
            connect(f"rediss://:tls-pass@127.0.0.1:{port}/0", 0.5).ping()
        assert redact(url) == f"rediss://:***@127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'ca.pem'}"
