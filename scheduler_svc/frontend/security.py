"""Who may call the server: an API key checked on every call, and optional TLS or mutual TLS."""
from __future__ import annotations

import hmac

import grpc

# Load balancers and orchestrators probe health without credentials.
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


async def _unauthenticated(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong `authorization: Bearer <api key>`")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self.expected = f"Bearer {api_key}".encode()
        self.deny = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(OPEN_SERVICES):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, str):
            given = given.encode()
        if hmac.compare_digest(given, self.expected):
            return await continuation(details)
        return self.deny


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS with this certificate; with client_ca, clients must present a certificate it signed."""
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))],
        root_certificates=_read(client_ca) if client_ca else None,
        require_client_auth=client_ca is not None)
