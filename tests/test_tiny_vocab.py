"""What the tiny demo model can read: text a workflow appends outside its vocabulary is warned about once, with
the text; the shipped examples stay inside it; a template YAML read as a mapping says how to quote it."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from areal_hpc.config import ConfigError, WorkflowConfig, load_config
from areal_hpc.engines.torch_gen import TorchGenerationEngine
from areal_hpc.model import load_tokenizer
from areal_hpc.reward import RewardPool
from areal_hpc.reward.functions import MathAnswer
from areal_hpc.types import SampleId
from areal_hpc.workflow import RunnerSettings, multi_turn
from areal_hpc.workflow.batch import EpisodeStart, run_episodes

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"


def _episodes(tiny_model_dir, feedback: str, caplog) -> list[logging.LogRecord]:
    """8 multi_turn episodes of an untrained model (wrong answers: feedback turns happen); the warnings logged."""
    tok = load_tokenizer(tiny_model_dir)
    settings = RunnerSettings(WorkflowConfig(max_turns=3, feedback=feedback), max_new_tokens=6, chat=True)
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+7="}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    starts = [EpisodeStart(str(SampleId(0, i)), {"question": "12+7=", "answer": "19"}, ids, False) for i in range(8)]
    caplog.clear()
    pool = RewardPool(num_workers=1, scorer=MathAnswer())
    with caplog.at_level(logging.WARNING, logger="areal_hpc.workflow"), pool:
        eps = run_episodes(TorchGenerationEngine(str(tiny_model_dir), seed=3), multi_turn, tok, pool, settings, starts)
    assert sum(e.stats.turns for e in eps) > 8  # feedback turns happened
    return [r for r in caplog.records if "unknown token" in r.getMessage()]


def test_appended_text_outside_the_vocabulary_is_warned_about_once_with_the_text(tiny_model_dir, caplog):
    # multi_turn's default feedback is words, which the tiny vocabulary cannot spell: the model would see <unk>
    (warned,) = _episodes(tiny_model_dir, "Wrong, try again.", caplog)
    assert "'Wrong, try again.'" in warned.getMessage() and "<unk>" in warned.getMessage()
    assert _episodes(tiny_model_dir, "12+7=", caplog) == []  # the question again is in the vocabulary


def test_the_shipped_examples_feedback_is_in_the_tiny_vocabulary(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    source = (ROOT / "jobs" / "examples" / "two_turn.py").read_text()
    (feedback,) = re.findall(r'append_message\("user", (.+)\)', source)
    assert feedback == 'ep.row["question"]'  # the question again: digits, + and =
    assert tok.unk_token_id not in tok.encode("07+15=", add_special_tokens=False)


@pytest.mark.parametrize(
    "override",
    ["data.prompt_template={question}", "data.prompt_template=Q: {question}", "data.prompt_template={a}+{b}="],
)
def test_an_unquoted_template_says_how_to_quote_it(override):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [override])
    line, value = str(err.value), override.split("=", 1)[1]
    assert "\n" not in line and "data.prompt_template" in line, line
    assert f"'data.prompt_template=\"{value}\"'" in line and f'prompt_template: "{value}"' in line, line
    assert load_config(DEMO, [f'data.prompt_template="{value}"']).data.prompt_template == value  # as advised


def test_the_readme_and_the_tool_demo_agree_on_its_time():
    seconds = yaml.safe_load((ROOT / "jobs" / "demo_tool.yaml").read_text())["trainer"]["max_wall_s"]
    readme = (ROOT / "README.md").read_text()
    said = re.search(r"demo_tool\.yaml` is a task where a tool matters.*? in (\d+) s", readme, re.S)
    assert said and int(said.group(1)) == seconds, (said and said.group(0), seconds)
