"""Text an episode appends, as tokens: chat turns rendered once per runner, unknown tokens warned once."""

from __future__ import annotations

import logging

from areal_hpc.data.prompts import after_assistant_turn
from areal_hpc.model import text_decoder

log = logging.getLogger("areal_hpc.workflow")


class EpisodeText:
    """The tokenizer as the episodes of one runner use it (`chat`: data.chat_template resolved)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.decode = text_decoder(tokenizer)
        self.chat = chat
        self._turns: dict[tuple[str, str], list[int]] = {}
        self._unk = getattr(tokenizer, "unk_token_id", None)  # None: a vocabulary that spells everything (bytes)
        self._unk_warned = False

    def encode(self, text: str) -> list[int]:
        """`text` as it is, tokenized once."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []
        self._check_known(text, ids)
        return ids

    def turn(self, role: str, content: str) -> list[int]:
        """Token ids of one new chat message plus the assistant's next-turn prompt (rendered once, cached)."""
        key = (role, content)
        if key not in self._turns:
            self._turns[key] = render_turn(self.tokenizer, role, content, self.chat)
        ids = list(self._turns[key])
        self._check_known(content, ids)
        return ids

    def _check_known(self, text: str, ids: list[int]) -> None:
        """Text a workflow appends that the vocabulary cannot spell becomes unknown tokens: the model never sees
        it. Warned once per runner (a run's generator), with the text."""
        if self._unk_warned or self._unk is None or self._unk not in ids:
            return
        self._unk_warned = True
        log.warning(
            "text a workflow appended maps to the model's unknown token %s in %d of its %d tokens, so the model "
            "never sees it: %r (the tiny demo model's vocabulary: docs/workflows.md; warned once)",
            self.tokenizer.convert_ids_to_tokens(self._unk),
            ids.count(self._unk),
            len(ids),
            text,
        )


def render_turn(tokenizer, role: str, content: str, chat: bool) -> list[int]:
    """The chat template's text for one more message after an assistant turn, with the next assistant prompt
    (`content` alone without a template)."""
    if not chat:
        return list(tokenizer.encode(content, add_special_tokens=False))
    text = after_assistant_turn(tokenizer, [{"role": role, "content": content}])
    return list(tokenizer.encode(text, add_special_tokens=False))
