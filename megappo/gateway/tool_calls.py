"""The model's tool calls in a chat reply, in the model's own format.

    reader = ToolCallReader(tokenizer)                    # megappo's: Hermes <tool_call> blocks (Qwen, SmolLM2)
    reader = ToolCallReader(tokenizer, "llama3_json")     # or vLLM's parser for another format, by its name
    request, constraint = reader.prepare(body)            # before sampling: tools, tool_choice checked (400)
    content, calls, unread = reader.read(request, ids, finish_reason, stop_string)  # calls: [(name, JSON arguments)]

The default is megappo's own reader (agent/format.py), the format the built-in multi-turn loop trains
(Hermes / Qwen); it reads calls whether or not the request listed tools. A model trained on another format
(Llama 3's JSON calls, Mistral's [TOOL_CALLS], DeepSeek, Kimi, GLM, ...) names vLLM's parser for it
(`megappo serve --tool-parser`, `rollout.agent_tool_parser`: the names `vllm serve --tool-call-parser`
takes), and the reply is read as vLLM's own server reads it with `--enable-auto-tool-choice` and that
parser, no reasoning parser: a parser per request built with the request's tools (vllm.parser's
ParserManager, as its chat serving does), its adjust_request unless tool_choice is "none", the text decoded
as the adjusted request says (skip_special_tokens), without the token that stopped the reply; tool calls
only when the request lists tools and tool_choice is not "none". The reader only shapes the reply: the
trained ids are the sampled ids whatever it reads.

tool_choice "required" or a named tool ({"type": "function", "function": {"name": ...}}) constrains sampling
(the `constraint`: vLLM's structured outputs). megappo's reader holds the reply to Hermes calls whose arguments
match the tool's JSON schema (xgrammar's structural tag): a named tool's call is the whole reply; "required"
makes the reply start with a call (more may follow). A vLLM parser constrains as vLLM's server does with it
(the parser's adjust_request: a structural tag in the model's format, or its JSON-array fallback, which it
then parses). "auto" is never constrained: the policy's own samples are what PPO trains. A constrained reply
is kept as context, not trained (its tokens were sampled from the masked distribution, not the policy: as the
built-in loop's tool_choice=required turn); its text still counts as a turn for the reward rule.
"""

from __future__ import annotations

import json
from typing import Optional

from megappo.agent.format import CALL_END, CALL_START, regex_literal


