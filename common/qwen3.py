"""Our own Qwen3 forward over the paged KV pool (Llama and Qwen2 checkpoints fit too).

Only the checkpoint's config comes from transformers (AutoConfig); the modules here
use Hugging Face tensor names, so safetensors load straight into them.

The batch is token-flat (see `AttentionMetadata`): `forward` takes [T] token ids and
positions, runs every layer through the attention backend (which the caller has
`plan()`ned for this step's metadata), and returns the final-normed hidden states.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.attention_backends import AttentionBackend
from common.attention_metadata import AttentionMetadata
from common.kv_layout import LayerSpec
from common.weights import iter_safetensors, load_config, resolve_model_path

KV_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")
# Tensors some checkpoints carry that a forward recomputes: skipped, not "unexpected".
IGNORED_NAME = re.compile(r"\.rotary_emb\.inv_freq$")
FINGERPRINT_ROWS = 64
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not match the model built from its config."""


@dataclass(frozen=True)
class ModelArgs:
    """What the forward needs from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, config) -> ModelArgs:
        model_type = config.model_type
        if model_type not in ("qwen3", "llama", "qwen2"):
            raise ValueError(f"unsupported architecture {model_type!r} (expected qwen3, llama or qwen2)")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(
                f"unsupported activation {config.hidden_act!r}: only silu (SwiGLU) is implemented"
            )
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            qk_norm=model_type == "qwen3",
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def product_shapes(self) -> list[tuple[int, int, int, bool]]:
        """(in, out, how many per token, bias) of every linear a token's forward multiplies by."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layers = self.num_layers
        return [(self.hidden_size, q_dim + 2 * kv_dim, layers, self.qkv_bias), (q_dim, self.hidden_size, layers, self.o_bias),
                (self.hidden_size, 2 * self.intermediate_size, layers, self.mlp_bias),
                (self.intermediate_size, self.hidden_size, layers, self.mlp_bias),
                (self.hidden_size, self.vocab_size, 1, False)]


def checked_capture_layers(capture_layers: Sequence[int], num_layers: int) -> set[int]:
    """The layers a forward is asked to capture, each checked to be one of its `num_layers`."""
    wanted = set(capture_layers)
    if any(not 0 <= i < num_layers for i in wanted):
        raise ValueError(f"capture_layers {sorted(wanted)} outside 0..{num_layers - 1}")
    return wanted


# ---------------------------------------------------------------------------------------
# Rotary position embedding (neox style: rotate_half over the whole head).


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the attention scaling of the config's rope."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]
        return 1.0 / (theta**exponents), 1.0
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE)})")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(
            f"partial rotary embeddings are not supported ({inv_freq.numel() * 2} of {head_dim} dims)"
        )
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        with torch.device("cpu"):  # real values even when the model is built on "meta"
            inv_freq, self.attention_scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos [T, D] and the signed sin [T, D] (its first half negated) that `apply_rope` takes."""
        return rope_tables(positions, self.inv_freq, self.attention_scaling, dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], inv_freq [D/2] → cos [T, D] and the signed sin [T, D] that `apply_rope` takes
    (also inside the compiled segments, which must compute the same values)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def swap_halves(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] → [T, H, D]: (x1, x2) → (x2, x1)
    tokens, heads, dim = x.shape
    return x.reshape(tokens, heads, 2, dim // 2).flip(2).reshape(tokens, heads, dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/signed_sin [T, D] (RotaryEmbedding) → [T, H, D].

    The neox rotation x·cos + rotate_half(x)·sin with rotate_half(x) = (−x2, x1), the sign folded
    into the sin: one op per step instead of chunk, negate and cat, the same values bit for bit."""
    return x * cos[:, None, :] + swap_halves(x) * signed_sin[:, None, :]


# ---------------------------------------------------------------------------------------
# Modules (attribute names follow the Hugging Face tensor names).


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's fused kernel: the same values as below in float32, one op instead of eight
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Hugging Face's order (normalise in float32, round, then scale in x's dtype), with the
        # float32 part fused: bit for bit x32 * rsqrt(mean(x32²) + eps), four ops instead of eight
        normalized = nn.functional.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normalized.to(x.dtype)


