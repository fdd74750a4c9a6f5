"""Our Qwen3 forward over paged KV against transformers, on tiny random checkpoints.

Tolerances (float32 model on CPU):
- float32 KV: logits within 1e-4 abs of transformers (eager attention); measured ~2e-6.
- quantized KV, measured as max |logits - logits with float32 KV| / std(float32 logits)
  over the prefill + decode run below (logit std ~1.3; NHD and HND agree):
  fp8_e4m3 0.141, fp8_e5m2 0.268, bfloat16 0.0084, float16 0.0012.
  Bounds, about 2x: 0.3, 0.5, 0.02, 0.003.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.qwen3 import Qwen3ForCausalLM, WeightLoadError
from common.weights import ModelNotFoundError, iter_safetensors, resolve_model_path
from tests.paged_runner import CPU, PagedRunner, Seq
from tests.tiny_models import PROMPTS, make_llama_family, make_qwen3

NEW_TOKENS = 32
LOGIT_ATOL = 1e-4
QUANTIZED_KV_BOUNDS = {
    "fp8_e4m3": 0.3,
    "fp8_e5m2": 0.5,
    "bfloat16": 0.02,
    "float16": 0.003,
}  # max diff / logit std


# ---------------------------------------------------------------------------------------
# Checkpoints and reference models


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def encode(path: Path, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def hf_qwen3(qwen3_dir):
    return load_hf(qwen3_dir)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(qwen3_dir, torch.float32, CPU)


@pytest.fixture
def runner_factory(tmp_path):
    runners: list[PagedRunner] = []

    def make(model, **kwargs) -> PagedRunner:
        shm_dir = tmp_path / f"pool{len(runners)}"
        shm_dir.mkdir()
        runners.append(PagedRunner(model, shm_dir, **kwargs))
        return runners[-1]

    yield make
    for r in runners:
        r.close()
    assert not list(tmp_path.glob("pool*/*.kv")), "KV pool files left behind"


def teacher_forced_run(
    runner: PagedRunner, sequences: list[list[int]], prompt_lens: list[int]
) -> list[torch.Tensor]:
    """Prefill (the longest prompt in two chunks), then decode one token per step;
    returns each sequence's logits for every position [len, V]."""
    seqs = [Seq(list(s)) for s in sequences]
    per_seq: list[list[torch.Tensor]] = [[] for _ in seqs]
    longest = max(range(len(seqs)), key=lambda b: prompt_lens[b])
    first = [n if b != longest else n // 2 for b, n in enumerate(prompt_lens)]
    for b, rows in enumerate(runner.step(seqs, first)[0]):
        per_seq[b].append(rows)
    chunk = [prompt_lens[longest] - first[longest]]
    per_seq[longest].append(runner.step([seqs[longest]], chunk)[0][0])  # over KV already in pages
    while any(s.computed < len(s.tokens) for s in seqs):
        live = [b for b, s in enumerate(seqs) if s.computed < len(s.tokens)]
        for b, rows in zip(live, runner.step([seqs[b] for b in live], [1] * len(live))[0]):
            per_seq[b].append(rows)
    return [torch.cat(chunks) for chunks in per_seq]


def hf_logits(hf_model, sequences: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf_model(torch.tensor([s])).logits[0] for s in sequences]


def parity_inputs(path: Path, extra: int = 6) -> tuple[list[list[int]], list[int]]:
    """Four prompts (one long, > the batched-query limit) plus `extra` arbitrary continuation tokens."""
    prompts = encode(path, [PROMPTS[0], PROMPTS[2], " ".join(PROMPTS[3:9]), PROMPTS[12]])
    gen = random.Random(1)
    sequences = [p + [gen.randrange(300) for _ in range(extra + b)] for b, p in enumerate(prompts)]
    return sequences, [len(p) for p in prompts]


# ---------------------------------------------------------------------------------------
# (a) logits, (d) captured hidden states


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_prefill_and_decode_logits_match_transformers(qwen3, hf_qwen3, qwen3_dir, runner_factory, order):
    sequences, prompt_lens = parity_inputs(qwen3_dir)
    assert max(prompt_lens) > 32
    ours = teacher_forced_run(runner_factory(qwen3, order=order), sequences, prompt_lens)
    for b, (mine, ref) in enumerate(zip(ours, hf_logits(hf_qwen3, sequences))):
        assert mine.shape == ref.shape
        diff = (mine - ref).abs().max().item()
        assert diff <= LOGIT_ATOL, f"sequence {b}: logits differ by {diff:.3g}"


def test_captured_hidden_states_match_output_hidden_states(qwen3, hf_qwen3, qwen3_dir, runner_factory):
    sequences, _ = parity_inputs(qwen3_dir, extra=0)
    runner = runner_factory(qwen3)
    seqs = [Seq(s) for s in sequences]
    layers = tuple(range(qwen3.num_layers))
    _, captured = runner.step(seqs, [len(s) for s in sequences], capture=layers)
    with torch.no_grad():
        refs = [hf_qwen3(torch.tensor([s]), output_hidden_states=True).hidden_states for s in sequences]
    for layer in layers:
        ref = torch.cat([r[layer + 1][0] for r in refs])  # [T, hidden]
        assert captured[layer].shape == ref.shape
        torch.testing.assert_close(captured[layer], ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# (b) greedy generation


@pytest.fixture(scope="module")
def hf_greedy(hf_qwen3, qwen3_dir) -> list[list[int]]:
    eos = hf_qwen3.config.eos_token_id
    outs = []
    with torch.no_grad():
        for ids in encode(qwen3_dir, PROMPTS):
            x = torch.tensor([ids])
            out = hf_qwen3.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=eos,
                pad_token_id=eos,
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_greedy_generation_matches_transformers(qwen3, hf_greedy, qwen3_dir, runner_factory, order):
    runner = runner_factory(qwen3, order=order)
    ours = runner.greedy(encode(qwen3_dir, PROMPTS), NEW_TOKENS, eos=qwen3.config.eos_token_id)
    for b, (mine, ref) in enumerate(zip(ours, hf_greedy)):
        assert mine == ref, f"prompt {b} {PROMPTS[b]!r}: {mine} != {ref}"
    assert sum(len(o) for o in ours) > len(PROMPTS) * NEW_TOKENS // 2  # most run to the limit


# ---------------------------------------------------------------------------------------
# (c) quantized KV


@pytest.mark.parametrize("kv_dtype", list(QUANTIZED_KV_BOUNDS))
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_quantized_kv_logits_close_to_float32(qwen3, qwen3_dir, runner_factory, kv_dtype, order):
    sequences, prompt_lens = parity_inputs(qwen3_dir)
    exact = torch.cat(teacher_forced_run(runner_factory(qwen3, order=order), sequences, prompt_lens))
    quant = torch.cat(
        teacher_forced_run(runner_factory(qwen3, order=order, kv_dtype=kv_dtype), sequences, prompt_lens)
    )
    relative = ((quant - exact).abs().max() / exact.std()).item()
    assert 0 < relative <= QUANTIZED_KV_BOUNDS[kv_dtype], f"{kv_dtype}: max diff / logit std = {relative:.4f}"


# ---------------------------------------------------------------------------------------
# (e) Llama-family checkpoints


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_llama_family_checkpoints_match_transformers(tmp_path_factory, runner_factory, model_type):
    path = make_llama_family(tmp_path_factory.mktemp(model_type), model_type)
    ours_model = Qwen3ForCausalLM.from_pretrained(path, torch.float32, CPU)
    assert not ours_model.args.qk_norm
    sequences, prompt_lens = parity_inputs(path)
    ours = teacher_forced_run(runner_factory(ours_model, order="HND"), sequences, prompt_lens)
    for b, (mine, ref) in enumerate(zip(ours, hf_logits(load_hf(path), sequences))):
        diff = (mine - ref).abs().max().item()
        assert diff <= LOGIT_ATOL, f"{model_type} sequence {b}: logits differ by {diff:.3g}"


# ---------------------------------------------------------------------------------------
# (f) loading


def copy_checkpoint(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = dict(iter_safetensors(dst))
    edit(tensors)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_weight_is_a_clear_error(qwen3_dir, tmp_path):
    name = "model.layers.1.self_attn.k_norm.weight"
    broken = copy_checkpoint(qwen3_dir, tmp_path / "broken", lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=rf"1 missing tensor\(s\): {name}"):
        Qwen3ForCausalLM.from_pretrained(broken, torch.float32, CPU)


def test_unexpected_and_misshaped_weights_are_clear_errors(qwen3_dir, tmp_path):
    extra = copy_checkpoint(
        qwen3_dir, tmp_path / "extra", lambda t: t.update({"model.bogus.weight": torch.zeros(2)})
    )
    with pytest.raises(WeightLoadError, match=r"unexpected tensor\(s\): model\.bogus\.weight"):
        Qwen3ForCausalLM.from_pretrained(extra, torch.float32, CPU)

    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:10]

    bad = copy_checkpoint(qwen3_dir, tmp_path / "bad", shrink)
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight has shape \(10,\)"):
        Qwen3ForCausalLM.from_pretrained(bad, torch.float32, CPU)


def test_stacked_projections_are_loaded_and_checked_by_their_checkpoint_names(qwen3_dir, tmp_path):
    """q/k/v and gate/up run as one product each (StackedLinear), stacked at load in the
    checkpoint's order: a missing or misshaped part is named as the checkpoint names it, and
    a checkpoint that already holds our stacked name is not one we read."""
    from safetensors.torch import load_file

    model = Qwen3ForCausalLM.from_pretrained(qwen3_dir, torch.float32, CPU)
    tensors = {}
    for f in qwen3_dir.glob("*.safetensors"):
        tensors |= load_file(str(f))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    expected_qkv = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight, expected_qkv, rtol=0, atol=0)
    expected_gate_up = torch.cat([tensors[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(mlp.gate_up_proj.weight, expected_gate_up, rtol=0, atol=0)

    name = "model.layers.0.self_attn.v_proj.weight"
    broken = copy_checkpoint(qwen3_dir, tmp_path / "no_v", lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=rf"1 missing tensor\(s\): {name}"):
        Qwen3ForCausalLM.from_pretrained(broken, torch.float32, CPU)

    def shrink_up(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    bad = copy_checkpoint(qwen3_dir, tmp_path / "short_up", shrink_up)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape"):
        Qwen3ForCausalLM.from_pretrained(bad, torch.float32, CPU)

    def prestack(t):
        t["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(1)

    ours = copy_checkpoint(qwen3_dir, tmp_path / "prestacked", prestack)
    with pytest.raises(WeightLoadError, match=r"unexpected tensor\(s\): model\.layers\.0\.self_attn\.qkv_proj"):
        Qwen3ForCausalLM.from_pretrained(ours, torch.float32, CPU)


def test_rope_with_the_sign_folded_equals_rotate_half():
    from common.qwen3 import apply_rope

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=generator)  # [T, H, D]
    angles = torch.randn(5, 8, generator=generator)  # [T, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [T, D]
    rotated = torch.cat([-x[..., 8:], x[..., :8]], -1)  # rotate_half, as Hugging Face writes it
    expected = x * cos[:, None] + rotated * sin[:, None]
    signed = torch.cat([-angles.sin(), angles.sin()], -1)
    assert torch.equal(apply_rope(x, cos, signed), expected)  # bit for bit


def test_kv_scales_from_checkpoint(qwen3_dir, tmp_path):
    def add_scales(t):
        t["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
        t["model.layers.1.self_attn.v_scale"] = torch.tensor([2.0])

    scaled = copy_checkpoint(qwen3_dir, tmp_path / "scaled", add_scales)
    specs = Qwen3ForCausalLM.from_pretrained(scaled, torch.float32, CPU).kv_layer_specs()
    assert [(s.owner, s.index, s.k_scale, s.v_scale) for s in specs] == [
        ("target", 0, 0.5, 1.0),
        ("target", 1, 1.0, 2.0),
    ]
    assert (specs[0].num_kv_heads, specs[0].head_dim) == (2, 16)


def test_model_facts_and_fingerprint(qwen3, qwen3_dir):
    config = json.loads((qwen3_dir / "config.json").read_text())
    assert (qwen3.num_layers, qwen3.hidden_size, qwen3.vocab_size) == (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["vocab_size"],
    )
    fp = qwen3.fingerprint()
    assert len(fp) == 16 and fp == qwen3.fingerprint()
    assert Qwen3ForCausalLM.from_pretrained(qwen3_dir, torch.bfloat16, CPU).fingerprint() == fp
    state = load_file(str(qwen3_dir / "model.safetensors"))
    assert torch.equal(qwen3.lm_head.weight, state["lm_head.weight"])


def test_resolve_model_path(qwen3_dir, tmp_path):
    assert resolve_model_path(str(qwen3_dir)) == qwen3_dir
    with pytest.raises(ModelNotFoundError, match="no-such-org/no-such-model"):
        resolve_model_path("no-such-org/no-such-model", cache_dir=str(tmp_path / "hf"))
