"""The drafter called directly in the target's process, through the same protobuf messages.

Only for measuring the cost of the split (gRPC, serialization, a second process): the
engine's `DrafterLink` takes this in place of the gRPC stub, so every other line of the
speculative step is the same.
"""

from __future__ import annotations

from draft_service import server
from draft_service.drafters import DrafterConfig, load_drafter
from draft_service.host import DrafterHost


class LocalDrafterStub:
    """DrafterStub's methods, served by a `DrafterHost` in this process (the server's own calls)."""

    def __init__(self, config: DrafterConfig) -> None:
        self.host = DrafterHost()
        self.host.serve(load_drafter(config))

    def Negotiate(self, request, timeout=None, metadata=None):  # noqa: N802 (the stub's names)
        return server.negotiate(self.host, request)

    def Attach(self, request, timeout=None, metadata=None):  # noqa: N802
        return server.attach(self.host, request)

    def Propose(self, request, timeout=None, metadata=None):  # noqa: N802
        return server.propose(self.host, request)

    def Release(self, request, timeout=None, metadata=None):  # noqa: N802
        return server.release(self.host, request)
