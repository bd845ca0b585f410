"""`python -m tools.convert_ckpt ...`: the checkpoint converter's entry point from a checkout (the library is
megappo/conversion; `megappo convert` is the same command)."""

from megappo.conversion import ConvertError, hf_to_mcore, mcore_to_hf  # noqa: F401
