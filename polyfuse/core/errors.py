"""Errors a user can act on, and the one-line form every CLI prints them in."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupt, or of an unsupported family. The message is one line."""


def one_line(e) -> str:
    return " ".join(str(e).split())
