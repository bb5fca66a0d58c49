"""The embedded Redis of `kvrelay up` takes only the fleet's ACL user (kvrelay.index.redis_server)."""

from __future__ import annotations

import os
import stat

import pytest
import redis

from kvrelay.index.redis_server import redact, start_redis


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
