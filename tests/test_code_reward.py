"""The code reward (issue #75, rewards/code.py): programs scored against their tests in the real sandbox (right,
wrong, partly right, too slow, crashing, no code, call-based right and wrong), the ground truth's forms and its bad
inputs, and hostile programs through the reward's own path. Each hostile payload is first run unconfined (a plain
interpreter fed the test's stdin) to show that it would pass its test, or leave something on the host; through the
reward it gets nothing, scores 0, and leaves nothing."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading

import pytest

from megappo.rewards.code import CodeReward, extract_program, parse_tests, same_stdout
from test_sandbox import alive_named
from waiting import wait_for

# the wall clock bounds the sandbox's start too, which a loaded machine slows to seconds: the programs that must
# finish get a bound no busy machine reaches; the CPU limit (1 s) is what stops the slow ones
REWARD = CodeReward(timeout_s=1, wall_s=120, memory_mb=512, concurrency=4)
ADD = {"inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7\n", "5\n"]}
CALL = {"inputs": [[1, 2], [3, 4], [[1], [2, 3]]], "outputs": [3, 7, [1, 2, 3]], "fn_name": "add"}


def fenced(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```\nIt reads the input and prints the answer."


PROGRAMS = [  # name, response, ground truth, score, outcome
    ("right", fenced("a, b = map(int, input().split())\nprint(a + b)"), ADD, 1.0, "passed"),
    ("right, read as open(0) and exit()", "import sys\nprint(sum(map(int, open(0).read().split())))\nexit()",
     ADD, 1.0, "passed"),
    ("right, in a thread with a big stack", fenced("import threading\nthreading.stack_size(1 << 26)\n"
                                                  "threading.Thread(target=lambda: print(sum(map(int, input().split())))"
                                                  ").start()"), ADD, 1.0, "passed"),
    ("wrong", fenced("a, b = map(int, input().split())\nprint(a - b)"), ADD, 0.0, "wrong_answer"),
    ("partly right", fenced("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"), ADD, 2 / 3,
     "wrong_answer"),
    ("too slow", fenced("while True:\n    pass"), ADD, 0.0, "timeout"),
    ("crashing", fenced("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)"), ADD, 0.0,
     "runtime_error"),
    ("past its memory", fenced("x = bytearray(2 << 30)\nprint(3)"), ADD, 0.0, "runtime_error"),
    ("prose, no code", "The sum of the two numbers is a + b.", ADD, 0.0, "no_code"),
    ("only a C++ block", "```cpp\nint main() { return 0; }\n```", ADD, 0.0, "no_code"),
    ("call-based right", fenced("def add(a, b):\n    print('debugging')  # its prints are not its answer\n"
                                "    return a + b"), CALL, 1.0, "passed"),
    ("call-based right, a Solution method", "class Solution:\n    def add(self, a, b):\n        return a + b",
     json.dumps(CALL), 1.0, "passed"),
    ("call-based wrong", fenced("def add(a, b):\n    return b + a if isinstance(a, int) else a"), CALL, 2 / 3,
     "wrong_answer"),
    ("call-based right, outputs wrapped as APPS does", "def add(a, b):\n    return a + b",
     {"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "add"}, 1.0, "passed"),
    ("call-based, no such function", fenced("def plus(a, b):\n    return a + b"), CALL, 0.0, "runtime_error"),
]


def test_programs_are_scored_against_their_tests_in_the_sandbox():
    scored = REWARD([p[1] for p in PROGRAMS], [p[2] for p in PROGRAMS], [{} for _ in PROGRAMS])
    for (name, _, _, score, outcome), s in zip(PROGRAMS, scored):
        assert s.failure == "" and s.score == pytest.approx(score), (name, s)
        assert s.extras == {o: float(o == outcome) for o in s.extras} and s.extras[outcome] == 1.0, (name, s)
    assert 1 < REWARD.max_in_flight <= REWARD.concurrency  # concurrent, under the cap


def test_all_scores_only_a_program_that_passes_every_test_and_a_sleeping_one_is_a_timeout():
    partly, right = PROGRAMS[4][1], PROGRAMS[0][1]
    assert [s.score for s in CodeReward(score="all", wall_s=120)([partly, right], [ADD, ADD], [{}, {}])] == [0.0, 1.0]
    # stopped by the wall clock (it uses no CPU); a bound this small can only make it time out sooner
    sleeping = CodeReward(wall_s=2)([fenced("import time\ntime.sleep(600)")], [ADD], [{}])[0]
    assert sleeping.score == 0.0 and sleeping.extras["timeout"] == 1.0, sleeping


@pytest.mark.parametrize("response, program", [
    ("```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```", "print(2)\n"),  # the last block
    ("```py\nprint(1)\n```", "print(1)\n"),
    ("```\nprint(1)\n```", "print(1)\n"),  # a bare fence
    ("```python\nprint(1)\n", "print(1)\n"),  # cut off by the end of the response
    ("```python\nprint(1)\n```\n```text\nout: 1\n```", "print(1)\n"),  # not a python block
    ("print(1)", "print(1)"),  # no fence: the whole response
    ("```bash\necho 1\n```", None),
    ("```python\n\n```", None),
])
def test_the_program_is_the_last_fenced_python_block_or_the_whole_response(response, program):
    assert extract_program(response) == program


def test_the_ground_truth_forms_are_one_test_set():
    stdin = parse_tests({"inputs": [["1 2", "3"]], "outputs": ["3"]})
    assert stdin.inputs == ["1 2\n3\n"] and stdin.fn_name is None  # a list of lines is the text of those lines
    pairs = parse_tests(json.dumps([{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]))
    assert pairs.inputs == ["1 2\n", "5 5\n"] and pairs.outputs == ["3\n", "10\n"]
    assert parse_tests(json.dumps(CALL)).fn_name == "add"
    assert same_stdout("3  \n7\n", "3\n7") and same_stdout("0.3333333\n", "0.33333333") and not same_stdout("3 7", "37")


@pytest.mark.parametrize("truth, expected", [
    ("{inputs: [1]}", "not JSON"),
    ({"inputs": ["1"]}, "is not the test JSON"),
    ("7", "is not the test JSON"),
    ({"inputs": ["1", "2"], "outputs": ["1"]}, "same length"),
    ({"inputs": [], "outputs": []}, "same length >= 1"),
    ({"inputs": [1], "outputs": ["1"]}, "test 0's input is not text"),
    ({"inputs": ["1"], "outputs": ["1"], "fn_name": "f"}, "not a list of arguments"),
    ({"inputs": [[1]], "outputs": [1], "fn_name": "not a name"}, "is not a function name"),
])
def test_a_ground_truth_that_is_not_the_test_json_is_one_line(truth, expected):
    with pytest.raises(ValueError, match=expected) as e:
        parse_tests(truth)
    assert "\n" not in str(e.value) and any(fix in str(e.value) for fix in ("; give", "; write", "; one output"))


def test_a_row_with_a_bad_ground_truth_fails_alone(caplog):
    scored = REWARD([PROGRAMS[0][1], PROGRAMS[0][1]], ["not json", ADD], [{}, {}])
    assert scored[0].failure == "error" and scored[0].score == 0.0 and scored[1].score == 1.0
    assert "1 row(s) have a ground truth that is not the test JSON" in caplog.text


def test_the_code_recipes_rows_pass_with_their_reference_and_fail_otherwise(tmp_path):
    """preprocess_code_fn (configs/grpo_tiny_code.yaml's data): a row's tests pass with its reference line and fail
    with another operator, or with a program that returns the first test's answer; val asks only for the held-out
    functions, which train never asks for."""
    import pyarrow.parquet as pq

    from megappo.data.preprocess_code_fn import OPERATORS, functions, main, solution

    assert main(["--out", str(tmp_path), "--train-size", "1", "--val-size", "3"]) == 0
    rows = {split: pq.read_table(tmp_path / f"code_fn_{split}.parquet").to_pylist() for split in ("train", "val")}
    pools = functions()
    assert not set(pools["train"]) & set(pools["val"]) and len(pools["train"]) + len(pools["val"]) == 3 * 99
    asked = {split: [(r["extra_info"]["operator"], r["extra_info"]["constant"]) for r in rs]
             for split, rs in rows.items()}
    assert set(asked["train"]) <= set(pools["train"]) and len(set(asked["val"]) & set(pools["val"])) == 3
    (word, c), truth = asked["train"][0], rows["train"][0]["reward_model"]["ground_truth"]
    other = next(w for w in sorted(OPERATORS) if w != word)
    responses = [solution(word, c), solution(other, c), f"def f(x): return {json.loads(truth)['outputs'][0]}"]
    assert [s.score for s in REWARD(responses, [truth] * 3, [{}] * 3)] == [1.0, 0.0, 0.5]


# ---- hostile programs --------------------------------------------------------------------------------------

def unconfined(program: str, stdin: str, cwd) -> str:
    """The program's stdout under a plain interpreter, fed `stdin` (a file: what it leaves may hold a pipe)."""
    with open(cwd / "stdout", "w+") as out:
        subprocess.run([sys.executable, "-I", "-c", program], input=stdin, cwd=cwd, stdout=out, text=True,
                       timeout=120)
        out.seek(0)
        return out.read()


def reads_the_answer_key(path: str) -> str:
    return f"open({path + '.escaped'!r}, 'w').write('x')\nprint(open({path!r}).read())"


def asks_a_host_service(port: int) -> str:
    return f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=10)\nprint(s.recv(100).decode())"


