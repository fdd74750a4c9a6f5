import pytest
import torch

from target_service.sampling import SamplingSpec, make_generator, sampling_probs
from target_service.spec_decode import verify_tokens


def sample_tokens(logits: torch.Tensor, specs: list[SamplingSpec], generators: list) -> list[int]:
    """[N, V] logits → one token per row, as the engine samples one: a verify with no drafts."""
    return [verify_tokens([], logits[row : row + 1], spec, gen)[0]
            for row, (spec, gen) in enumerate(zip(specs, generators))]


def test_top_k_keeps_k_most_likely():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    probs = sampling_probs(logits, SamplingSpec(temperature=1.0, top_k=2))[0]
    assert (probs > 0).tolist() == [False, True, False, True, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = sampling_probs(probs_in.log()[None], SamplingSpec(temperature=1.0, top_p=0.8))[0]
    assert (probs > 0).tolist() == [True, True, False, False]
    assert probs[0].item() == pytest.approx(0.5 / 0.8)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    hot = sampling_probs(logits, SamplingSpec(temperature=2.0))[0, 1]
    cold = sampling_probs(logits, SamplingSpec(temperature=0.5))[0, 1]
    assert cold > hot


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    specs = [SamplingSpec(), SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.7, top_k=5, top_p=0.9)]
    run = lambda: sample_tokens(logits, specs, [None, make_generator(1, torch.device("cpu")),
                                                make_generator(2, torch.device("cpu"))])
    assert run() == run()
    assert run()[0] == logits[0].argmax().item()


def test_sampling_follows_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gen = make_generator(0, torch.device("cpu"))
    draws = [sample_tokens(probs.log()[None], [SamplingSpec(temperature=1.0)], [gen])[0] for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.03)
