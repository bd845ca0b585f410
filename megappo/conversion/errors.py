import json
from pathlib import Path


def read_json(path: Path, missing: str) -> dict:
    """The JSON object in `path`, or a ConvertError: `missing` when the file is absent, "corrupt ..."
    when it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConvertError(missing) from None
    except json.JSONDecodeError:
        raise ConvertError(f"corrupt {path}: not JSON") from None


class ConvertError(Exception):
    """A user-facing conversion error: the CLI prints it as one line and exits 1."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))
