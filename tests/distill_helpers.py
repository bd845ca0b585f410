"""What the distillation tests share: a stand-in teacher server (the client's retries and the rows' placement are
under test, not a model; conftest's `fake_teacher` starts one) and the check that a batch's teacher log-probs
are the server's and that tokens nobody sampled carry no term."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def fake_log_prob(k: int, token: int) -> float:
    """What the stand-in server says of the k-th token of a prompt: a value tied to its place and id."""
    return -(1.0 + k / 100 + token / 100_000)


class FakeTeacher:
    """A stand-in OpenAI-compatible teacher on loopback (the client's retries are under test, not a model):
    /v1/models lists "teacher"; /v1/completions answers an echoed completion, the k-th prompt token's log-prob
    fake_log_prob(k, id). `faults` lists what the next requests get ("503", "drop": the connection closed
    unanswered, "400", "slow": an answer after `slow_s`, "one": a batch prompt answered with one choice only, as a
    server that takes no batch); it counts requests and the most in flight."""

    def __init__(self, faults=(), slow_s: float = 0.0):
        self.faults, self.slow_s = list(faults), slow_s
        self.models_body = {"object": "list", "data": [{"id": "teacher", "object": "model"}]}  # GET /v1/models
        self.requests, self.in_flight, self.most_in_flight, self.bodies = 0, 0, 0, []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, owner.models_body)

            def do_POST(self):
                import time

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.requests += 1
                    owner.in_flight += 1
                    owner.most_in_flight = max(owner.most_in_flight, owner.in_flight)
                    fault = owner.faults.pop(0) if owner.faults else None
                    owner.bodies.append(body)
                time.sleep(0.02)  # long enough for requests to overlap
                if fault == "slow":
                    time.sleep(owner.slow_s)
                prompt = body["prompt"]
                batch = prompt if prompt and isinstance(prompt[0], list) else [prompt]  # a batch of id lists

                def choice(i, ids):  # answered last to first: the client orders them by index
                    lps = [None] + [fake_log_prob(k, t) for k, t in enumerate(ids)][1:] + [-0.5]
                    return {"index": i, "text": "", "token_ids": [7], "prompt_token_ids": ids,
                            "logprobs": {"token_logprobs": lps}}
                choices = [choice(i, ids) for i, ids in enumerate(batch)][::-1]
                reply = {"503": (503, {"error": {"message": "overloaded", "code": 503}}),
                         "400": (400, {"error": {"message": "prompt is longer than max_model_len 64"}})}.get(
                    fault, (200, {"choices": choices[:1] if fault == "one" else choices, "prompt_token_ids": batch[0]}))
                with owner.lock:  # out of flight before the client can see an answer (and send the next request)
                    owner.in_flight -= 1
                if fault == "drop":
                    self.close_connection = True
                    return self.connection.shutdown(2)
                self._send(*reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True  # close() never waits for a "slow" answer nobody waits for any more
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def check_teacher_rows(batch) -> None:
    """Each row's teacher log-probs are the stand-in server's for its tokens (every response token scored as
    context: sampled, a tool's result, text an agent inserted), and no token outside response_mask has an
    advantage although the teacher scored it."""
    b = batch.batch
    width = b["prompts"].shape[1]
    for i in range(len(batch)):
        p = int(b["attention_mask"][i, :width].sum())
        n = int(b["attention_mask"][i, width:].sum())
        ids = b["responses"][i].tolist()
        want = torch.tensor([fake_log_prob(p + j, ids[j]) for j in range(n)])
        assert torch.allclose(b["teacher_log_prob"][i, :n], want, atol=1e-6)
    untrained = (b["response_mask"] == 0) & (b["attention_mask"][:, width:] == 1)
    if "advantages" in b:
        assert torch.equal(b["advantages"][untrained], torch.zeros(int(untrained.sum())))
