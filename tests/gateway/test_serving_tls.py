"""The gateway's own APIs over TLS (--ssl-certfile/--ssl-keyfile/--ssl-ca-certs): HTTPS and gRPC with the
operator's certificate, client certificates when a CA is given, and clear errors for unusable files."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest

from kvrelay.common.tls import serving_tls_from_flags
from kvrelay.gateway.config import GatewayConfig
from tests.helpers.gateway import GatewayThread
from tests.helpers.tls import make_test_pki

KEY = "sk-tls-test-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_test_pki(tmp_path_factory.mktemp("pki"))


def _settings(pki, **extra) -> dict:
    return dict(decode=("127.0.0.1:9",), api_key=KEY, health_interval=60, capacity_wait=0.0, port=0,
                ssl_certfile=str(pki["server"]), ssl_keyfile=str(pki["server_key"]), **extra)


@contextmanager
def _serving(pki, **extra) -> Iterator[str]:
    """The gateway over TLS on a free port; its address."""
    gw = GatewayThread(**_settings(pki, **extra))
    try:
        yield gw.address
    finally:
        gw.close()


def test_https_with_the_operators_certificate_and_no_plain_http(pki):
    with _serving(pki) as address:
        with httpx.Client(verify=ssl.create_default_context(cafile=str(pki["ca"]))) as client:
            assert client.get(f"https://{address}/health").status_code == 503  # answered: no decode node is up
            assert client.get(f"https://{address}/v1/models").status_code == 401
            models = client.get(f"https://{address}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert models.status_code == 200 and models.json()["object"] == "list"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{address}/health", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # not the CA the client trusts
            httpx.get(f"https://{address}/health", timeout=5)


def test_client_certificates_required_with_ssl_ca_certs(pki):
    with _serving(pki, ssl_ca_certs=str(pki["ca"])) as address:
        trusted = ssl.create_default_context(cafile=str(pki["ca"]))
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
            httpx.get(f"https://{address}/health", verify=trusted, timeout=5)
        trusted.load_cert_chain(str(pki["client"]), str(pki["client_key"]))
        assert httpx.get(f"https://{address}/health", verify=trusted, timeout=5).status_code == 503


def test_grpc_api_over_tls(pki):
    from kvrelay.gateway.grpc_api import start_grpc_server
    from kvrelay.gateway.runtime import Gateway
    from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2 as pb
    from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2_grpc as pb_grpc

    async def run() -> tuple[int, grpc.StatusCode]:
        gateway = Gateway(GatewayConfig(**_settings(pki)))
        await gateway.start()
        server = await start_grpc_server(gateway, "127.0.0.1", 0)
        target, auth = f"127.0.0.1:{gateway.grpc_port}", (("authorization", f"Bearer {KEY}"),)
        try:
            creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
            async with grpc.aio.secure_channel(target, creds) as channel:
                models = await pb_grpc.GatewayStub(channel).ListModels(pb.ModelsRequest(), metadata=auth, timeout=10)
            async with grpc.aio.insecure_channel(target) as channel:
                try:
                    await pb_grpc.GatewayStub(channel).ListModels(pb.ModelsRequest(), metadata=auth, timeout=5)
                    plain = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    plain = e.code()
        finally:
            await server.stop(0)
            await gateway.stop()
        return len(models.models), plain

    n, plain = asyncio.run(run())
    assert n == 1 and plain == grpc.StatusCode.UNAVAILABLE


def test_unusable_files_are_refused_with_the_reason(pki, tmp_path):
    assert serving_tls_from_flags(None, None) is None
    with pytest.raises(ValueError, match="give both --ssl-certfile and --ssl-keyfile"):
        serving_tls_from_flags(str(pki["server"]), None)
    with pytest.raises(ValueError, match="--ssl-ca-certs needs"):
        serving_tls_from_flags(None, None, str(pki["ca"]))
    with pytest.raises(ValueError, match="cannot read .*missing.pem"):
        serving_tls_from_flags(str(tmp_path / "missing.pem"), str(pki["server_key"]))
    with pytest.raises(ValueError, match="are not a certificate and its key"):
        serving_tls_from_flags(str(pki["server"]), str(pki["client_key"]))
