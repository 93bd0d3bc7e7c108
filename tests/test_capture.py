"""eyas.capture against a plain HF forward, for tiny random models of each architecture and SmolLM2."""

from __future__ import annotations

import pytest
import torch

from eyas.capture import (
    HiddenStateCapture,
    base_model,
    capture,
    default_layer_ids,
    find_decoder_layers,
    find_final_norm,
)
from eyas.errors import ConfigError
from tests.models import ARCHS, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_default_layer_ids():
    assert default_layer_ids(32) == [2, 16, 29]  # Llama-3.1-8B
    assert default_layer_ids(30) == [2, 15, 27]  # SmolLM2-135M


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_matches_output_hidden_states(arch):
    model = tiny_model(arch)
    ids_BS = torch.randint(0, 1000, (2, 11))
    ids_BS[1, 0] = 7
    with torch.no_grad():
        out = model(input_ids=ids_BS, output_hidden_states=True, use_cache=False)
        # the input of the final norm, to check what hidden_states[-1] is in this transformers version
        seen = {}
        norm = find_final_norm(model)
        handle = norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("pre", a[0]))
        model(input_ids=ids_BS, use_cache=False)
        handle.remove()
    layer_ids = [0, 2, 7]
    aux_BSKD, final_BSD = capture(model, ids_BS, layer_ids=layer_ids)
    hs = out.hidden_states
    assert len(hs) == 9 and len(find_decoder_layers(model)) == 8
    assert aux_BSKD.shape == (2, 11, 3, 64) and final_BSD.shape == (2, 11, 64)
    for j, k in enumerate(layer_ids):  # id k = the state entering layer k = hidden_states[k]
        torch.testing.assert_close(aux_BSKD[:, :, j], hs[k], rtol=0, atol=0)
    torch.testing.assert_close(final_BSD, norm(seen["pre"]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final_BSD, hs[-1], rtol=0, atol=0)  # HF's last entry is post-norm
    assert not torch.allclose(hs[-1], seen["pre"])
    # the LM head is skipped: capture calls the module that owns the layers
    assert base_model(model) is not model and not hasattr(base_model(model), "lm_head")


def test_capture_with_kv_cache_gives_new_tokens_only(llama):
    from transformers import DynamicCache

    ids_BS = torch.randint(0, 1000, (1, 12))
    full_aux, full_final = capture(llama, ids_BS, layer_ids=[1, 4])
    cache = DynamicCache(config=llama.config)
    with torch.no_grad(), HiddenStateCapture(llama, [1, 4]) as cap:
        llama(input_ids=ids_BS[:, :9], past_key_values=cache, use_cache=True)
        llama(input_ids=ids_BS[:, 9:], past_key_values=cache, use_cache=True)
        aux_BSKD, final_BSD = cap.result()
    assert aux_BSKD.shape == (1, 3, 2, 64)
    torch.testing.assert_close(aux_BSKD, full_aux[:, 9:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final_BSD, full_final[:, 9:], rtol=1e-5, atol=1e-5)


def test_hooks_removed_on_exit_and_on_error(llama):
    layers, norm = find_decoder_layers(llama), find_final_norm(llama)
    with pytest.raises(RuntimeError):
        with HiddenStateCapture(llama, [2]):
            assert layers[2]._forward_pre_hooks and norm._forward_hooks
            raise RuntimeError("boom")
    assert not layers[2]._forward_pre_hooks and not norm._forward_hooks


@pytest.mark.parametrize("bad", [[8], [-1], [0, 99]])
def test_out_of_range_layer_ids(llama, bad):
    with pytest.raises(ConfigError, match="extract.layer_ids"):
        HiddenStateCapture(llama, bad)


def test_result_before_forward_names_the_problem(llama):
    with HiddenStateCapture(llama, [2]) as cap, pytest.raises(Exception, match="run a forward pass"):
        cap.result()


def test_smollm2_capture_matches_plain_forward(smollm2_dir):
    from eyas.config import TargetConfig
    from eyas.target import load_model

    model = load_model(TargetConfig(model=str(smollm2_dir)), device="cpu")
    assert next(model.parameters()).dtype == torch.float32  # auto -> fp32 on CPU
    assert len(find_decoder_layers(model)) == 30
    ids_BS = torch.tensor([[1, 504, 3458, 314, 253, 1345, 28, 2]])
    with torch.no_grad():
        hs = model(input_ids=ids_BS, output_hidden_states=True).hidden_states
    aux_BSKD, final_BSD = capture(model, ids_BS)  # default ids [2, 15, 27]
    ref = torch.stack([hs[2], hs[15], hs[27]], dim=2)
    torch.testing.assert_close(aux_BSKD, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final_BSD, hs[30], rtol=1e-5, atol=1e-5)


def test_default_layer_ids_are_the_reference_choice_and_always_ascending():
    from eyas.capture import default_layer_ids

    assert default_layer_ids(32) == [2, 16, 29] and default_layer_ids(30) == [2, 15, 27]
    for n in range(3, 80):
        ids = default_layer_ids(n)
        assert ids == sorted(set(ids)) and len(ids) == 3 and 0 <= ids[0] and ids[-1] < n, (n, ids)
