"""`megappo serve`: the gateway's OpenAI API over a HF model dir or a megappo checkpoint, so a trained
policy can be tried or evaluated with any OpenAI-compatible client or harness.

    megappo serve --model outputs/ppo_tiny/checkpoints/step_4 [--port 8000] [--api-key KEY]
    curl -s localhost:8000/v1/chat/completions -H "Authorization: Bearer KEY" \\
         -d '{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 32}'

Binds 127.0.0.1 unless --host says otherwise (then the key is all that guards it: a warning says so).
The key is --api-key, else $MEGAPPO_API_KEY (neither is ever printed), else a new one printed at start. Requests under it are served
and not recorded (sessions, for RL, are opened in process by the trainer: app.Gateway.open_session).
gateway/serve.py's `GatewayServer` runs the same app in a thread (tests, the trainer).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a HF model dir or a megappo checkpoint dir (step_N)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="the key clients send (default: $MEGAPPO_API_KEY or a new one)")
    p.add_argument("--name", default=None, help="the model name /v1/models reports (default: the dir's name; "
                   "<run>/step_N for a checkpoint)")
    p.add_argument("--export-dir", default=None,
                   help="a checkpoint: where its policy is exported as a HF dir (default: <checkpoint>/hf_served)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion tokens of one request (default: the model's positions)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="the most tokens one request may ask for (default: 512, or --max-model-len if less)")
    p.add_argument("--dtype", default=None, help="vLLM dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--tool-prompt", default=None,
                   help="for a chat template without a tools section: a system prompt with {tools}")
    p.add_argument("--tool-parser", default=None,
                   help="read tool calls with this vLLM parser (as vllm serve --tool-call-parser: llama3_json, mistral, "
                        "...); default: Hermes <tool_call> blocks")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="CPU: vLLM's KV cache size")


SOURCE = "megappo_served_from.json"  # in an export dir: the checkpoint it was exported from


def _hf_dir(model: Path, export_dir) -> tuple[Path, str]:
    """(the HF dir to serve, the name /v1/models reports): a HF dir as it is; a megappo checkpoint's policy
    exported once (megappo export) into `export_dir` (default <checkpoint>/hf_served) and reused on the next
    start if it says it came from this checkpoint (SOURCE); written beside it and renamed into place, so an
    interrupted export is never served. A dir that is not such an export is never written over."""
    from megappo.model_dirs import ModelDirError, kind_of
    from megappo.utils.checkpoint import MANIFEST

    try:
        kind = kind_of(model)
    except ModelDirError as e:
        raise SystemExit(f"serve: {e}") from None
    if kind == "hf":
        return model, model.resolve().name
    if kind != "checkpoint" or not (model / MANIFEST).is_file():
        raise SystemExit(f"serve: {model} is not a whole megappo checkpoint ({MANIFEST}): pass --model a HF model "
                         "dir or outputs/<run>/checkpoints/step_N")
    ckpt = model.resolve()
    name = f"{ckpt.parent.parent.name}/{ckpt.name}"  # outputs/<run>/checkpoints/step_N -> <run>/step_N
    out = (Path(export_dir) if export_dir else ckpt / "hf_served").resolve()
    source = {"checkpoint": str(ckpt), "manifest": (ckpt / MANIFEST).read_text()}
    if out.exists() and any(out.iterdir()):
        try:
            if json.loads((out / SOURCE).read_text()) == source:
                return out, name
        except (OSError, ValueError):
            pass
        raise SystemExit(f"serve: {out} exists and is not an export of {ckpt}; pass --export-dir an empty or new dir")
    import shutil

    from megappo.export import ExportError, export_checkpoint

    part = out.with_name(out.name + ".part")
    print(f"serve: exporting the checkpoint's policy to {out}", flush=True)
    try:
        export_checkpoint(ckpt, part, overwrite=True)
        (part / SOURCE).write_text(json.dumps(source))
        if out.exists():
            out.rmdir()  # empty (checked above)
        part.rename(out)
    except ExportError as e:
        raise SystemExit(f"serve: {e}") from None
    except PermissionError:
        raise SystemExit(f"serve: cannot write {part} (a read-only checkpoint?): pass --export-dir a writable "
                         "dir for the exported model") from None
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return out, name


def lengths(positions: int, max_model_len, max_tokens: int) -> tuple[int, int]:
    """(--max-model-len, --max-tokens) for a model of `positions`: the model's positions unless asked for fewer,
    the request cap within them; more than the model holds is one line naming the flag."""
    if max_model_len is None:
        max_model_len = positions
    elif max_model_len > positions:
        raise SystemExit(f"serve: --max-model-len {max_model_len} exceeds the model's {positions} positions "
                         "(config.json max_position_embeddings); lower it or leave it out")
    if max_tokens < 1:
        raise SystemExit(f"serve: --max-tokens {max_tokens} must be >= 1")
    return max_model_len, min(max_tokens, max_model_len - 1)


def main(args: argparse.Namespace) -> int:
    from megappo.agent.format import check_tool_prompt
    from megappo.model_dirs import ModelDirError, positions_of, tokenizer_of

    try:  # what can be checked before anything heavy is imported or an export starts
        check_tool_prompt(args.tool_prompt, "--tool-prompt")
    except ValueError as e:
        raise SystemExit(f"serve: {e}") from None
    from megappo.gateway.tool_calls import check_tool_parser

    try:
        check_tool_parser(args.tool_parser)  # the name, before an export
    except ValueError as e:
        raise SystemExit(f"serve: --tool-parser: {e}") from None
    hf, name = _hf_dir(Path(args.model), args.export_dir)
    try:
        tokenizer = tokenizer_of(hf)
    except ModelDirError as e:
        raise SystemExit(f"serve: {e}") from None
    try:  # the tool parser's marker tokens in the model's vocabulary, before vLLM loads
        check_tool_parser(args.tool_parser, tokenizer)
    except ValueError as e:
        raise SystemExit(f"serve: --tool-parser: {e}") from None
    max_model_len, max_tokens = lengths(positions_of(hf), args.max_model_len, args.max_tokens)
    import uvicorn

    from megappo.config.schema import RolloutConfig
    from megappo.data.images import processor_for
    from megappo.gateway.app import Gateway, make_app
    from megappo.workers.rollout.async_engine import AsyncTokenEngine
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    key = args.api_key or os.environ.get("MEGAPPO_API_KEY") or "mp-" + secrets.token_urlsafe(24)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"serve: WARNING: binding {args.host}: anyone who can reach it and knows the key can use the model",
              file=sys.stderr)
    from megappo.workers.rollout.vllm_env import on_gpu

    if (hf / SOURCE).is_file() and (hf / "adapter").is_dir() and \
            (args.dtype or ("bfloat16" if on_gpu() else "float32")) not in ("float32", "fp32"):
        print("serve: WARNING: a LoRA checkpoint's merged policy served below float32 (the default on GPU is "
              "bfloat16) rounds W + alpha/r * B @ A and can lose much of what was trained; pass --dtype float32 to "
              "serve it as trained", file=sys.stderr)
    rollout = VLLMRollout(hf, RolloutConfig(max_new_tokens=max_tokens, kv_cache_memory_mb=args.kv_cache_mb),
                          dtype=args.dtype, max_model_len=max_model_len)
    gateway = Gateway(AsyncTokenEngine.for_llm(rollout.llm), rollout.tokenizer, model_name=args.name or name,
                      max_model_len=max_model_len, max_tokens=max_tokens, tool_prompt=args.tool_prompt,
                      tool_parser=args.tool_parser, open_key=key,
                      processor=processor_for(hf))  # a VL model: its image_url parts, as its processor expands them
    print(f"serve: {hf} as {gateway.model_name!r} on http://{args.host}:{args.port}/v1 "
          f"(OpenAI API; key: {_shown_key(key, args.api_key)})", flush=True)
    uvicorn.run(make_app(gateway), host=args.host, port=args.port, log_level="warning")
    return 0


def _shown_key(key: str, given: str | None) -> str:
    """What the start line says of the key: a new one whole (the only place it is shown), a key the user gave
    (--api-key or $MEGAPPO_API_KEY) never, so it does not land in logs."""
    if given:
        return "<--api-key>"
    if os.environ.get("MEGAPPO_API_KEY"):
        return "<$MEGAPPO_API_KEY>"
    return key
