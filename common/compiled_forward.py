"""The model's forward for the step shapes that repeat, compiled once per shape bucket.

A decode or verify of a small batch on a small model is dispatch-bound: eagerly, every
norm, product, RoPE half and residual is its own op call (about 15 per layer), and the
step costs several times the arithmetic. Here the forward is cut at attention, as vLLM
cuts it for piecewise CUDA graphs: everything between two attentions (residual add, norm,
the o/gate-up/down/qkv products, q/k norms, RoPE) is one compiled *segment*, and the paged
attention with its KV writes runs between segments exactly as it does eagerly
(`backend.forward`), so no compiled code ever sees a page table or a sequence length.

Three segment kinds cover a model: `first` (embedding, RoPE tables, layer 0 up to its
attention), `middle` (the rest of layer i and layer i+1 up to its attention) and `last`
(the rest of the last layer and the final norm). Each takes the weights it uses as
arguments, so one compiled `middle` serves every layer of a bucket.

Buckets are token counts T of the flat batch: every T up to `exact_tokens` as it is
(decodes and verifies of small batches), then a few padded sizes up to `max_tokens`;
larger steps (prefill chunks) run eagerly. `prepare` compiles buckets up front (the
engine's and the draft model's warmup: every bucket); a bucket not prepared is compiled on
a background thread the first time a step needs it, and steps of that size run eagerly until
it is ready, so no step waits ~1-2 s for a compile (a `Propose` has a deadline). Compiling
lazily is not the default path: a compile thread shares the cores and the GIL with serving,
and with many engines in one process (bench/compare.py) it slowed every row for minutes. Padded rows run through
the row-wise segments (their attention output is zero) and are cut off before anything
reads them.

Backends: Inductor compiles each segment for the device its tensors are on: C++/OpenMP
kernels around oneDNN/MKL products on a CPU, Triton kernels on CUDA, where each compiled
segment is also captured as a CUDA graph (Inductor's `triton.cudagraphs`), so a replay
launches one graph per segment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from common.attention_backends import AttentionBackend
from common.attention_metadata import AttentionMetadata
from common.qwen3 import checked_capture_layers, rope_tables

log = logging.getLogger(__name__)

# torch.fx's tracer patches functions through one process-wide slot (`CURRENT_PATCHER`): two
# traces at once (the target's and an in-process drafter's compile threads) corrupt it. The
# lock is as process-wide as what it guards.
_TRACE_LOCK = threading.Lock()

PADDED_SIZES = (24, 32, 48, 64, 96, 128)


@dataclass(frozen=True)
class CompileConfig:
    """Which step shapes run compiled."""

    enabled: bool = False  # opt-in (`--compile`): startup compiles every bucket (~1 s each, see below)
    exact_tokens: int = 16  # every token count up to this is its own bucket
    max_tokens: int = 64  # the largest padded bucket; steps with more tokens run eagerly
    background: bool = True  # a bucket first needed mid-serving compiles on a thread (eager meanwhile)
    sizes: tuple[int, ...] = ()  # the buckets themselves, if given (ascending; the exact/max fields unused)

    def __post_init__(self) -> None:
        if self.exact_tokens < 1 or self.max_tokens < self.exact_tokens:
            raise ValueError(f"compile buckets need 1 <= exact_tokens <= max_tokens, got {self.exact_tokens} and "
                             f"{self.max_tokens}")
        if self.sizes and (self.sizes[0] < 1 or list(self.sizes) != sorted(set(self.sizes))):
            raise ValueError(f"compile bucket sizes must be positive and ascending, got {self.sizes}")

    def bucket(self, tokens: int) -> int | None:
        """The token count a step of `tokens` tokens runs compiled at, or None (eager)."""
        if self.sizes:
            return next((size for size in self.sizes if tokens <= size), None) if self.enabled and tokens >= 1 else None
        if not self.enabled or tokens < 1 or tokens > self.max_tokens:
            return None
        if tokens <= self.exact_tokens:
            return tokens
        return next((size for size in (*PADDED_SIZES, self.max_tokens) if tokens <= size <= self.max_tokens),
                    self.max_tokens)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors, in the order the segments take them (None: absent in this family)."""

    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None

    @classmethod
    def of(cls, layer) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
                   attn.q_norm.weight if attn.qk_norm else None, attn.k_norm.weight if attn.qk_norm else None,
                   attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                   mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in vars(self).values() if t is not None]


