"""The CLI's own exceptions: bad input the user can fix (one ``error:`` line, exit code 2) and Ctrl-C after the
finished work was saved (one line saying what was kept, exit code 130)."""


class UsageError(Exception):
    """Bad input the user can fix; printed as one line, exit code 2."""


class Interrupted(Exception):
    """Ctrl-C: the message says what finished and where it was written; exit code 130."""
