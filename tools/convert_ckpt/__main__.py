"""`python -m tools.convert_ckpt hf-to-mcore ...` / `python -m tools.convert_ckpt mcore-to-hf ...`"""

import sys

from megappo.conversion.cli import main

if __name__ == "__main__":  # dist_checkpointing-style entry guard (spawned helpers re-import __main__)
    sys.exit(main())