@dataclass(frozen=True)
class Shapes:
    """The model's static facts the segments are written for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float

    @property
    def qkv_sizes(self) -> tuple[int, int, int]:
        kv = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim, kv, kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """common.qwen3.RMSNorm's values: torch's fused norm in float32, else in float32 and cast back."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """common.qwen3.apply_rope: x [T, H, D], cos/signed_sin [T, D]."""
    tokens, heads, dim = x.shape
    swapped = x.reshape(tokens, heads, 2, dim // 2).flip(2).reshape(tokens, heads, dim)
    return x * cos[:, None, :] + swapped * signed_sin[:, None, :]


def attention_inputs(x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                     s: Shapes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, hidden] → q [T, Hq, D], k and v [T, Hkv, D], normed and rotated as the eager layer does."""
    tokens = x.shape[0]
    q, k, v = F.linear(rms_norm(x, w.input_norm, s.eps), w.qkv_weight, w.qkv_bias).split(s.qkv_sizes, dim=-1)
    q = q.reshape(tokens, s.num_heads, s.head_dim)
    k = k.reshape(tokens, s.num_kv_heads, s.head_dim)
    v = v.reshape(tokens, s.num_kv_heads, s.head_dim)
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, s.eps), rms_norm(k, w.k_norm, s.eps)
    return rope(q, cos, sin), rope(k, cos, sin), v.contiguous()


def after_attention(x: torch.Tensor, attended: torch.Tensor, w: LayerWeights, s: Shapes) -> torch.Tensor:
    """The rest of a layer: o projection and residual, then the MLP and its residual. [T, hidden]."""
    x = x + F.linear(attended.reshape(x.shape[0], -1), w.o_weight, w.o_bias)
    gate, up = F.linear(rms_norm(x, w.post_norm, s.eps), w.gate_up_weight, w.gate_up_bias).split(s.intermediate, -1)
    return x + F.linear(F.silu(gate) * up, w.down_weight, w.down_bias)


class Segments:
    """The three segment functions of one model, over `Shapes` (closed over: static)."""

    def __init__(self, shapes: Shapes, scaling: float, embed_scale: float = 1.0) -> None:
        self.shapes, self.scaling, self.embed_scale = shapes, scaling, embed_scale

    def first(self, input_ids, positions, embed, inv_freq, w: LayerWeights):
        """→ (hidden [T, hidden], cos [T, D], sin [T, D], q, k, v of layer 0)."""
        x = F.embedding(input_ids, embed)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        cos, sin = rope_tables(positions, inv_freq, self.scaling, x.dtype)  # [T, D] each
        return (x, cos, sin, *attention_inputs(x, w, cos, sin, self.shapes))

    def middle(self, x, attended, cos, sin, w: LayerWeights, w_next: LayerWeights):
        """→ (hidden after this layer [T, hidden], q, k, v of the next)."""
        x = after_attention(x, attended, w, self.shapes)
        return (x, *attention_inputs(x, w_next, cos, sin, self.shapes))

    def last(self, x, attended, w: LayerWeights, final_norm):
        """→ the final-normed hidden states [T, hidden]."""
        return rms_norm(after_attention(x, attended, w, self.shapes), final_norm, self.shapes.eps)


@dataclass
class CompileStats:
    """What compiling has cost so far (seconds, per bucket), for the startup log and the tests."""

    seconds: dict[int, float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)  # compiled steps run, by bucket
    eager_steps: int = 0  # steps of no bucket, or of one still compiling
    failed: dict[int, str] = field(default_factory=dict)  # buckets whose compile failed: eager for good


@dataclass(frozen=True)
class DecoderStack:
    """A decoder-only stack as the segments run it: embedding (times `embed_scale`), the
    layers, the final norm. `eager` is the same forward uncompiled, with CompiledForward's
    signature; `layer_spec(backend, i)` is the pool layer that layer i attends over."""

    args: Any  # common.qwen3.ModelArgs
    embed: torch.Tensor  # [V, hidden]
    rotary: torch.nn.Module  # common.qwen3.RotaryEmbedding: inv_freq [D/2], attention_scaling
    layers: Sequence[torch.nn.Module]  # common.qwen3.DecoderLayer
    final_norm: torch.Tensor  # [hidden]
    eager: Callable[..., tuple[torch.Tensor, dict[int, torch.Tensor]]]
    layer_spec: Callable[[AttentionBackend, int], Any]
    embed_scale: float = 1.0


