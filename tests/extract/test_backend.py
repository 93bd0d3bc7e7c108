"""eyas.extract.backend (HF): the same states alone, padded or packed, eager or compiled, for tiny
random models; the parity check judged against float32."""

from __future__ import annotations

import pytest
import torch

from eyas.extract import plan
from eyas.extract.backend import HFBackend, ParityError, as_float32, check_parity, float32_verdict, relative_error
from tests.models import tiny_model


# ---------------------------------------------------------------- batching invariance


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_same_sample_same_states_alone_padded_or_packed(arch):
    model = tiny_model(arch)
    backend = HFBackend(model, [1, 3, 6], torch.float32)
    lengths = torch.tensor([23, 9, 17, 4])
    tokens = [torch.randint(0, 5000, (int(n),)) for n in lengths]
    alone = [backend.forward(plan.Batch([i], [int(n)], 1, int(n), False), [tokens[i]]) for i, n in enumerate(lengths)]
    for pack in (False, True):
        for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3]):
            lens = [int(lengths[i]) for i in order]
            batch = plan.Batch(order, lens, 1 if pack else len(order), sum(lens) if pack else max(lens), pack)
            states_TKD = backend.forward(batch, [tokens[i] for i in order])
            assert states_TKD.shape == (sum(lens), 4, 64)
            for part, i in zip(states_TKD.split(lens), order):
                torch.testing.assert_close(part, alone[i], rtol=1e-4, atol=1e-5)


def test_compiled_layers_same_states_and_eager_reference():
    """HFBackend(compile=True): hooks still see every layer, padded and packed batches give the eager
    states, the parity reference runs the eager layers, close() gives the model back untouched.
    Dynamo's `eager` backend checks the wiring on CPU in seconds; inductor is measured by the bench."""
    model = tiny_model("llama")
    eager = HFBackend(model, [1, 3, 6], torch.float32)
    lengths = [23, 9, 17, 4]
    tokens = [torch.randint(0, 5000, (n,)) for n in lengths]
    alone = [eager.forward(plan.Batch([i], [n], 1, n, False), [tokens[i]]) for i, n in enumerate(lengths)]
    compiled = HFBackend(model, [1, 3, 6], torch.float32, compile=True, compile_backend="eager")
    layers = compiled.capture.layers
    assert all("forward" in layer.__dict__ for layer in layers)
    for pack in (False, True):
        for order in ([0, 1, 2, 3], [3, 1], [2]):
            lens = [lengths[i] for i in order]
            batch = plan.Batch(order, lens, 1 if pack else len(order), sum(lens) if pack else max(lens), pack)
            for part, i in zip(compiled.forward(batch, [tokens[i] for i in order]).split(lens), order):
                torch.testing.assert_close(part, alone[i], rtol=1e-4, atol=1e-5)
    seen = []
    hook = layers[0].register_forward_pre_hook(lambda m, a: seen.append("forward" in m.__dict__))
    torch.testing.assert_close(compiled.reference(tokens[0]), alone[0], rtol=1e-4, atol=1e-5)
    hook.remove()
    assert seen == [False] and all("forward" in layer.__dict__ for layer in layers)
    compiled.close()
    assert not any("forward" in layer.__dict__ for layer in layers)


def test_parity_past_tolerance_judged_against_float32():
    """bf16 states that round differently from the plain bf16 forward (here: the float32 forward's,
    rounded to bf16) fail a tolerance below that difference, then pass against the float32 forward;
    another sample's states fail both. The float32 cast gives every weight and buffer back bit for bit."""
    model = tiny_model("llama").to(torch.bfloat16)
    model.model.rotary_emb.inv_freq.data = model.model.rotary_emb.inv_freq.data.float()  # a mixed-dtype module
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    backend = HFBackend(model, [1, 3, 6], torch.bfloat16)
    tokens, other = torch.randint(0, 5000, (40,)), torch.randint(0, 5000, (40,))
    plain = backend.reference(tokens)
    exact = backend.reference(tokens, float32=True)
    assert exact.dtype == torch.float32
    rounded = exact.to(torch.bfloat16)
    gap = float(relative_error(rounded, plain).amax())
    assert 0 < gap < 0.05  # rounding, not a different computation
    parity = check_parity(backend, [("s0", rounded, tokens), ("s0b", plain, tokens)], tol=gap / 4)
    assert parity.errors == [pytest.approx(gap), 0] and parity.float32_judged == 1
    with pytest.raises(ParityError, match="sample s1: .* not by rounding"):
        check_parity(backend, [("s0", rounded, tokens), ("s1", backend.reference(other), tokens)], tol=gap / 4)
    with pytest.raises(ParityError, match="sample s2"):  # shifted by one position
        check_parity(backend, [("s2", torch.cat([plain[:1], plain[:-1]]), tokens)], tol=gap / 4)
    # wrong at 10 of 40 tokens, each within the plain forward's worst token: the mean gives it away
    floor_SK = torch.full((40, 4), 1e-3)
    floor_SK[0] = 0.2
    got_SK = floor_SK.clone()
    assert float32_verdict(got_SK, floor_SK, 1e-4) == ""
    got_SK[30:] = 0.2
    assert "more than 1.5x" in float32_verdict(got_SK, floor_SK, 1e-4)
    # a plain forward far from float32 is no yardstick: even states close to it fail
    assert "no yardstick" in float32_verdict(torch.zeros(40, 4), torch.full((40, 4), 0.3), gap / 4)
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.dtype == before[n].dtype and torch.equal(t, before[n]), n
    with pytest.raises(RuntimeError), as_float32(model):  # restored also when the body fails
        raise RuntimeError("inside")
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
