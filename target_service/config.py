"""The target engine's settings: one dataclass, validated once, where it is built."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import splitspec.contract as defaults
from common.attention_backends import check_backend_name
from common.compiled_forward import CompileConfig
from common.dtypes import check_dtype_name
from common.kv_layout import CacheConfig
from target_service.draft_policy import SPECULATIVE_POLICIES

PROPOSE_TRANSPORTS = ("auto", "grpc")
IN_PROCESS_DRAFTER = "in-process"  # `drafter` of an engine given a drafter stub to call directly (draft_service/local.py)


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "auto"  # common.dtypes: auto | float32 | bfloat16 | float16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    max_waiting: int = 1024
    attention_backend: str = "auto"  # common.attention_backends.BACKEND_CHOICES
    cache: CacheConfig = field(default_factory=CacheConfig)
    enable_prefix_caching: bool = defaults.ENABLE_PREFIX_CACHING  # reuse cached full pages of earlier prompts
    seed: int = 0
    hf_cache_dir: str | None = None
    drafter: str | None = None  # address of splitspec-draft; None → no speculation
    internal_token: str | None = None  # shared token for the internal channel
    num_speculative_tokens: int = defaults.NUM_SPECULATIVE_TOKENS  # the server's K: requests may ask fewer; 0: never
    drafter_timeout_s: float = defaults.PROPOSE_TIMEOUT_S  # per-step Propose deadline
    drafter_startup_wait_s: float = 30.0  # how long the first handshake may wait for the drafter
    speculative_disable_batch_size: int | None = None  # no drafts while this many sequences or more run
    speculative_policy: str = defaults.SPECULATIVE_POLICY  # adaptive (k per step) | fixed (K)
    propose_transport: str = "auto"  # PROPOSE_TRANSPORTS: auto (the pool's shm channel on a CPU) | grpc
    threads: int | None = None  # torch CPU threads of the engine thread; None → torch's default
    compile: CompileConfig = field(default_factory=CompileConfig)  # which step shapes run compiled
    native_forward: bool = True  # every step in one native call where the model allows (common/native_forward.py)
    # Hidden-state rows a drafter that reads them (DFlash, EAGLE-3) may be sent late: rows of steps
    # that ask no drafts are held there until a Propose asks, and a sequence that ends first costs
    # the drafter nothing. None: pool_planning.staging_rows (16 steps' budget, within 64 MiB).
    staging_rows: int | None = None

    def __post_init__(self) -> None:
        if self.drafter and not self.internal_token:
            raise ValueError("a drafter needs the internal token (SPLITSPEC_INTERNAL_TOKEN or --internal-token-file)")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_policy must be one of {', '.join(SPECULATIVE_POLICIES)}, "
                             f"got {self.speculative_policy!r}")
        if self.propose_transport not in PROPOSE_TRANSPORTS:
            raise ValueError(f"propose_transport must be one of {', '.join(PROPOSE_TRANSPORTS)}, "
                             f"got {self.propose_transport!r}")
        if self.drafter_timeout_s <= 0 or self.drafter_startup_wait_s < 0:
            raise ValueError("drafter timeouts must be positive")
        if not self.model:
            raise ValueError("model must name a local folder or a Hugging Face id")
        check_dtype_name(self.dtype)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_model_len", "speculative_disable_batch_size", "threads"):  # None: unset
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.staging_rows is not None and self.staging_rows < self.max_num_batched_tokens:
            raise ValueError(f"staging_rows must hold one step's tokens (max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}), got {self.staging_rows}")
        check_backend_name(self.attention_backend)

    def torch_device(self) -> torch.device:
        return torch.device(self.device)
