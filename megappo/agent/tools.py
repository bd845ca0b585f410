"""Tools a policy can call during a multi-turn rollout: plain Python objects.

    tool = make_tools(["calculator"], timeout_s=5, max_output_chars=512)["calculator"]
    tool.call({"expression": "123 * 456"})        # ToolResult(text='56088', error=False)

A Tool has a name, a description and a JSON schema of its arguments (what the model is shown: in the
chat template's `tools` section where the template has one, else in the declared system prompt), and
`call(arguments) -> ToolResult`. A tool never raises on bad input: wrong arguments, a failing
expression, a timeout come back as an error text the model sees next (counted in the metrics).
A new tool: a subclass with `name`, `description`, `parameters` and `run`, added to TOOLS.
"""

from __future__ import annotations

import ast
import operator
import time
from dataclasses import dataclass
from fractions import Fraction


@dataclass
class ToolResult:
    text: str
    error: bool = False  # the call failed (an exception, a limit, or invalid)
    invalid: bool = False  # the call itself was malformed (bad JSON, unknown tool, wrong arguments)
    timed_out: bool = False
    seconds: float = 0.0


class Tool:
    name: str = ""
    description: str = ""
    parameters: dict = {}  # JSON schema of the arguments object

    def __init__(self, timeout_s: float = 5.0, max_output_chars: int = 512):
        self.timeout_s = float(timeout_s)
        self.max_output_chars = int(max_output_chars)

    def schema(self) -> dict:
        """OpenAI / HF chat-template form: {"type": "function", "function": {name, description, parameters}}."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def call(self, arguments) -> ToolResult:
        t0 = time.perf_counter()
        problem = self._check_arguments(arguments)
        if problem:
            return ToolResult(problem, error=True, invalid=True, seconds=time.perf_counter() - t0)
        try:
            result = self.run(arguments)
        except Exception as e:  # a tool's own failure is the model's observation, not the run's end
            result = ToolResult(f"error: {type(e).__name__}: {e}", error=True)
        result.text = self._cut(result.text)
        result.seconds = time.perf_counter() - t0
        return result

    def run(self, arguments: dict) -> ToolResult:
        raise NotImplementedError

    def _check_arguments(self, arguments) -> str:
        if not isinstance(arguments, dict):
            return f"error: {self.name} takes a JSON object of arguments, got {type(arguments).__name__}"
        props, required = self.parameters.get("properties", {}), self.parameters.get("required", [])
        missing = [k for k in required if k not in arguments]
        unknown = [k for k in arguments if k not in props]
        if missing or unknown:
            return (f"error: {self.name} takes {sorted(props)}" + (f"; missing {missing}" if missing else "")
                    + (f"; unknown {unknown}" if unknown else ""))
        wrong = [k for k, v in arguments.items() if props[k].get("type") == "string" and not isinstance(v, str)]
        return f"error: {self.name}: {wrong} must be strings" if wrong else ""

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[:self.max_output_chars] + f"... [cut at {self.max_output_chars} characters]"


class Calculator(Tool):
    """Exact arithmetic on integers and decimals: + - * / // % ** and parentheses, nothing else (the
    expression is parsed, never evaluated as code). Division is exact (a fraction prints as a decimal
    when it terminates within 12 places, else as p/q); exponents and results are bounded."""

    name = "calculator"
    description = "Evaluate an arithmetic expression exactly, e.g. (12 + 7) * 3 / 4. Operators: + - * / // % ** ( )."
    parameters = {"type": "object", "properties": {"expression": {"type": "string",
                                                                  "description": "the expression to evaluate"}},
                  "required": ["expression"]}

    _BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
    _UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
    MAX_DIGITS = 1000

    def run(self, arguments: dict) -> ToolResult:
        expr = arguments["expression"]
        if len(expr) > 500:
            return ToolResult("error: expression longer than 500 characters", error=True)
        try:
            value = self._eval(ast.parse(expr.replace("^", "**"), mode="eval").body)
        except ZeroDivisionError:
            return ToolResult("error: division by zero", error=True)
        except (SyntaxError, ValueError, TypeError) as e:
            return ToolResult(f"error: {e}" if str(e) else "error: not an arithmetic expression", error=True)
        return ToolResult(self._format(value))

    def _eval(self, node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._UNARY:
            return self._UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in self._BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                if right.denominator != 1 or abs(right) > 64:
                    raise ValueError("exponents must be integers in [-64, 64]")
                right = int(right)
            value = Fraction(self._BINARY[type(node.op)](left, right))
            if len(str(value.numerator)) + len(str(value.denominator)) > self.MAX_DIGITS:
                raise ValueError(f"result longer than {self.MAX_DIGITS} digits")
            return value
        raise ValueError(f"not allowed in an arithmetic expression: {ast.unparse(node)!r}")

    @staticmethod
    def _format(value: Fraction) -> str:
        if value.denominator == 1:
            return str(value.numerator)
        scaled = value * 10 ** 12
        if scaled.denominator == 1:  # terminates within 12 places
            sign, digits = ("-" if value < 0 else ""), str(abs(scaled.numerator)).rjust(13, "0")
            return f"{sign}{digits[:-12]}.{digits[-12:]}".rstrip("0").rstrip(".")
        return f"{value.numerator}/{value.denominator}"


class Python(Tool):
    """A Python interpreter in the sandbox (sandbox/run.py): the code's printed output comes back."""

    name = "python"
    description = "Run a Python 3 program and return what it prints (no network, no files kept, a few seconds)."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"]}

    def run(self, arguments: dict) -> ToolResult:
        from megappo.sandbox.run import Limits, run_python

        r = run_python(arguments["code"], Limits(wall_s=self.timeout_s, cpu_s=max(1, int(self.timeout_s)),
                                                 max_output_bytes=4 * self.max_output_chars))
        if r.error is None:
            return ToolResult(r.output)
        tail = r.output.strip().splitlines()[-1:] if r.output.strip() else []
        return ToolResult("error: " + "; ".join([r.error] + tail), error=True, timed_out=r.timed_out)


TOOLS: dict[str, type[Tool]] = {t.name: t for t in (Calculator, Python)}


def make_tools(names, timeout_s: float = 5.0, max_output_chars: int = 512) -> dict[str, Tool]:
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown} in rollout.multi_turn.tools (known: {', '.join(sorted(TOOLS))})")
    return {n: TOOLS[n](timeout_s=timeout_s, max_output_chars=max_output_chars) for n in names}


def tool_schemas(names) -> list[dict]:
    """The JSON schemas the model is shown for these tools (in order)."""
    return [t.schema() for t in make_tools(names).values()]


__all__ = ["tool_schemas", "Tool", "ToolResult", "Calculator", "Python", "TOOLS", "make_tools"]
