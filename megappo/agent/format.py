"""How tool calls and tool results look in the token stream.

Calls are Hermes / Qwen style, the format Qwen2.5 / Qwen3 are trained on and the one verl's and
vLLM's `hermes` parsers read:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

The model learns of its tools in one of two ways, decided once per run (`tool_prompt_mode`):
- "template": the chat template has a tools section (Qwen's does): the prompt is rendered with
  `apply_chat_template(..., tools=[schemas])`;
- "declared": `rollout.multi_turn.tool_prompt` is set (needed for a template without one, e.g.
  SmolLM2's): that text, with `{tools}` replaced by the tools' JSON schemas one per line, becomes the
  system message (appended to the prompt's own system message if it has one).
A tool result goes back as a `tool` message rendered by the chat template, followed by the next
assistant header: `observation_ids` returns exactly the tokens between the model's turn and its next
one (the model's own tokens are never re-tokenised).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_MARK = "\u2063megappo-turn-end\u2063"  # a string no template alters


def template_has_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def check_tool_prompt(tool_prompt: Optional[str], where: str = "rollout.multi_turn.tool_prompt") -> None:
    """A tool prompt must say where the tools go: without `{tools}` the model would silently see none.
    ValueError naming `where` (the config key or the flag that set it)."""
    if tool_prompt is not None and "{tools}" not in tool_prompt:
        raise ValueError(f"{where} must contain {{tools}} (where the tools' schemas go); the model would see no "
                         "tools")


def tool_prompt_mode(tokenizer, tool_prompt: Optional[str]) -> str:
    """'declared' when a tool prompt is configured, else 'template'; raises when neither can work."""
    if tool_prompt:
        return "declared"
    if not template_has_tools(tokenizer):
        raise ValueError("the model's chat template has no tools section: set rollout.multi_turn.tool_prompt "
                         "(a system prompt describing the tools, with {tools} where their schemas go)")
    return "template"


def with_tools(messages: list[dict], tokenizer, schemas: list[dict], tool_prompt: Optional[str]) -> tuple[list, dict]:
    """(messages, extra apply_chat_template kwargs) that show the model its tools."""
    if tool_prompt_mode(tokenizer, tool_prompt) == "template":
        return messages, {"tools": schemas}
    text = tool_prompt.replace("{tools}", "\n".join(json.dumps(s["function"]) for s in schemas))
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}] + messages[1:], {}
    return [{"role": "system", "content": text}] + messages, {}


def regex_literal(text: str) -> str:
    """`text` as a regex that matches it alone (the escapes xgrammar's and outlines' regexes take)."""
    return "".join("\\" + c if c in "\\.^$*+?{}[]|()" else c for c in text)


def forced_call_regex(schemas: list[dict], max_chars: int = 48) -> str:
    """A regex that only well-formed calls of these tools match (string arguments, required ones, in
    schema order, no escapes): what tool_choice=required constrains a first turn to."""
    value = '"[ !#-\\[\\]-~]{1,%d}"' % max_chars  # printable ASCII but quotes and backslashes: a valid JSON string
    alternatives = []
    for s in schemas:
        f = s["function"]
        names = f["parameters"].get("required") or list(f["parameters"].get("properties", {}))
        args = ", ".join(regex_literal(f'"{k}": ') + value for k in names)
        alternatives.append(regex_literal(f'{CALL_START}{{"name": "{f["name"]}", "arguments": {{') + args
                            + regex_literal(f"}}}}{CALL_END}"))
    return "(" + "|".join(alternatives) + ")"


@dataclass
class Call:
    name: Optional[str]
    arguments: Optional[dict]
    error: Optional[str] = None  # malformed: the observation the model gets instead of a result
    ended_turn: bool = False  # the model closed its turn (EOS) after the call, not at </tool_call>


def parse_call(text: str) -> Optional[Call]:
    """The first tool call in a model turn; None when the turn makes no call (an answer)."""
    m = _CALL.search(text)
    if m is None:
        return None
    try:
        obj = json.loads(m.group(1).strip())
    except json.JSONDecodeError as e:
        return Call(None, None, f"error: the tool call is not valid JSON ({e.msg}); write "
                                f'{CALL_START}{{"name": ..., "arguments": {{...}}}}{CALL_END}')
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(None, None, 'error: a tool call is a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return Call(obj["name"], args)


def parse_calls(text: str) -> list[Call]:
    """Every tool call in a model turn, in order (the OpenAI API returns them all)."""
    return [parse_call(m.group(0)) for m in _CALL.finditer(text)]


def strip_calls(text: str) -> str:
    """A turn's text without its tool-call blocks (an OpenAI assistant message's `content`)."""
    return _CALL.sub("", text).strip()


def between_turns(tokenizer, messages: list[dict], closing: Optional[str] = None,
                  template_kwargs: Optional[dict] = None) -> str:
    """The chat template's text after an assistant turn up to the next assistant header, given the messages
    that came after it (tool results, a user message): the end of the turn, their turns, the header. `closing`:
    the text of the model's own last token when it closed the turn itself (EOS / end-of-turn): not repeated;
    `template_kwargs`: the request's chat_template_kwargs (e.g. enable_thinking).
    The one rendering of what comes between two model turns: the built-in loop's tool results (Observations)
    and the gateway's extended conversations (agent/capture.ChatRenderer.delta_ids)."""
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}] + list(messages)
    full = tokenizer.apply_chat_template(msgs, **{**(template_kwargs or {}), "add_generation_prompt": True,
                                                  "tokenize": False})
    tail = full[full.index(_MARK) + len(_MARK):]
    return tail[len(closing):] if closing and tail.startswith(closing) else tail


class Observations:
    """Token ids of a tool result as the chat template renders it between two assistant turns."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.eos_token or ""

    def ids(self, result: str, model_ended_turn: bool) -> list[int]:
        """model_ended_turn: the model's tokens already close its turn (it emitted EOS / end-of-turn):
        that text is not repeated."""
        text = between_turns(self.tokenizer, [{"role": "tool", "content": result}],
                             self.eos_text if model_ended_turn else None)
        return self.tokenizer.encode(text, add_special_tokens=False)


__all__ = ["CALL_START", "CALL_END", "Call", "parse_call", "parse_calls", "strip_calls", "Observations", "between_turns", "with_tools",
           "tool_prompt_mode", "template_has_tools"]
