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


def os_reason(e: OSError) -> str:
    """The reason of a failed file operation in the words the other errors use ("no such file", "is a directory,
    not a file", "permission denied"; otherwise the system's text, lower-cased at the start)."""
    if isinstance(e, FileNotFoundError):
        return "no such file"
    if isinstance(e, IsADirectoryError):
        return "is a directory, not a file"
    text = e.strerror or str(e)
    return text[:1].lower() + text[1:]