def decoder_stack(model) -> DecoderStack:
    """The stack of a `common.qwen3.Qwen3ForCausalLM` (a target or a draft model)."""
    specs = model.kv_layer_specs()
    return DecoderStack(model.args, model.model.embed_tokens.weight, model.rotary, model.model.layers,
                        model.model.norm.weight, model, lambda backend, i: specs[i])


class BucketCompiler:
    """Compiled code per token-count bucket: compiled up front (`prepare`), or on a background
    thread the first time a step needs it (eager meanwhile), or given up on if it fails.
    Subclasses say what one bucket compiles to (`_compile`)."""

    def __init__(self, config: CompileConfig, name: str) -> None:
        self.config, self.name = config, name
        self.stats = CompileStats()
        self._compiled: dict[int, tuple] = {}  # bucket → its compiled callables
        self._pending: dict[int, Future] = {}  # buckets compiling in the background
        self._executor: ThreadPoolExecutor | None = None

    def buckets(self) -> list[int]:
        """Every bucket of the config, smallest first (none when disabled)."""
        if self.config.sizes:
            return list(self.config.sizes) if self.config.enabled else []
        return sorted({self.config.bucket(t) for t in range(1, self.config.max_tokens + 1)} - {None})

    def prepare(self, token_counts: Sequence[int]) -> None:
        """Compile the buckets of these step sizes now, in this thread, so that no step runs them eagerly."""
        for bucket in sorted({self.config.bucket(t) for t in token_counts} - {None} - set(self._compiled)):
            self._compile_or_give_up(bucket)

    def wait_ready(self) -> None:
        """Block until every background compile has ended (tests, benchmarks)."""
        for future in list(self._pending.values()):
            future.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def ready_bucket(self, tokens: int) -> int | None:
        """The compiled bucket a step of `tokens` runs at now, or None: run it eagerly (counted)."""
        bucket = self.config.bucket(tokens)
        if bucket is not None and bucket not in self._compiled and not self._start_compiling(bucket):
            bucket = None
        if bucket is None:
            self.stats.eager_steps += 1
        else:
            self.stats.steps[bucket] = self.stats.steps.get(bucket, 0) + 1
        return bucket

    def _start_compiling(self, bucket: int) -> bool:
        """Whether `bucket` can run compiled now: compiled in this thread (not `background`), or
        not yet, with its compile started (or running, or failed before) on the background thread."""
        if bucket in self.stats.failed:
            return False
        if not self.config.background:
            return self._compile_or_give_up(bucket)
        if bucket not in self._pending:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="splitspec-compile")
            self._pending[bucket] = self._executor.submit(self._compile_or_give_up, bucket)
        return False

    def _compile_or_give_up(self, bucket: int) -> bool:
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                self._compiled[bucket] = self._compile(bucket)
        except Exception as exc:  # noqa: BLE001  a bucket that cannot compile runs eagerly, as before
            self.stats.failed[bucket] = f"{type(exc).__name__}: {exc}"
            log.warning("%s: bucket of %d tokens failed to compile, runs eagerly: %s", self.name, bucket,
                        self.stats.failed[bucket])
            return False
        self.stats.seconds[bucket] = time.perf_counter() - started
        log.info("%s: bucket of %d tokens ready in %.1f s", self.name, bucket, self.stats.seconds[bucket])
        return True

    def _compile(self, bucket: int) -> tuple:
        raise NotImplementedError


