"""The model's tool calls in a chat reply, in the model's own format.

    reader = ToolCallReader(tokenizer)                   # megappo's: Hermes <tool_call> blocks (Qwen, SmolLM2)
    reader = ToolCallReader(tokenizer, "llama3_json")    # or one of vLLM's tool parsers, by its name
    content, calls = reader.read(ids, tools, stop_string) # calls: [(name, arguments as a JSON string)]

The default is megappo's own reader (agent/format.py), the format the built-in multi-turn loop trains
(Hermes / Qwen). A model trained on another format (Llama 3's JSON calls, Mistral's [TOOL_CALLS], DeepSeek,
Kimi, GLM, ...) names vLLM's parser for it (`megappo serve --tool-parser`, `rollout.agent_tool_parser`),
the same name as `vllm serve --tool-call-parser`, so the gateway reads its replies as vLLM's own server
would. The reader only shapes the reply: the trained ids are the sampled ids whatever it reads.
"""

from __future__ import annotations

import json
from typing import Optional


def vllm_tool_parsers() -> list[str]:
    """The names vLLM's ToolParserManager knows (its registry: the one list of choices)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})


def check_tool_parser(name: Optional[str]) -> None:
    """A name vLLM does not know: one line naming the choices."""
    if name is not None and name not in vllm_tool_parsers():
        raise ValueError(f"tool parser {name!r} is not one of vLLM's: choose one of {', '.join(vllm_tool_parsers())} "
                         "(as vllm serve --tool-call-parser), or leave it unset for Hermes <tool_call> blocks")


class ToolCallReader:
    def __init__(self, tokenizer, parser: Optional[str] = None):
        self.tokenizer, self.name = tokenizer, parser
        self._parser = None
        if parser is not None:
            check_tool_parser(parser)
            from vllm.tool_parsers import ToolParserManager

            try:
                self._parser = ToolParserManager.get_tool_parser(parser)(tokenizer)
            except Exception as e:  # e.g. the model's vocabulary lacks the parser's marker token
                raise ValueError(f"vLLM's {parser!r} tool parser does not fit this model's tokenizer "
                                 f"({' '.join(str(e).split())}): choose the parser of the model's own format") from None

    def read(self, ids: list[int], tools: Optional[list], stop_string: Optional[str] = None) -> tuple[str, list]:
        """(the reply's content, its tool calls as (name, JSON arguments)) from the sampled ids; a stop string
        that ended the reply is not content (as OpenAI's)."""
        if self._parser is None:
            return self._hermes(ids, stop_string)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="megappo", messages=[], tools=tools or None,
                                        tool_choice="auto" if tools else "none")
        request = self._parser.adjust_request(request)  # e.g. Mistral's keeps its [TOOL_CALLS] token in the text
        if not request.skip_special_tokens and ids and ids[-1] in self.tokenizer.all_special_ids:
            ids = ids[:-1]  # the token that ended the turn is not content
        text = _cut(self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens), stop_string)
        if not tools:
            return text, []
        info = self._parser.extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        return info.content or "", [(c.function.name, c.function.arguments) for c in info.tool_calls]

    def _hermes(self, ids: list[int], stop_string: Optional[str]) -> tuple[str, list]:
        from megappo.agent.format import parse_calls, strip_calls

        full = self.tokenizer.decode(ids, skip_special_tokens=True)
        calls = [c for c in parse_calls(full) if c.error is None]  # stop="</tool_call>" ends a call: parse it whole
        if not calls:
            return _cut(full, stop_string), []
        return strip_calls(full), [(c.name, json.dumps(c.arguments)) for c in calls]


def _cut(text: str, stop_string: Optional[str]) -> str:
    return text[:-len(stop_string)] if stop_string and text.endswith(stop_string) else text
