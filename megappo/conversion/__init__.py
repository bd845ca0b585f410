"""HF <-> megatron-core dist checkpoint conversion, streaming one tensor at a time (core.py, to_mcore.py, to_hf.py,
README.md): the library `megappo convert`, `megappo export`, `megappo eval` and the trainer's final export use.

    megappo convert hf-to-mcore --hf DIR --out DIR --tp T --pp P [--vpp V] [--model critic]
    megappo convert mcore-to-hf --ckpt DIR --out DIR      (also: python -m tools.convert_ckpt ...)
"""

from megappo.conversion.to_mcore import hf_to_mcore  # noqa: F401
from megappo.conversion.to_hf import mcore_to_hf  # noqa: F401
from megappo.conversion.errors import ConvertError  # noqa: F401
