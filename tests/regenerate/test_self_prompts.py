"""eyas.regenerate.self_prompts: self-written user turns (greedy, steered by system prompts, sampled),
answered as the batch-1 reference answers them; resume; refusals."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.config import load_config
from eyas.errors import EyasError
from eyas.regenerate import main as regenerate
from tests.regenerate.chat_server import greedy_reply
from tests.regenerate.runs import NEW, cfg_for, read


SMOL_PRE_QUERY = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                  "<|im_start|>user\n")  # SmolLM2's template, with the system prompt it adds by itself


def test_greedy_self_prompts_equal_a_plain_generate_and_resume(tmp_path, data, target):
    """Greedy self-written user turns are all the target's own greedy continuation of the text
    before a user message (one distinct prompt, the rest counted as repeats), answered as the
    batch-1 reference answers it; a second run reads them back and redoes nothing."""
    from eyas.regenerate.self_prompts import pre_query_ids

    model, tok = target
    prefix = pre_query_ids(tok, [tok.eos_token_id])
    assert tok.decode(prefix) == SMOL_PRE_QUERY
    assert tok.decode(pre_query_ids(tok, [tok.eos_token_id], "Be brief.")) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    with torch.inference_mode():  # the independent reference: HF generate from the literal text
        x = tok(SMOL_PRE_QUERY, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=tok.eos_token_id)
    new = out[0, x.shape[1]:].tolist()
    assert tok.eos_token_id in new  # SmolLM2's greedy user turn ends within 48 tokens
    user = tok.decode(new[: new.index(tok.eos_token_id)], skip_special_tokens=True).strip()
    own = ["--prepare.max_conversations=1", "--regenerate.self_prompts=3", "--regenerate.self_prompt_temperature=0",
           "--regenerate.self_prompt_max_tokens=48"]
    s = regenerate(cfg_for(tmp_path, data, *own))
    assert s["self_prompts"] == {"sampled": 3, "kept": 1, "unfinished": 0, "empty": 0, "duplicate": 2}
    assert (s["conversations_in"], s["self_written"], s["conversations_written"]) == (1, 1, 2)
    recs = read(tmp_path / "regenerate" / "conversations.jsonl")
    assert [r["id"] for r in recs] == ["a", "self-0"]
    asked = [{"role": "user", "content": user}]
    assert recs[1]["messages"] == asked + [{"role": "assistant", "content": greedy_reply(model, tok, asked, NEW)[0]}]
    s = regenerate(cfg_for(tmp_path, data, *own))
    assert (s["resumed_from"], s["regenerated_now"], s["conversations_written"]) == (2, 0, 2)
    assert read(tmp_path / "regenerate" / "conversations.jsonl") == recs
    # other sampling settings than the file's: loud, naming what to remove
    with pytest.raises(EyasError, match="was sampled with .*remove it"):
        regenerate(cfg_for(tmp_path, data, *own[:-1], "--regenerate.self_prompt_max_tokens=40"))
    assert json.loads((tmp_path / "regenerate" / "meta.json").read_text())["complete"]  # refused before any change
    # the CUDA path (eyas's BatchDecoder, here eagerly; its own max_new) samples the same turns
    from eyas.regenerate.backends import HFBackend
    from eyas.regenerate.self_prompts import sample_self_prompts

    cfg = cfg_for(tmp_path, data, *own, "--regenerate.static_widths=[32]")
    backend = HFBackend(cfg, tok)
    backend.static = True
    assert sample_self_prompts(backend, tok, cfg)["prompts"] == [user]
    assert backend.generate([prefix], None)[0].new_tokens <= NEW  # the answers' settings again: a new decoder
    # answers to self-written turns whose file is gone: loud (new samples would not match them)
    (tmp_path / "regenerate" / "self_prompts.json").unlink()
    with pytest.raises(EyasError, match="is gone: remove"):
        regenerate(cfg_for(tmp_path, data, *own))


def test_self_prompt_systems_steer_the_samples_and_stay_out_of_the_conversations(tmp_path, data, target):
    """regenerate.self_prompt_systems: greedy sample i is the target's own continuation of the text
    before a user message after the (i mod n)-th system prompt (an independent HF generate from the
    literal text), counted per system prompt; the conversations hold the user turn alone, answered
    as any self-written one; other system prompts than the stored file's are refused."""
    model, tok = target
    systems = ["You write short questions about cooking.", "You ask for help with arithmetic."]
    refs = []
    for system in systems:  # the independent reference, from the literal pre-query text
        x = tok(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n", return_tensors="pt",
                add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, pad_token_id=tok.eos_token_id)
        new = out[0, x.shape[1]:].tolist()
        assert tok.eos_token_id in new  # SmolLM2's greedy user turn ends within 48 tokens
        refs.append(tok.decode(new[: new.index(tok.eos_token_id)], skip_special_tokens=True).strip())
    assert refs[0] != refs[1] and refs[0] != "" and refs[1] != ""  # the two system prompts steer apart
    own = ["--prepare.max_conversations=1", "--regenerate.self_prompts=4", "--regenerate.self_prompt_temperature=0",
           "--regenerate.self_prompt_max_tokens=48", f"--regenerate.self_prompt_systems={json.dumps(systems)}"]
    s = regenerate(cfg_for(tmp_path, data, *own))
    assert s["self_prompts"] == {"sampled": 4, "kept": 2, "unfinished": 0, "empty": 0, "duplicate": 2,
                                 "kept_per_system": [1, 1]}
    made = json.loads((tmp_path / "regenerate" / "self_prompts.json").read_text())
    assert made["prompts"] == refs and made["settings"]["systems"] == systems
    recs = read(tmp_path / "regenerate" / "conversations.jsonl")[1:]
    for rec, user in zip(recs, refs):  # no system message: answered as the plain user turn
        asked = [{"role": "user", "content": user}]
        assert rec["messages"] == asked + [{"role": "assistant", "content": greedy_reply(model, tok, asked, NEW)[0]}]
    with pytest.raises(EyasError, match="was sampled with .*remove it"):
        regenerate(cfg_for(tmp_path, data, *own[:-1], f"--regenerate.self_prompt_systems={json.dumps(systems[:1])}"))
    with pytest.raises(EyasError, match="set regenerate.self_prompts too"):
        load_config(None, [f"--regenerate.self_prompt_systems={json.dumps(systems)}"])


