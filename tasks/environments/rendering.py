"""Text to tokens at the two places an episode needs it: the first prompt (with its tools) and each observation.

The policy's own turns are never here: they stay the ids the engine sampled. An observation is encoded on its own
and appended, so nothing the policy wrote is ever decoded and encoded again (which need not give its ids back).

With a chat template, an observation is the text the template writes between the end of an assistant turn and
the start of the next one: the rest of the assistant turn's closing (what follows its end-of-turn token, a newline
say), the tool turn, and the generation prompt. It is found by rendering a short conversation with and without
the tool turn and taking the difference, so any template that renders a ``tool`` role works. Without a template,
the environment's ``PlainFormat`` says whether the tools are listed before the first prompt and how a tool's answer
is written (by default, listed, and ``types.OBSERVATION_PLAIN`` around the answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tasks.environments.tools import Tool, render_with_tools
from tasks.environments.types import Observation, PlainFormat

_MARK = "\x00MARK\x00"  # stands for the policy's turn in the rendered probe; no template writes it


class EpisodeFormat:
    """The chat format of one tokenizer: renders a first prompt and encodes observations. ``plain``: the
    environment's format for a tokenizer without a chat template."""

    def __init__(self, tokenizer: Any, tools: Sequence[Tool], plain: PlainFormat | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.plain = plain or PlainFormat()
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        if self.chat:
            probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
            closed = tokenizer.apply_chat_template(probe, tokenize=False)
            answered = tokenizer.apply_chat_template(
                [*probe, {"role": "tool", "content": _MARK}], tokenize=False, add_generation_prompt=True
            )
            if not answered.startswith(closed):
                raise ValueError("the chat template renders an assistant turn differently once a tool turn follows it")
            self._closing = closed[closed.index(_MARK) + len(_MARK) :]  # what ends an assistant turn
            self._before, _, self._after = answered[len(closed) :].partition(_MARK)

    def prompt(self, first: Observation) -> tuple[str, tuple[int, ...]]:
        """(the text the engine is fed first, its ids): the first observation as the user turn, with the tools."""
        if not self.chat:
            shown = self.tools if self.plain.show_tools else []
            text = render_with_tools(self.tokenizer, [{"role": "user", "content": first.text}], shown)
            return text, tuple(self.tokenizer(text)["input_ids"])
        messages = [{"role": "user", "content": first.text}]
        if first.system is not None:
            messages.insert(0, {"role": "system", "content": first.system})
        text = render_with_tools(self.tokenizer, messages, self.tools)
        return text, tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observation(self, text: str, *, turn_ids: Sequence[int], finish_reason: str) -> tuple[str, list[int]]:
        """(text, ids) appended after a policy turn that ended with ``turn_ids`` (``stop``: on an end-of-turn token or
        string, which the policy then wrote itself) so that the policy speaks next."""
        if not self.chat:
            body = self.plain.observation.format(text=text)
        else:
            closing = self._closing
            if finish_reason == "stop" and turn_ids:
                ended = self.tokenizer.decode([turn_ids[-1]])  # compared only, never stored
                if ended and closing.startswith(ended):
                    closing = closing[len(ended) :]
            body = closing + self._before + text + self._after
        return body, list(self.tokenizer(body, add_special_tokens=False)["input_ids"])