def vllm_tool_parsers() -> list[str]:
    """The names vLLM's ToolParserManager knows (its registry: the one list of choices)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})


CHOICE_FORMS = '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}'


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

    def prepare(self, body: dict) -> tuple:
        """Before anything is sampled: (what `read` takes, the sampling constraint: vLLM's
        StructuredOutputsParams for tool_choice "required" or a named tool, else None). A tool vLLM's schema
        refuses, a tool_choice of another form or naming no listed tool: ValueError (the gateway's 400).
        megappo's reader constrains to its Hermes calls (_hermes_constraint); a vLLM parser as vLLM's server
        does (the parser's adjust_request: a structural tag in the model's format, or its JSON fallback)."""
        choice = _tool_choice(body)
        forced = choice not in ("auto", "none")
        if self._parser_cls is None:
            return choice, _hermes_constraint(body, choice) if forced else None
        import pydantic
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        tools = body.get("tools") or None
        try:
            request = ChatCompletionRequest(model="megappo", messages=[], tools=tools,
                                            tool_choice=choice if tools else "none",
                                            parallel_tool_calls=body.get("parallel_tool_calls") is not False)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            raise ValueError(f"tools: {'.'.join(map(str, first['loc']))}: {first['msg']} (OpenAI's function tool: "
                             '{"type": "function", "function": {"name": ..., "parameters": {...}}})') from None
        if request.tool_choice != "none" or self._parser_cls.always_adjust_request:
            request = self._parser_cls(self.tokenizer, request.tools).adjust_request(request)  # e.g. keep markers
        constraint = request.structured_outputs if forced else None  # "auto" samples the policy, unconstrained
        if forced and constraint is None:
            raise ValueError(f"this server's vLLM tool parser constrains no tool_choice={json.dumps(choice)[:80]}: "
                             'send tool_choice "auto"')
        return request, constraint

    def read(self, request, ids: list[int], finish_reason: str, stop_string: Optional[str] = None) -> tuple[str, list, int]:
        """(the reply's content, its tool calls as (name, JSON arguments), how many call blocks could not be read)
        from the sampled ids. What stopped the reply is not content (as OpenAI's and vLLM's): a stop string, or the
        stop token (EOS or another). Unreadable blocks (agent/format's parse fails) are counted in megappo's Hermes
        format only, not under tool_choice "none"; a vLLM parser reports none. A call naming a tool the request did
        not list is handed out (as vLLM's server does) and is not counted unreadable."""
        if finish_reason == "stop" and not stop_string and ids:
            ids = ids[:-1]
        if self._parser_cls is None:
            return self._hermes(ids, stop_string, request)
        parser = self._parser_cls(self.tokenizer, request.tools)
        text = _cut(self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens), stop_string)
        if request.tool_choice == "none":
            return text, [], 0
        _, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=ids)
        return content or "", [(c.name, c.arguments) for c in calls or []], 0

    def _hermes(self, ids: list[int], stop_string: Optional[str], choice) -> tuple[str, list, int]:
        from megappo.agent.format import parse_calls, strip_calls

        full = self.tokenizer.decode(ids, skip_special_tokens=True)
        # stop="</tool_call>" ends a call: parse it whole; tool_choice "none": no calls, as vLLM's server
        blocks = parse_calls(full) if choice != "none" else []
        calls = [c for c in blocks if c.error is None]
        if not calls:
            return _cut(full, stop_string), [], len(blocks)
        return strip_calls(full), [(c.name, json.dumps(c.arguments)) for c in calls], len(blocks) - len(calls)


def _tool_choice(body: dict):
    """The request's tool_choice ("auto" when absent), checked against its tools: ValueError if of another form,
    forcing a call without tools, or naming a tool it does not list."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    shown = json.dumps(choice)[:80]
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    if choice != "required" and not named:
        raise ValueError(f"tool_choice={shown} is not one of {CHOICE_FORMS}")
    names = [t["function"]["name"] for t in body.get("tools") or []]
    if not names:
        raise ValueError(f'tool_choice={shown} needs tools: list them in tools, or send tool_choice "auto"')
    if named and choice["function"].get("name") not in names:
        raise ValueError(f"tool_choice={shown} names no tool in this request's tools ({', '.join(names)}): "
                         'list it in tools, or send tool_choice "auto"')
    return choice


def _hermes_constraint(body: dict, choice):
    """vLLM's StructuredOutputsParams holding a reply to Hermes calls of the chosen tools (xgrammar's structural
    tag): <tool_call>, a newline or not (Qwen's template writes one, megappo's tool prompts none),
    {"name": "<tool>", "arguments": <JSON its parameters' schema allows (any object where it gives none)>}, a
    newline or not, </tool_call>; at most 2 whitespace characters in a row inside the arguments (a policy early
    in training, or a random one, can otherwise spin on whitespace until max_tokens). A named tool: the call is
    the whole reply; "required": the reply starts with a call, more may follow (one with parallel_tool_calls
    false). The parameters stay the root of their JSON schema, so their $defs references resolve."""
    from vllm.sampling_params import StructuredOutputsParams
    from xgrammar.structural_tag import (JSONSchemaFormat, OrFormat, RegexFormat, SequenceFormat, StructuralTag,
                                         TagFormat, TriggeredTagsFormat)

    functions = [t["function"] for t in body["tools"]]
    if choice != "required":
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]

    def call(f):
        head = RegexFormat(pattern="\n?" + regex_literal('{"name": ' + json.dumps(f["name"]) + ', "arguments": '))
        args = JSONSchemaFormat(json_schema=f.get("parameters") or {"type": "object"}, max_whitespace_cnt=2)
        return SequenceFormat(elements=[head, args, RegexFormat(pattern="\\}\n?")])

    calls = [call(f) for f in functions]
    tag = TagFormat(begin=CALL_START, content=calls[0] if len(calls) == 1 else OrFormat(elements=calls), end=CALL_END)
    if choice == "required":
        tag = TriggeredTagsFormat(triggers=[CALL_START], tags=[tag], at_least_one=True,
                                  stop_after_first=body.get("parallel_tool_calls") is False)
    return StructuredOutputsParams(structural_tag=StructuralTag(format=tag).model_dump_json())


def _cut(text: str, stop_string: Optional[str]) -> str:
    return text[:-len(stop_string)] if stop_string and text.endswith(stop_string) else text
