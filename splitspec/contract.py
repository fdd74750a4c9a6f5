"""Names outside the protobuf messages that clients, `splitspec up` and both services share.

It sits beside the generated stubs (splitspec/v1), below everything that uses it.
"""

from __future__ import annotations

TOKEN_ENV = "SPLITSPEC_INTERNAL_TOKEN"  # the internal channel's shared token, when no token file is given
REQUEST_ID_METADATA = "splitspec-request-id"  # initial metadata of a Generate stream: the request's id

# Defaults more than one process reads (the target, the drafter, `splitspec up`): one definition each.
NUM_SPECULATIVE_TOKENS = 8  # K, the most drafts a step asks a sequence for
PROPOSE_TIMEOUT_S = 2.0  # the per-step Propose deadline, after which the target decodes without drafts
SPECULATIVE_POLICIES = ("adaptive", "fixed")  # how many drafts a step asks for: what pays (0..K), or always K
SPECULATIVE_POLICY = "adaptive"
ENABLE_PREFIX_CACHING = True  # the target reuses the KV of cached full prompt pages (--no-prefix-caching: off)