def fork_bomb(name: str, n: int) -> str:
    """A bounded fork bomb: `n` children named `name` that stay (asleep), then the answer (its input)."""
    return f"""import ctypes, os, time
for _ in range({n}):
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)
        time.sleep(600)
        os._exit(0)
print(input())"""


def stays_behind(name: str) -> str:
    """A child that leaves the session and stays; where it cannot fork, the program stays itself: named `name`,
    deaf to every signal it can ignore (the CPU limit's included), burning CPU in threads."""
    return f"""import ctypes, os, signal, threading, time
print(input(), flush=True)
try:
    pid = os.fork()
except OSError:
    pid = -1
if pid <= 0:
    ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)
if pid == 0:
    os.setsid()
    time.sleep(600)
elif pid < 0:
    for s in range(1, signal.NSIG):
        try:
            signal.signal(s, signal.SIG_IGN)
        except (OSError, ValueError):
            pass
    def burn():
        while True:
            pass
    for _ in range(4):
        threading.Thread(target=burn).start()
    time.sleep(600)"""


@pytest.fixture
def host_service():
    """A loopback TCP server that hands the answer to whoever connects: (port, answer, connections)."""
    answer, connections = "SERVED-" + secrets.token_hex(6), []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            connections.append(1)
            conn.sendall(answer.encode())
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield server.getsockname()[1], answer, connections
    stop.set()
    t.join()
    server.close()


