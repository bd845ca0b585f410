"""The model's tool calls in a chat reply, in the model's own format.

    reader = ToolCallReader(tokenizer)                    # megappo's: Hermes <tool_call> blocks (Qwen, SmolLM2)
    reader = ToolCallReader(tokenizer, "llama3_json")     # or vLLM's parser for another format, by its name
    request = reader.request(body)                        # before sampling: the request's tools checked (400)
    content, calls = reader.read(request, ids, finish_reason, stop_string)   # calls: [(name, JSON arguments)]

The default is megappo's own reader (agent/format.py), the format the built-in multi-turn loop trains
(Hermes / Qwen); it reads calls whether or not the request listed tools. A model trained on another format
(Llama 3's JSON calls, Mistral's [TOOL_CALLS], DeepSeek, Kimi, GLM, ...) names vLLM's parser for it
(`megappo serve --tool-parser`, `rollout.agent_tool_parser`: the names `vllm serve --tool-call-parser`
takes), and the reply is read as vLLM's own server reads it with `--enable-auto-tool-choice` and that
parser, no reasoning parser: a parser per request built with the request's tools (vllm.parser's
ParserManager, as its chat serving does), its adjust_request unless tool_choice is "none", the text decoded
as the adjusted request says (skip_special_tokens), without the token that stopped the reply; tool calls
only when the request lists tools and tool_choice is not "none". Unlike vLLM's server the gateway does not
constrain sampling for tool_choice "required" or a named tool (it samples as for "auto"). The reader only
shapes the reply: the trained ids are the sampled ids whatever it reads.
"""

from __future__ import annotations

import json
from typing import Optional


def vllm_tool_parsers() -> list[str]:
    """The names vLLM's ToolParserManager knows (its registry: the one list of choices)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})


def check_tool_parser(name: Optional[str], tokenizer=None) -> None:
    """A name vLLM does not know, or (given the model's tokenizer) a parser whose marker tokens its vocabulary
    lacks: one line naming the fix."""
    if name is None:
        return
    if name not in vllm_tool_parsers():
        raise ValueError(f"tool parser {name!r} is not one of vLLM's: choose one of {', '.join(vllm_tool_parsers())} "
                         "(as vllm serve --tool-call-parser), or leave it unset for Hermes <tool_call> blocks")
    if tokenizer is not None:
        ToolCallReader(tokenizer, name)


class ToolCallReader:
    def __init__(self, tokenizer, parser: Optional[str] = None):
        self.tokenizer = tokenizer
        self._parser_cls = None
        if parser is not None:
            check_tool_parser(parser)
            from vllm.parser import ParserManager

            try:  # builds one with this tokenizer: vLLM's own startup check
                self._parser_cls = ParserManager.get_parser(tool_parser_name=parser, enable_auto_tools=True,
                                                            tokenizer=tokenizer)
            except Exception as e:  # e.g. the model's vocabulary lacks the parser's marker token
                raise ValueError(f"vLLM's {parser!r} tool parser does not fit this model's tokenizer "
                                 f"({' '.join(str(e).split())}): choose the parser of the model's own format") from None

    def request(self, body: dict):
        """The request as vLLM's parsers take it (its tools and tool_choice), built before anything is sampled:
        a tool vLLM's schema refuses raises ValueError (the gateway's 400). None for megappo's reader."""
        if self._parser_cls is None:
            return None
        import pydantic
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        tools = body.get("tools") or None
        choice = "none" if body.get("tool_choice") == "none" or not tools else "auto"
        try:
            return ChatCompletionRequest(model="megappo", messages=[], tools=tools, tool_choice=choice)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            raise ValueError(f"tools: {'.'.join(map(str, first['loc']))}: {first['msg']} (OpenAI's function tool: "
                             '{"type": "function", "function": {"name": ..., "parameters": {...}}})') from None

    def read(self, request, ids: list[int], finish_reason: str, stop_string: Optional[str] = None) -> tuple[str, list]:
        """(the reply's content, its tool calls as (name, JSON arguments)) from the sampled ids. What stopped the
        reply is not content (as OpenAI's and vLLM's): a stop string, or the stop token (EOS or another)."""
        if finish_reason == "stop" and not stop_string and ids:
            ids = ids[:-1]
        if self._parser_cls is None:
            return self._hermes(ids, stop_string)
        parser = self._parser_cls(self.tokenizer, request.tools)
        if request.tool_choice != "none" or self._parser_cls.always_adjust_request:
            request = parser.adjust_request(request)  # e.g. keep the tool-call marker tokens in the text
        text = _cut(self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens), stop_string)
        if request.tool_choice == "none":
            return text, []
        _, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=ids)
        return content or "", [(c.name, c.arguments) for c in calls or []]

    def _hermes(self, ids: list[int], stop_string: Optional[str]) -> tuple[str, list]:
        from megappo.agent.format import parse_calls, strip_calls

        full = self.tokenizer.decode(ids, skip_special_tokens=True)
        calls = [c for c in parse_calls(full) if c.error is None]  # stop="</tool_call>" ends a call: parse it whole
        if not calls:
            return _cut(full, stop_string), []
        return strip_calls(full), [(c.name, json.dumps(c.arguments)) for c in calls]


def _cut(text: str, stop_string: Optional[str]) -> str:
    return text[:-len(stop_string)] if stop_string and text.endswith(stop_string) else text
