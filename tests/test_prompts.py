"""Prompt building: chat templates, over-long prompts skipped and counted, context overflow refused in one line."""

from __future__ import annotations

import json
import re

import pytest

from areal_hpc.config import load_config
from areal_hpc.config.errors import ConfigError
from areal_hpc.data import check_prompts_fit, load_dataset
from areal_hpc.model import load_tokenizer, stop_token_ids


def _cfg(tmp_path, model_dir, *overrides):
    return load_config(
        None,
        [f"model.path={model_dir}", f"store.run_dir={tmp_path / 'run'}", "data.train_size=50", "data.heldout_size=10"]
        + list(overrides),
    )


def test_chat_template_prompts_equal_apply_chat_template(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    assert tok.chat_template  # the demo tokenizer carries its own template
    ds = load_dataset(_cfg(tmp_path, tiny_model_dir, "data.system_prompt=1+1=2").data, tok)
    for p in ds.train[:5] + ds.heldout[:5]:
        question = p.prompt.split("<user>")[1].split("<assistant>")[0]
        messages = [{"role": "system", "content": "1+1=2"}, {"role": "user", "content": question}]
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert p.prompt == want
        assert p.prompt_ids == tok.encode(want, add_special_tokens=False)
        assert tok.convert_ids_to_tokens(p.prompt_ids[-1]) == "<assistant>"  # the generation prompt
    # auto follows the tokenizer; off gives the raw text
    off = load_dataset(_cfg(tmp_path, tiny_model_dir, "data.chat_template=off").data, tok)
    assert off.train[0].prompt.endswith("=") and "<user>" not in off.train[0].prompt
    with pytest.raises(ValueError, match="data.system_prompt is set but prompts use no chat template"):
        load_dataset(_cfg(tmp_path, tiny_model_dir, "data.chat_template=off", "data.system_prompt=hi").data, tok)


def test_over_long_prompts_are_skipped_and_counted(tiny_model_dir, tmp_path):
    rows = [{"question": "1+" * n + "1=", "answer": str(n + 1)} for n in range(1, 41)]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(tiny_model_dir)
    base = ["data.kind=jsonl", f"data.path={path}", "data.heldout_size=5"]
    full = load_dataset(_cfg(tmp_path, tiny_model_dir, *base).data, tok)
    lengths = sorted(len(p.prompt_ids) for p in full.train + full.heldout)
    limit = lengths[len(lengths) // 2]
    with pytest.warns(UserWarning, match=f"skipped {sum(n > limit for n in lengths)} prompts longer than"):
        cut = load_dataset(_cfg(tmp_path, tiny_model_dir, *base, f"data.max_prompt_tokens={limit}").data, tok)
    assert cut.too_long == sum(n > limit for n in lengths) > 0
    assert cut.skip_reasons[f"longer than data.max_prompt_tokens={limit}"] == cut.too_long
    assert all(len(p.prompt_ids) <= limit for p in cut.train + cut.heldout)
    assert len(cut.train) + len(cut.heldout) + cut.too_long == len(rows)


def test_context_overflow_is_refused_in_one_line(tiny_model_dir, tmp_path):
    ctx = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    check_prompts_fit(_cfg(tmp_path, tiny_model_dir, "rollout.max_new_tokens=16"), tiny_model_dir)  # fits
    for over, names in (
        (["rollout.max_new_tokens=" + str(ctx)], "the longest in the dataset"),
        (["data.max_prompt_tokens=" + str(ctx - 8), "rollout.max_new_tokens=16"], "data.max_prompt_tokens"),
    ):
        with pytest.raises(ValueError) as err:
            check_prompts_fit(_cfg(tmp_path, tiny_model_dir, *over), tiny_model_dir)
        msg = str(err.value)
        assert "\n" not in msg and f"max_position_embeddings={ctx}" in msg and names in msg, msg


def test_stop_tokens_are_every_eos_the_folder_declares(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    tok = load_tokenizer(folder)
    assert stop_token_ids(folder) == [tok.eos_token_id]
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [7, tok.eos_token_id, 9]}))
    assert stop_token_ids(folder) == sorted({7, 9, tok.eos_token_id})


def test_eval_sampling_and_chat_template_settings_are_checked(tiny_model_dir, tmp_path):
    for bad, says in (
        (["data.chat_template=maybe"], "choose one of auto, on, off"),
        (["logging.eval_n_samples=4"], "eval_temperature=0 (greedy) gives identical samples"),
        (["logging.eval_n_samples=4", "logging.eval_temperature=0.6"], "must be 0 (greedy) or rollout.temperature"),
        (["data.max_prompt_tokens=-1"], "data.max_prompt_tokens=-1 is out of range"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)):
            _cfg(tmp_path, tiny_model_dir, *bad)
    assert _cfg(tmp_path, tiny_model_dir, "data.chat_template=off").data.chat_template == "off"  # YAML's boolean
    ok = _cfg(tmp_path, tiny_model_dir, "logging.eval_n_samples=4", "logging.eval_temperature=1.0")
    assert ok.logging.eval_n_samples == 4
