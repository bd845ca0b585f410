"""The built-in `code` data source: the response's program runs against the row's test cases, each test in
megappo's python sandbox (megappo/sandbox/run.py: its own root, namespaces, a system-call allow-list, CPU,
memory and wall-clock limits), one sandbox call per test, and never anywhere else.

Ground truth (a dict, or its JSON text), the common form of APPS / TACO / DeepCoder-style sets:
    {"inputs": [...], "outputs": [...]}                  stdin/stdout: each input is the program's stdin
                                                          (text, or a list of lines), each output its expected stdout
    {"inputs": [...], "outputs": [...], "fn_name": "f"}  call-based: each input is the list of f's arguments and
                                                          each output its return value (f at module level, or a
                                                          method of a class Solution)
(`megappo data --data-source code` also takes a list of {"input", "output"} pairs and writes this form.)

The program is the response's last fenced python block (```python, ```py or a bare ```), or the whole
response when it has no fence. The sandbox sees the program and one test's input, never an expected output:
the comparison is made here, so nothing the program does in there can read or forge a verdict.
  - stdin/stdout: the output's whitespace-separated tokens equal the expected ones (numbers within 1e-6);
  - call-based: the return value (as JSON) equals the expected one (numbers within 1e-6), or the single
    element of an expected one-element list (APPS wraps return values so).
A test is passed, a wrong answer (an output longer than twice the expected one + 1 KB is one too), a timeout
(the CPU limit, or the wall clock: a program that sleeps or waits) or a runtime error (an exception, a nonzero
exit, memory past the limit, a crash); a response with no program that compiles is "no code" and runs nothing.
The row's score: `fraction` the share of its tests passed, `all` 1 when every one passes (its remaining tests
are skipped at the first failure). Each row's outcome (passed, or its first failing test's outcome, or no
code) is a metric of 0/1, logged per data_source as reward/<source>/<outcome>: their means are shares of rows.

This module imports no torch and, until the first call, not the sandbox.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from megappo.rewards.rules import Scored

log = logging.getLogger(__name__)
OUTCOMES = ("passed", "wrong_answer", "timeout", "runtime_error", "no_code")
SCORES = ("fraction", "all")
PYTHON_FENCES = ("", "python", "py", "python3")
TOLERANCE = 1e-6
# reward.code's defaults (config/schema.py CodeRewardConfig reads them: the one statement of them)
DEFAULTS = {"score": "fraction", "timeout_s": 5, "wall_s": 30.0, "memory_mb": 1024, "concurrency": 8}

# The harness the sandbox runs (the program and one test's input are its only data). Its input is a file made
# the process's fd 0 (input(), sys.stdin, sys.stdin.buffer, open(0) all read it), stderr goes to /dev/null (the
# sandbox's output is stdout + stderr), and exit()/quit() exist (python -S has no site module to define them).
_SETUP = """import builtins, io, json, os, sys
with open("/tmp/.stdin", "wb") as _f:
    _f.write({stdin!r})
_fd = os.open("/tmp/.stdin", os.O_RDONLY)
os.dup2(_fd, 0)
os.close(_fd)
os.unlink("/tmp/.stdin")
_fd = os.open("/dev/null", os.O_WRONLY)
os.dup2(_fd, 2)
os.close(_fd)
sys.stdin = open(0, closefd=False)
sys.stderr = open(2, "w", closefd=False)
builtins.exit = builtins.quit = sys.exit
"""
_STDIN = _SETUP + """exec(compile({program!r}, "<solution>", "exec"), {{"__name__": "__main__"}})
"""
# call-based: the program's own prints are kept off stdout; the return value is the output's last line
_CALL = _SETUP + """_g = {{"__name__": "solution"}}
sys.stdout = io.StringIO()
exec(compile({program!r}, "<solution>", "exec"), _g)
_fn = _g.get({fn_name!r})
if not callable(_fn) and isinstance(_g.get("Solution"), type):
    _fn = getattr(_g["Solution"](), {fn_name!r})
