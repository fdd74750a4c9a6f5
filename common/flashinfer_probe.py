"""Can FlashInfer's attention kernels actually run here? (for `--attention-backend auto`)

`import flashinfer` working is not enough: its kernels are JIT modules. flashinfer-python
0.7.x (flashinfer/jit/core.py, JitSpecNvcc) loads a module from a prebuilt AOT artifact
(`jit.env.get_aot_artifacts`: the wheel's data/aot or a flashinfer-jit-cache package)
when one exists; otherwise it always runs `ninja` on the module's build file in its JIT
cache (`jit.env.FLASHINFER_JIT_DIR/<name>/`), which compiles with nvcc
(`FLASHINFER_NVCC`, else `<cuda home>/bin/nvcc`, the CUDA home from CUDA_HOME /
CUDA_PATH / `which nvcc` / /usr/local/cuda: `jit.cpp_ext.get_cuda_path`) unless the cached
`.so` is up to date. `FLASHINFER_DISABLE_JIT` forbids the build.

So FlashInfer can run when, for every module the backend needs (the FA2 batch-prefill
module per query dtype, KV dtype and head dim, which also serves decode with tensor cores,
and the page module for `append_paged_kv_cache`), there is an AOT artifact, or ninja and
nvcc to build it, or ninja, a CUDA home and an up-to-date JIT cache entry.
`why_flashinfer_cannot_run` decides that from plain facts; `gather_facts` collects them
with FlashInfer's own functions.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# The kernel family the backend asks FlashInfer for (FlashInferAttentionBackend's
# kernel_backend): FA2 runs on every GPU FlashInfer supports and is what the GPU checks
# compare against the torch backend.
KERNEL_FAMILY = "fa2"
PAGE_MODULE = "page"


@dataclass(frozen=True)
class FlashInferFacts:
    needed_modules: tuple[str, ...]
    aot_modules: frozenset[str] = frozenset()  # those of needed_modules with a prebuilt artifact
    jit_cached_modules: frozenset[str] = frozenset()  # those with a built .so in the JIT cache
    nvcc: str | None = None  # the compiler FlashInfer would run, when it exists
    ninja: str | None = None
    cuda_home: str | None = None
    jit_disabled: bool = False  # FLASHINFER_DISABLE_JIT
    jit_dir: str = ""
    notes: tuple[str, ...] = field(default=())  # what could not be checked


def why_flashinfer_cannot_run(facts: FlashInferFacts) -> str | None:
    """None when every needed module can be loaded or built; else why not, for a log line."""
    missing = [m for m in facts.needed_modules if m not in facts.aot_modules]
    if not missing:
        return None
    names = ", ".join(missing)
    if facts.jit_disabled:
        return f"FLASHINFER_DISABLE_JIT is set and FlashInfer has no prebuilt (AOT) kernels for {names}"
    if facts.ninja is None:
        return f"ninja is not on PATH (FlashInfer builds and loads its JIT kernels with it) for {names}"
    if facts.nvcc is not None:
        return None  # the first use compiles what is missing
    if facts.cuda_home is not None and all(m in facts.jit_cached_modules for m in missing):
        return None  # ninja finds the cached builds up to date
    cached = [m for m in missing if m in facts.jit_cached_modules]
    return (f"no CUDA compiler (nvcc not found: set CUDA_HOME or put nvcc on PATH) to build FlashInfer's "
            f"kernels {names}, and no prebuilt (AOT) kernels or JIT cache ({facts.jit_dir or 'unknown'}) "
            f"hold {', '.join(m for m in missing if m not in cached)}")


def needed_modules(head_dims: tuple[int, ...], q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[str, ...]:
    """FlashInfer's names of the JIT modules FlashInferAttentionBackend loads (needs flashinfer)."""
    from flashinfer.jit.attention import modules

    names = [PAGE_MODULE]
    for head_dim in sorted(set(head_dims)):
        # the arguments flashinfer/prefill.py and decode.py pass to get_batch_prefill_module:
        # o dtype = q dtype, int32 page indices, no positional encoding, window, soft cap or fp16 qk
        base = modules.get_batch_prefill_uri(KERNEL_FAMILY, q_dtype, kv_dtype, q_dtype, torch.int32, head_dim,
                                             head_dim, 0, False, False, False)
        # the FA2 path loads the equal-stride "primary" variant (prefill.py get_batch_prefill_module)
        names.append(modules._get_batch_prefill_module_uri(base, KERNEL_FAMILY, "equal", "full"))
    return tuple(names)


def gather_facts(head_dims: tuple[int, ...], q_dtype: torch.dtype, kv_dtype: torch.dtype) -> FlashInferFacts:
    """The facts, read with FlashInfer's own lookups (call only where `import flashinfer` works)."""
    from flashinfer.jit import cpp_ext
    from flashinfer.jit import env as jit_env

    needed = needed_modules(head_dims, q_dtype, kv_dtype)
    notes = []
    try:
        cuda_home = cpp_ext.get_cuda_path()
    except RuntimeError as exc:
        cuda_home = None
        notes.append(str(exc))
    nvcc = os.environ.get("FLASHINFER_NVCC") or (os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None)
    nvcc = shutil.which(nvcc) if nvcc else None
    try:
        aot = frozenset(m for m in needed if jit_env.get_aot_artifacts(m))
    except Exception as exc:  # noqa: BLE001 - e.g. no CUDA device to pick artifacts for
        aot = frozenset()
        notes.append(f"AOT lookup failed: {type(exc).__name__}: {exc}")
    jit_dir = jit_env.FLASHINFER_JIT_DIR
    cached = frozenset(m for m in needed if (jit_dir / m / f"{m}.so").is_file())
    return FlashInferFacts(needed, aot, cached, nvcc, shutil.which("ninja"), cuda_home,
                           bool(os.environ.get("FLASHINFER_DISABLE_JIT")), str(jit_dir), tuple(notes))


def flashinfer_runnable_reason(
    head_dims: tuple[int, ...],
    model_dtype: torch.dtype | None,
    kv_dtype: torch.dtype | None,
    gather: Callable[[tuple[int, ...], torch.dtype, torch.dtype], FlashInferFacts] | None = None,
) -> str | None:
    """Why FlashInfer cannot run this model's attention here (None: it can). Call it only
    where `import flashinfer` works; unknown dtypes count as bfloat16 (queries) and the
    query dtype (pages)."""
    q_dtype = model_dtype or torch.bfloat16
    try:
        facts = (gather or gather_facts)(tuple(head_dims), q_dtype, kv_dtype or q_dtype)
    except Exception as exc:  # noqa: BLE001 - a flashinfer whose internals moved: say so, use torch
        return f"cannot check FlashInfer's kernels ({type(exc).__name__}: {exc})"
    return why_flashinfer_cannot_run(facts)