class StackedLinear(nn.Linear):
    """One product for several projections of the same input (q/k/v, gate/up), as one weight.

    Checkpoints store the parts apart (`q_proj.weight`, ...): `checkpoint_layout` names them
    for the loader and `stack_checkpoint_parts` stacks them along the output dim, in `parts`
    order. One product of the stacked weight costs less than one per part (on a CPU each
    product call has a fixed cost that a decode of one row is dominated by)."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = tuple(parts)  # checkpoint names of the parts, siblings of this module
        self.sizes = tuple(parts.values())  # output features of each part


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        q_dim, kv_dim = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_sizes = (q_dim, kv_dim, kv_dim)  # the split of qkv_proj's output (packing swaps the layer)
        self.qkv_proj = StackedLinear(args.hidden_size, dict(zip(("q_proj", "k_proj", "v_proj"), self.qkv_sizes)),
                                      bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.qk_norm = args.qk_norm

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        spec: LayerSpec,
    ) -> torch.Tensor:  # [T, hidden]
        tokens = x.shape[0]
        q, k, v = self.project(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        q, k = self.rotate(q, k, cos, sin)
        out = backend.forward(q, k, v, kv_cache, spec, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, hidden] → q [T, Hq, D], k and v [T, Hkv, D]: views into one product."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return (q.view(tokens, self.num_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim),
                v.view(tokens, self.num_kv_heads, self.head_dim))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k norms (Qwen3), then RoPE; cos/sin [T, D] from RotaryEmbedding."""
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = StackedLinear(
            args.hidden_size, {"gate_proj": args.intermediate_size, "up_proj": args.intermediate_size},
            bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] → [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, kv_cache, backend, spec) -> torch.Tensor:  # [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, backend, spec)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """`model.*` in the checkpoint: embedding, layers, final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config, *, kv_scales: Mapping[tuple[int, str], float] | None = None) -> None:
        super().__init__()
        self.config = config
        self.args = ModelArgs.from_config(config)
        self.model = DecoderStack(self.args)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, self.args.head_dim)
        self._specs = _layer_specs(self.args, kv_scales or {})

    # -- loading ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype, device: torch.device | str
    ) -> Qwen3ForCausalLM:
        """Build from a checkpoint folder (or cached HF id); strict about tensor names."""
        folder = resolve_model_path(str(path))
        device = torch.device(device)
        config = load_config(folder)
        with torch.device("meta"):
            model = cls(config)
        expected, stacked = checkpoint_layout(model)
        if model.args.tie_word_embeddings:
            expected.pop("lm_head.weight")
        state, scales = _read_checkpoint(folder, dtype, device, expected)
        model.load_state_dict(stack_checkpoint_parts(state, stacked), strict=False, assign=True)
        if model.args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model._specs = _layer_specs(model.args, scales)
        return model.to(device).eval().requires_grad_(False)

    # -- forward ------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] → [T, hidden]
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],  # index = layer
        backend: AttentionBackend,
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Final-normed hidden states [T, hidden], and {layer: hidden state after that layer}.

        Captures follow Hugging Face `output_hidden_states[layer + 1]`: the residual stream
        after the layer, except for the last layer, which HF reports after the final norm.
        """
        if input_ids.shape[0] != meta.num_tokens or positions.shape[0] != meta.num_tokens:
            raise ValueError(
                f"forward: {input_ids.shape[0]} ids and {positions.shape[0]} positions "
                f"for {meta.num_tokens} tokens in the attention metadata"
            )
        wanted = checked_capture_layers(capture_layers, self.num_layers)
        hidden = self.embed(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, hidden.dtype)  # [T, D] each
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, kv_caches[i], backend, self._specs[i])
            if i in wanted:
                captured[i] = hidden
        hidden = self.model.norm(hidden)
        if self.num_layers - 1 in wanted:
            captured[self.num_layers - 1] = hidden
        return hidden, captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] → [N, vocab] float32
        # the native forward hands over float32 hidden states whatever the model's dtype
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()

    # -- facts for the layout and the handshake -------------------------------------------

    def kv_layer_specs(self) -> list[LayerSpec]:
        return list(self._specs)

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def fingerprint(self) -> str:
        """sha256 (16 hex digits) over fixed rows of the embedding and lm_head, rounded to
        bfloat16 so that a float32 and a bfloat16 load of one checkpoint agree."""
        digest = hashlib.sha256()
        for name, weight in (("embed", self.model.embed_tokens.weight), ("lm_head", self.lm_head.weight)):
            digest.update(f"{name}:{tuple(weight.shape)}".encode())
            digest.update(_weight_sample_bytes(weight.detach()))
        return digest.hexdigest()[:16]


def _layer_specs(args: ModelArgs, scales: Mapping[tuple[int, str], float]) -> tuple[LayerSpec, ...]:
    """One pool layer per decoder layer; kv scales keyed (layer, "k" | "v"), default 1.0."""
    return tuple(
        LayerSpec(
            "target",
            i,
            args.num_kv_heads,
            args.head_dim,
            k_scale=scales.get((i, "k"), 1.0),
            v_scale=scales.get((i, "v"), 1.0),
        )
        for i in range(args.num_layers)
    )


def checkpoint_layout(model: nn.Module) -> tuple[dict[str, torch.Size], dict[str, tuple[str, int]]]:
    """The checkpoint tensors a model loads, {name: shape}: its state dict's, with each
    StackedLinear's parameters named by their parts; and {part name: (stacked name, offset)}."""
    expected = {name: p.shape for name, p in model.state_dict().items()}
    stacked: dict[str, tuple[str, int]] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, StackedLinear):
            continue
        parent = prefix.rpartition(".")[0]
        for suffix in ("weight", "bias") if module.bias is not None else ("weight",):
            name = f"{prefix}.{suffix}"
            shape = expected.pop(name)
            offset = 0
            for part, size in zip(module.parts, module.sizes):
                part_name = f"{parent}.{part}.{suffix}" if parent else f"{part}.{suffix}"
                expected[part_name] = torch.Size((size, *shape[1:]))
                stacked[part_name] = (name, offset)
                offset += size
    return expected, stacked


