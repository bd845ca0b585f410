"""HF <-> megatron-core dist checkpoint converter, streaming one tensor at a time (see core.py, to_mcore.py, to_hf.py, README.md).

    python -m tools.convert_ckpt hf-to-mcore --hf DIR --out DIR --tp T --pp P [--vpp V] [--model critic]
    python -m tools.convert_ckpt mcore-to-hf --ckpt DIR --out DIR
"""

from tools.convert_ckpt.to_mcore import hf_to_mcore  # noqa: F401
from tools.convert_ckpt.to_hf import mcore_to_hf  # noqa: F401
from tools.convert_ckpt.errors import ConvertError  # noqa: F401
