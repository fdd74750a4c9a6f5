"""Defaults that more than one process reads (the target, the drafter, `splitspec up`): one
definition each, imported where a flag or a config field needs it."""

from __future__ import annotations

NUM_SPECULATIVE_TOKENS = 8  # K, the most drafts a step asks a sequence for
PROPOSE_TIMEOUT_S = 2.0  # the per-step Propose deadline, after which the target decodes without drafts
