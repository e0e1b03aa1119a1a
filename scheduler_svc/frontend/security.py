"""Who may call the server: an API key checked on every call, and optional TLS or mutual TLS."""
from __future__ import annotations

import hmac

import grpc

# Load balancers and orchestrators probe health without credentials.
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


async def _unauthenticated(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong `authorization: Bearer <api key>`")


def bearer_token(authorization: str | bytes) -> bytes | None:
    """The credentials of `Bearer <token>`; the scheme is case-insensitive (RFC 9110 11.1), and one
    or more spaces may follow it. None for another scheme or none."""
    if isinstance(authorization, str):
        authorization = authorization.encode()
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip(b" "):
        return None
    return token.strip(b" ")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self.expected = api_key.encode()
        self.deny = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(OPEN_SERVICES):
            return await continuation(details)
        token = bearer_token(dict(details.invocation_metadata or ()).get("authorization", ""))
        # constant time in the key: how much of a guess matched does not show in the reply's timing
        if token is not None and hmac.compare_digest(token, self.expected):
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