_result = _fn(*json.loads({args!r}))
sys.stdout = sys.__stdout__
print()
print(json.dumps(_result, default=repr))
"""


@dataclass(frozen=True)
class Tests:
    inputs: list  # stdin texts, or argument lists (call-based)
    outputs: list  # expected stdout texts, or return values
    fn_name: Optional[str] = None


def parse_tests(ground_truth: Any) -> Tests:
    """A row's ground truth -> its Tests; ValueError in one line naming the fix. Takes the dict, its JSON
    text, or a list of {"input", "output"} pairs (stdin/stdout)."""
    value = ground_truth
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"the code ground truth is not JSON ({e.msg} at column {e.colno}); give "
                             '{"inputs": [...], "outputs": [...]} (+ "fn_name" for call-based tests)') from None
    if isinstance(value, list) and value and all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in value):
        value = {"inputs": [t["input"] for t in value], "outputs": [t["output"] for t in value]}
    if not isinstance(value, dict) or not {"inputs", "outputs"} <= set(value):
        shown = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"the code ground truth ({shown}) is not the test JSON; give "
                         '{"inputs": [...], "outputs": [...]} (+ "fn_name" for call-based tests)')
    inputs, outputs, fn_name = value["inputs"], value["outputs"], value.get("fn_name")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"the code ground truth's inputs and outputs must be two lists of the same length >= 1 "
                         f"(got {_size(inputs)} inputs, {_size(outputs)} outputs); one output per input")
    if fn_name is not None:
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise ValueError(f"the code ground truth's fn_name={fn_name!r} is not a function name; give the "
                             "name the program defines, or drop fn_name for stdin/stdout tests")
        bad = next((i for i, a in enumerate(inputs) if not isinstance(a, list)), None)
        if bad is not None:
            raise ValueError(f"call-based test {bad}'s input is not a list of arguments "
                             f"({type(inputs[bad]).__name__}); write it as [arg1, arg2, ...] ({fn_name}(*input))")
        return Tests(inputs, outputs, fn_name)
    texts = [_text(v, "input", i) for i, v in enumerate(inputs)], [_text(v, "output", i) for i, v in enumerate(outputs)]
    return Tests(*texts)


def _size(value) -> str:
    return str(len(value)) if isinstance(value, list) else f"a {type(value).__name__} of"


def _text(value, what: str, i: int) -> str:
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value) + "\n"
    if not isinstance(value, str):
        raise ValueError(f"stdin/stdout test {i}'s {what} is not text ({type(value).__name__}); give text (or a "
                         "list of lines), or add fn_name for call-based tests")
    return value


def extract_program(response: str) -> Optional[str]:
    """The last fenced python block (a block cut off by the end of the response counts), or the whole
    response when it has no fence; None when its fences hold no python, or what is left is blank."""
    parts = response.split("```")
    if len(parts) == 1:
        program = response
    else:
        blocks = [p.partition("\n") for p in parts[1::2]]
        python = [body for info, _, body in blocks if info.strip().lower() in PYTHON_FENCES]
        if not python:
            return None
        program = python[-1]
    return program if program.strip() else None


def compiles(program: str) -> bool:
    """The program parses as Python (compiled here, never run: a response of prose is "no code")."""
    try:
        compile(program, "<solution>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    return True


def same_value(got, want) -> bool:
    """JSON values equal, numbers within TOLERANCE (absolute or relative)."""
    if _number(got) and _number(want):
        return math.isclose(got, want, rel_tol=TOLERANCE, abs_tol=TOLERANCE)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(same_value(a, b) for a, b in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k]) for k in got)
    return type(got) is type(want) and got == want


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _token(t: str):
    try:
        return float(t)
    except ValueError:
        return t


def same_stdout(got: str, want: str) -> bool:
    """Whitespace-separated tokens equal (numbers within TOLERANCE)."""
    a, b = got.split(), want.split()
    return len(a) == len(b) and all(x == y or same_value(_token(x), _token(y)) for x, y in zip(a, b))


def same_return(output: str, want) -> bool:
    lines = output.rstrip("\n").rsplit("\n", 1)
    try:
        got = json.loads(lines[-1])
    except json.JSONDecodeError:
        return False
    return same_value(got, want) or (isinstance(want, list) and len(want) == 1 and same_value(got, want[0]))


class SandboxUnavailable(RuntimeError):
    pass


class CodeReward:
    """The code reward, a batched rule (rewards/rules.py): `reward(responses, ground_truths, extra_infos) ->
    [Scored]`. Every test of the batch is one sandbox call; at most `concurrency` run at once."""

    def __init__(self, score: str = DEFAULTS["score"], timeout_s: int = DEFAULTS["timeout_s"],
                 wall_s: float = DEFAULTS["wall_s"], memory_mb: int = DEFAULTS["memory_mb"],
                 concurrency: int = DEFAULTS["concurrency"]):
        given = {"score": score, "timeout_s": timeout_s, "wall_s": wall_s, "memory_mb": memory_mb,
                 "concurrency": concurrency}
        rules = {"score": (score in SCORES, f"one of {', '.join(SCORES)}"),
                 "timeout_s": (_int(timeout_s) and timeout_s >= 1, "a whole number of CPU seconds >= 1 (RLIMIT_CPU)"),
                 "wall_s": (_number(wall_s) and wall_s > 0, "a number of seconds > 0"),
                 "memory_mb": (_int(memory_mb) and memory_mb >= 64, "a whole number of MB >= 64"),
                 "concurrency": (_int(concurrency) and concurrency >= 1, "a whole number >= 1")}
        for key, (ok, rule) in rules.items():
            if not ok:
                raise ValueError(f"reward.code.{key}={given[key]!r} must be {rule}")
        self.score, self.timeout_s, self.wall_s = score, int(timeout_s), float(wall_s)
        self.memory_mb, self.concurrency = int(memory_mb), int(concurrency)
        self._lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0  # sandbox calls running now / at most so far

    @classmethod
    def from_config(cls, code) -> "CodeReward":
        """From the config's reward.code section."""
        return cls(code.score, code.timeout_s, code.wall_s, code.memory_mb, code.concurrency)

    def __call__(self, responses: list, ground_truths: list, extra_infos: list) -> list[Scored]:
        rows: list = []  # per row: its tests' outcomes (None: not run), None: no code, or a Scored already
        jobs, bad, broken = [], [], []
        for r, (response, truth) in enumerate(zip(responses, ground_truths)):
            try:
                tests = parse_tests(truth)
            except ValueError as e:
                bad.append(e)
                rows.append(Scored(0.0, {}, "error"))
                continue
            program = extract_program(str(response))
            if program is None or not compiles(program):
                rows.append(None)
                continue
            rows.append([None] * len(tests.inputs))
            jobs += [(r, t, program, tests) for t in range(len(tests.inputs))]
        failed: set[int] = set()

        def run(job):
            r, t, program, tests = job
            if (self.score == "all" and r in failed) or broken:
                return
            for attempt in range(2):  # a sandbox that did not start (a loaded machine) is tried once more
                try:
                    rows[r][t] = self._run_test(program, tests, t)
                    break
                except SandboxUnavailable as e:
                    if attempt:
                        broken.append(e)
                        return
            if rows[r][t] != "passed":
                failed.add(r)

        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="code-reward") as pool:
            list(pool.map(run, jobs))
        scored = [row if isinstance(row, Scored) else self._row(row) for row in rows]
        unrun = sum(isinstance(row, list) and s.failure == "error" for row, s in zip(rows, scored))
        for n, what, error in ((len(bad), "have a ground truth that is not the test JSON", bad[:1]),
                               (unrun, "could not be run: the sandbox failed", broken[:1])):
            if n:
                log.warning("code reward: %d row(s) %s (%s); scored them 0", n, what, error[0])
        return scored

    def _row(self, outcomes: Optional[list]) -> Scored:
        if outcomes is None:
            return Scored(0.0, {o: float(o == "no_code") for o in OUTCOMES})
        passed = sum(o == "passed" for o in outcomes)
        first = next((o for o in outcomes if o not in (None, "passed")), "passed")
        if None in outcomes and (self.score == "fraction" or first == "passed"):  # left unrun by a failed sandbox
            return Scored(0.0, {}, "error")
        score = passed / len(outcomes) if self.score == "fraction" else float(passed == len(outcomes))
        return Scored(score, {o: float(o == first) for o in OUTCOMES})

    def _run_test(self, program: str, tests: Tests, t: int) -> str:
        from megappo.sandbox.run import Limits, run_python

        want = tests.outputs[t]
        if tests.fn_name is None:
            stdin, expected_bytes = tests.inputs[t].encode(), len(want.encode())
            harness = _STDIN.format(stdin=stdin, program=program)
        else:
            stdin, expected_bytes = b"", len(json.dumps(want))
            harness = _CALL.format(stdin=stdin, program=program, fn_name=tests.fn_name,
                                   args=json.dumps(tests.inputs[t]))
        limits = Limits(wall_s=self.wall_s, cpu_s=self.timeout_s, memory_mb=self.memory_mb,
                        max_file_mb=8 + (len(stdin) >> 20), max_output_bytes=2 * expected_bytes + 1024)
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            result = run_python(harness, limits)
        finally:
            with self._lock:
                self.in_flight -= 1
        error = result.error
        if error is None:
            same = same_stdout(result.output, want) if tests.fn_name is None else same_return(result.output, want)
            return "passed" if same else "wrong_answer"
        if error.startswith(("sandbox unavailable", "sandbox setup failed")):
            raise SandboxUnavailable(error)
        if result.timed_out or error.startswith("CPU time limit") or result.cpu_s >= self.timeout_s:
            return "timeout"
        if error.startswith("output longer than"):
            return "wrong_answer"
        return "runtime_error"


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_default: Optional[CodeReward] = None


def score_batch(responses: list, ground_truths: list, extra_infos: list) -> list[Scored]:
    """The built-in `code` rule with reward.code's defaults (the config's own settings: rules.load_rewards)."""
    global _default
    if _default is None:
        _default = CodeReward()
    return _default(responses, ground_truths, extra_infos)
