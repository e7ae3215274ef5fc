"""load_tokenizer: a folder with transformers' generic fast tokenizer loads without AutoTokenizer's import, and
gives what AutoTokenizer gives; any other folder goes through AutoTokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from areal_hpc.model import build_arith_tokenizer, load_tokenizer


@pytest.mark.parametrize("vocab", ["arith", "arith_tool", "arith_agent"])
def test_the_generic_fast_tokenizer_loads_as_autotokenizer_loads_it(tmp_path, vocab):
    build_arith_tokenizer(vocab=vocab).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    auto, ours = AutoTokenizer.from_pretrained(str(tmp_path)), load_tokenizer(tmp_path)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and ours.special_tokens_map == auto.special_tokens_map
    assert ours.chat_template == auto.chat_template and ours.eos_token_id == auto.eos_token_id
    for text in ("12+34=", "<user>7*8=<assistant>\\boxed{56}<eos>", " 1 + 1 = 2 "):
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))


def test_a_folder_with_its_own_tokenizer_code_goes_through_autotokenizer(tmp_path, monkeypatch):
    build_arith_tokenizer(vocab="arith").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg | {"auto_map": {"AutoTokenizer": [None, "x.Y"]}}))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(lambda cls, path, *a, **kw: ("auto", path)))
    assert load_tokenizer(tmp_path) == ("auto", str(tmp_path))