def test_self_prompts_refuse_a_template_whose_user_turn_does_not_end_at_a_stop_token(target):
    import copy

    from eyas.regenerate.self_prompts import pre_query_ids

    _, tok = target
    inst = copy.deepcopy(tok)  # a Mistral-like template: the user turn ends with [/INST] (not a special token here)
    inst.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}[INST]\n{{ m['content'] }}[/INST]{% endif %}{% endfor %}"
    with pytest.raises(EyasError, match="ends a user turn with '\\[/INST\\]|ends a user turn with '\\['"):
        pre_query_ids(inst, [tok.eos_token_id])
    inst.chat_template = "[INST] {{ messages[0]['content'] }}[/INST]"  # the text before cuts a token: caught too
    with pytest.raises(EyasError, match="not as the start of a templated conversation"):
        pre_query_ids(inst, [tok.eos_token_id])


def test_sampled_self_prompts_are_counted_and_answered(tmp_path, data, target):
    model, tok = target
    s = regenerate(cfg_for(tmp_path, data, "--prepare.max_conversations=1", "--regenerate.self_prompts=6",
                           "--regenerate.self_prompt_max_tokens=24", "--regenerate.batch_size=4"))
    c = s["self_prompts"]
    assert c["sampled"] == 6 and c["kept"] + c["unfinished"] + c["empty"] + c["duplicate"] == 6
    assert c["kept"] >= 2  # seeded (the run's seed): the same samples every time
    made = json.loads((tmp_path / "regenerate" / "self_prompts.json").read_text())
    assert len(made["prompts"]) == c["kept"] == s["self_written"] and len(set(made["prompts"])) == c["kept"]
    path = tmp_path / "regenerate" / "conversations.jsonl"
    recs = read(path)[1:]
    assert [r["messages"][0]["content"] for r in recs] == made["prompts"]
    for r in recs:  # each finished in at most 24 tokens, and answered greedily as the reference does
        assert 0 < len(tok(r["messages"][0]["content"])["input_ids"]) <= 24
        assert r["messages"][1]["content"] == greedy_reply(model, tok, r["messages"][:1], NEW)[0]
    # a resume answers the stored turns, not new samples: the last one, dropped, comes back as it was
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))
    s = regenerate(cfg_for(tmp_path, data, "--prepare.max_conversations=1", "--regenerate.self_prompts=6",
                           "--regenerate.self_prompt_max_tokens=24", "--regenerate.batch_size=4"))
    assert s["regenerated_now"] == 1 and read(path)[1:] == recs


def test_sampled_self_prompts_on_the_cuda_decoder_path(tmp_path, data, target):
    """eyas's BatchDecoder (here eagerly) samples the user turns with their own settings and then
    answers greedily with the answers' settings."""
    from eyas.regenerate.backends import HFBackend
    from eyas.regenerate.self_prompts import sample_self_prompts

    model, tok = target
    cfg = cfg_for(tmp_path, data, "--regenerate.self_prompts=8", "--regenerate.self_prompt_max_tokens=24",
                  "--regenerate.batch_size=8", "--regenerate.static_widths=[32,64]")
    backend = HFBackend(cfg, tok)
    backend.static = True
    made = sample_self_prompts(backend, tok, cfg)
    assert made["counts"]["sampled"] == 8 and len(made["prompts"]) >= 2  # sampled: distinct turns
    asked = [[{"role": "user", "content": p}] for p in made["prompts"]]
    ids = [tok.apply_chat_template(a, add_generation_prompt=True, tokenize=True, return_dict=False) for a in asked]
    for a, answer in zip(asked, backend.generate(ids)):
        assert answer.text == greedy_reply(model, tok, a, NEW)[0]


def test_self_prompts_need_the_hf_backend():
    with pytest.raises(EyasError, match="needs regenerate.backend=hf"):
        load_config(None, ["--regenerate.backend=server", "--regenerate.self_prompts=4"])