class CompiledForward(BucketCompiler):
    """A decoder stack's forward (`DecoderStack.eager`'s signature and values), compiled per
    token-count bucket.

    Steps whose token count has no bucket (or every step, when disabled) call the eager
    forward. Each segment is traced to an aten graph (`make_fx`) and compiled by
    Inductor directly, not through `torch.compile`'s frame hooks: a step calls seven
    segments, and dynamo's guards on their two dozen weight arguments cost ~20 µs a call,
    where the compiled graph's own wrapper costs ~5."""

    def __init__(self, stack: DecoderStack, config: CompileConfig, name: str = "compiled forward",
                 frozen_weights: bool = False) -> None:
        """`frozen_weights`: compile each layer's segment with its weights as constants, which lets
        Inductor pack them for oneDNN (bfloat16 products on a CPU take half the time packed), at the
        price of a graph per layer and a packed copy of the weights per bucket; else one `middle`
        graph takes every layer's weights as arguments."""
        super().__init__(config, name)
        self.stack, self.frozen_weights = stack, frozen_weights
        args = stack.args
        shapes = Shapes(args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size, args.rms_norm_eps)
        self._segments = Segments(shapes, stack.rotary.attention_scaling, stack.embed_scale)
        self._layers = [LayerWeights.of(layer) for layer in stack.layers]
        self._present = [name for name, t in vars(self._layers[0]).items() if t is not None]
        self._flat = [[getattr(w, name) for name in self._present] for w in self._layers]
        self._scale = stack.layers[0].self_attn.scale

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
        backend: AttentionBackend,
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        tokens = input_ids.shape[0]
        bucket = self.ready_bucket(tokens)
        if bucket is None:
            return self.stack.eager(input_ids, positions, meta, kv_caches, backend, capture_layers)
        if tokens != meta.num_tokens or positions.shape[0] != tokens:
            raise ValueError(f"forward: {tokens} ids and {positions.shape[0]} positions for {meta.num_tokens} tokens "
                             "in the attention metadata")
        wanted = checked_capture_layers(capture_layers, len(self._layers))
        if bucket != tokens:  # pad rows: token 0 at position 0, cut off before anything reads them
            input_ids = F.pad(input_ids, (0, bucket - tokens))
            positions = F.pad(positions, (0, bucket - tokens))
        first, middles, last = self._compiled[bucket]
        return self._run(first, middles, last, tokens, input_ids, positions, kv_caches, backend, wanted)

    def _run(self, first, middles, last, tokens, input_ids, positions, kv_caches, backend, wanted):
        """first(ids, positions), middles[i](x, attended, cos, sin) after layer i's attention, last(x, attended)."""
        stack = self.stack
        x, cos, sin, q, k, v = first(input_ids, positions)
        captured: dict[int, torch.Tensor] = {}
        count = len(self._flat)
        for i in range(count):
            attended = self._attend(q, k, v, tokens, kv_caches[i], backend, stack.layer_spec(backend, i))
            if i + 1 < count:
                x, q, k, v = middles[i](x, attended, cos, sin)
                if i in wanted:
                    captured[i] = x[:tokens]
        (hidden,) = last(x, attended)
        hidden = hidden[:tokens]
        if count - 1 in wanted:
            captured[count - 1] = hidden
        return hidden, captured

    def _weights(self, tensors: Sequence[torch.Tensor]) -> LayerWeights:
        given = dict(zip(self._present, tensors, strict=True))
        return LayerWeights(**{name: given.get(name) for name in vars(self._layers[0])})

    def _compile(self, bucket: int) -> tuple:
        """Trace and compile the three segments for `bucket` rows, on example inputs of that shape."""
        n, segments, weights, stack, args = len(self._present), self._segments, self._weights, self.stack, self.stack.args
        device = stack.embed.device
        input_ids, positions = (torch.zeros(bucket, dtype=torch.long, device=device) for _ in range(2))
        hidden = stack.embed.new_zeros(bucket, args.hidden_size)
        attended = hidden.new_zeros(bucket, args.num_heads, args.head_dim)
        cos, sin = (hidden.new_zeros(bucket, args.head_dim) for _ in range(2))  # distinct: the compiler
        # treats one tensor passed twice as one input, and the graph would read cos for sin

        flat, layers, embed, inv_freq, norm = self._flat, self._layers, stack.embed, stack.rotary.inv_freq, stack.final_norm
        if self.frozen_weights:  # weights as constants: one graph per layer boundary
            def frozen_middle(i: int):
                return _compile_graph(lambda x, att, c, s: segments.middle(x, att, c, s, layers[i], layers[i + 1]),
                                      [hidden, attended, cos, sin], freeze=True)

            return (
                _compile_graph(lambda ids, pos: segments.first(ids, pos, embed, inv_freq, layers[0]),
                               [input_ids, positions], freeze=True),
                [frozen_middle(i) for i in range(len(layers) - 1)],
                _compile_graph(lambda x, att: (segments.last(x, att, layers[-1], norm),), [hidden, attended],
                               freeze=True))

        def first(ids, pos, embed, inv_freq, *w):
            return segments.first(ids, pos, embed, inv_freq, weights(w))

        def middle(x, att, c, s, *w):
            return segments.middle(x, att, c, s, weights(w[:n]), weights(w[n:]))

        def last(x, att, *w):
            return (segments.last(x, att, weights(w[:n]), w[n]),)

        first_graph = _compile_graph(first, [input_ids, positions, embed, inv_freq, *flat[0]])
        middle_graph = _compile_graph(middle, [hidden, attended, cos, sin, *flat[0], *flat[1]]) if len(flat) > 1 else None
        last_graph = _compile_graph(last, [hidden, attended, *flat[-1], norm])
        return (
            lambda ids, pos: first_graph(ids, pos, embed, inv_freq, *flat[0]),
            [lambda x, att, c, s, i=i: middle_graph(x, att, c, s, *flat[i], *flat[i + 1]) for i in range(len(flat) - 1)],
            lambda x, att: last_graph(x, att, *flat[-1], norm))

    def _attend(self, q, k, v, tokens: int, kv_cache, backend: AttentionBackend, spec) -> torch.Tensor:
        """The paged attention of the real rows (writing their K/V), zeros for the padding."""
        out = backend.forward(q[:tokens], k[:tokens], v[:tokens], kv_cache, spec, self._scale)
        if out.shape[0] == q.shape[0]:
            return out.contiguous()  # the graphs were compiled for contiguous inputs; a backend may return a view
        return torch.cat([out, out.new_zeros(q.shape[0] - tokens, *out.shape[1:])])


