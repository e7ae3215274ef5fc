"""How many training prompts the generators index into: counted from rows, tokenized only under a length limit."""

from __future__ import annotations

from areal_hpc.config import Config
from areal_hpc.data import build_prompts, read_dataset, rows_need_answer


def count_train_prompts(cfg: Config) -> int:
    """len(load_run_dataset(cfg, tokenizer).train), the list each generator's granted indices point into.

    Without data.max_prompt_tokens every usable row is a prompt, so reading the rows is enough (a million rows
    in seconds, no tokenizer). With a limit only the prompts' tokens tell which fit, so they are built and
    tokenized as the generators do."""
    rows = read_dataset(cfg.data, need_answer=rows_need_answer(cfg))
    if not cfg.data.max_prompt_tokens:
        return len(rows.train)
    from areal_hpc.model import load_tokenizer

    return len(build_prompts(rows, load_tokenizer(cfg.model.path), cfg.data).train)