def stack_checkpoint_parts(state: dict[str, torch.Tensor],
                           stacked: Mapping[str, tuple[str, int]]) -> dict[str, torch.Tensor]:
    """`state` with every StackedLinear's parts (checkpoint_layout) replaced by their stack."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for part_name, (name, offset) in stacked.items():
        parts.setdefault(name, []).append((offset, state.pop(part_name)))
    for name, pieces in parts.items():
        state[name] = torch.cat([tensor for _, tensor in sorted(pieces, key=lambda piece: piece[0])])
    return state


def _weight_sample_bytes(weight: torch.Tensor) -> bytes:
    rows = weight.shape[0]
    count = min(FINGERPRINT_ROWS, rows)
    picks = sorted({i * (rows - 1) // max(count - 1, 1) for i in range(count)})
    index = torch.tensor(picks, dtype=torch.long, device=weight.device)
    sample = weight.index_select(0, index).to(device="cpu", dtype=torch.bfloat16)  # [rows, hidden]
    return sample.contiguous().view(torch.int16).numpy().tobytes()


def _read_checkpoint(
    folder: Path, dtype: torch.dtype, device: torch.device, expected: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], dict[tuple[int, str], float]]:
    """Every expected tensor (cast and moved) and the per-layer kv scales; strict on names."""
    state: dict[str, torch.Tensor] = {}
    scales: dict[tuple[int, str], float] = {}
    unexpected: list[str] = []
    for name, tensor in iter_safetensors(folder):
        if match := KV_SCALE_NAME.match(name):
            scales[(int(match[1]), match[2])] = float(tensor.float().reshape(-1)[0])
        elif name in expected:
            if tensor.shape != expected[name]:
                raise WeightLoadError(
                    f"{folder}: tensor {name} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(expected[name])}"
                )
            state[name] = tensor.to(device=device, dtype=dtype)
        elif not (
            IGNORED_NAME.search(name) or (name == "lm_head.weight" and "lm_head.weight" not in expected)
        ):
            unexpected.append(name)
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        raise WeightLoadError(
            f"{folder}: checkpoint does not match the model: {_describe(missing, unexpected)}"
        )
    return state, scales


def _describe(missing: list[str], unexpected: list[str], limit: int = 8) -> str:
    parts = []
    for label, names in (("missing", missing), ("unexpected", sorted(unexpected))):
        if names:
            shown = ", ".join(names[:limit]) + (
                f" (+{len(names) - limit} more)" if len(names) > limit else ""
            )
            parts.append(f"{len(names)} {label} tensor(s): {shown}")
    return "; ".join(parts)
