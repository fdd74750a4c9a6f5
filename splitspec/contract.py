"""Names outside the protobuf messages that clients, `splitspec up` and both services share.

It sits beside the generated stubs (splitspec/v1), below everything that uses it.
"""

from __future__ import annotations

TOKEN_ENV = "SPLITSPEC_INTERNAL_TOKEN"  # the internal channel's shared token, when no token file is given
REQUEST_ID_METADATA = "splitspec-request-id"  # initial metadata of a Generate stream: the request's id
