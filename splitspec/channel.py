"""Client channels to a splitspec service: plaintext, or TLS trusting a CA bundle file.

One place for the `--tls-ca` logic of every client: the `splitspec` commands (blocking
channels), `splitspec bench` and `splitspec-gateway` (asyncio channels).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

ChannelOptions = Sequence[tuple[str, int | str]]


def tls_credentials(tls_ca: str) -> grpc.ChannelCredentials:
    """Credentials trusting the CA certificates in the PEM file `tls_ca`; ValueError naming it."""
    try:
        roots = Path(tls_ca).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read --tls-ca {tls_ca}: {exc.strerror or exc}") from exc
    return grpc.ssl_channel_credentials(root_certificates=roots)


def open_channel(address: str, tls_ca: str | None = None, options: ChannelOptions = ()) -> grpc.Channel:
    """A blocking channel: plaintext, or TLS when `tls_ca` names a CA bundle."""
    if tls_ca is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls_credentials(tls_ca), options=options)


def open_aio_channel(address: str, tls_ca: str | None = None, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """An asyncio channel: plaintext, or TLS when `tls_ca` names a CA bundle."""
    if tls_ca is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls_credentials(tls_ca), options=options)