def kill_named(name: str) -> None:
    for pid in alive_named(name):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("escape", ["host files", "network", "fork bomb", "leftover processes"])
def test_a_hostile_program_gets_nothing_scores_zero_and_leaves_nothing(escape, tmp_path, host_service):
    name, n = "mp" + secrets.token_hex(5), 8
    stdin, leaves = "go\n", 0
    if escape == "host files":
        answer = "ANSWER-" + secrets.token_hex(6)
        key = tmp_path / "answers.txt"
        key.write_text(answer)  # the answer key, where the run's data lives
        program = reads_the_answer_key(str(key))
    elif escape == "network":
        port, answer, connections = host_service
        program = asks_a_host_service(port)
    else:
        answer = "go"  # the program is right: what it must not do is stay on the host
        program, leaves = (fork_bomb(name, n), n) if escape == "fork bomb" else (stays_behind(name), 1)
    truth = {"inputs": [stdin], "outputs": [answer]}
    try:  # unconfined it passes its test (and leaves what it leaves)
        out = unconfined(program, stdin, tmp_path)
        assert same_stdout(out, answer), (escape, out)
        if leaves:
            wait_for(lambda: len(alive_named(name)) == leaves, f"the unconfined {escape} to leave {leaves} processes")
    finally:
        kill_named(name)
    if escape == "host files":
        assert (tmp_path / "answers.txt.escaped").exists()
        (tmp_path / "answers.txt.escaped").unlink()
    if escape == "network":
        assert len(connections) == 1
    expected = "timeout" if escape == "leftover processes" else "runtime_error"  # it stays until the CPU limit
    scored = REWARD([fenced(program)], [truth], [{}])[0]
    assert scored.score == 0.0 and scored.extras[expected] == 1.0, (escape, scored)
    assert alive_named(name) == []  # the call's end took everything it started with it
    assert not (tmp_path / "answers.txt.escaped").exists()
    if escape == "network":
        assert len(connections) == 1  # nothing reached the server from inside
