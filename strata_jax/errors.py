"""User-facing errors.

Every problem a user can cause (a missing file, a file that is not GGUF, an unsupported architecture or block format,
an unknown model name, a prompt longer than the context, an impossible flag combination) raises `StrataError` with
one line that names the problem. The command-line entry points print that line and exit with status 2; the
traceback is shown only with `--verbose`.
"""


class StrataError(Exception):
    """A problem with the user's input or environment, reported as one clear line (exit status 2)."""


class UnsupportedError(StrataError):
    """An architecture, block format or feature this engine does not implement."""
