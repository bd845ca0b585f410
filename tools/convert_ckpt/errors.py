class ConvertError(Exception):
    """A user-facing conversion error: the CLI prints it as one line and exits 1."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))