class CompiledRows(BucketCompiler):
    """`fn(*rows, *weights)`, whose outputs are row-wise in its row inputs (row t of every
    output depends on row t of the inputs alone), compiled per row-count bucket: padded rows
    are zeros and cut off the outputs."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], weights: Sequence[torch.Tensor],
                 config: CompileConfig, name: str, frozen_weights: bool = False) -> None:
        super().__init__(config, name)
        self.fn, self.weights, self.frozen_weights = fn, list(weights), frozen_weights
        self._examples: list[torch.Tensor] | None = None  # one row of each row input, set by the first call

    def __call__(self, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._examples is None:
            self._examples = [row[:1] for row in rows]
        count = rows[0].shape[0]
        if not self._like_examples(rows):  # another dtype or width than the graphs were traced for
            self.stats.eager_steps += 1
            return self.fn(*rows, *self.weights)
        bucket = self.ready_bucket(count)
        if bucket is None:
            return self.fn(*rows, *self.weights)
        padded = [row if bucket == count else F.pad(row, (*(0, 0) * (row.dim() - 1), 0, bucket - count))
                  for row in rows]
        return tuple(out[:count] for out in self._compiled[bucket][0](*padded))

    def _like_examples(self, rows: Sequence[torch.Tensor]) -> bool:
        """Whether the compiled graphs take these rows (dtype, device and row shape as traced)."""
        return all(row.dtype == ex.dtype and row.device == ex.device and row.shape[1:] == ex.shape[1:]
                   for row, ex in zip(rows, self._examples, strict=True))

    def prepare_like(self, example_rows: Sequence[torch.Tensor], token_counts: Sequence[int]) -> None:
        """`prepare`, with one example row of each row input (dtypes and widths) given up front."""
        self._examples = [row[:1] for row in example_rows]
        self.prepare(token_counts)

    def _compile(self, bucket: int) -> tuple:
        if self._examples is None:
            raise RuntimeError(f"{self.name}: no example rows yet (prepare_like, or one eager call first)")
        example = [row.new_zeros(bucket, *row.shape[1:]) for row in self._examples]
        fn, weights = self.fn, self.weights
        if self.frozen_weights:
            return (_compile_graph(lambda *rows: fn(*rows, *weights), example, freeze=True),)
        graph = _compile_graph(fn, [*example, *weights])
        return (lambda *rows: graph(*rows, *weights),)


def _compile_graph(fn, example: list[torch.Tensor], freeze: bool = False):
    """`fn(*tensors)`, traced to aten ops on `example` and compiled by Inductor for those shapes.
    `freeze`: the tensors `fn` closes over are constants Inductor may fold and pack (its freezing).

    Inductor is handed fake copies of the example inputs under a fake mode with a shape
    environment: without one it bypasses its on-disk graph cache ("No shape env"), and every
    start would generate and compile each bucket's C++ again (~1 s a graph against ~25 ms)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with _TRACE_LOCK, torch.no_grad():
        graph = make_fx(fn)(*example)
        options = {"triton.cudagraphs": True} if example[0].device.type == "cuda" else {}
        if freeze:
            options["freezing"] = True
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = [fake_mode.from_tensor(tensor, static_shapes=True) for tensor in example]
        return torch._inductor.compile(graph, fakes, options=options)
