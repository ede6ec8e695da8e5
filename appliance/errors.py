"""Errors that reach the user as one line, never as a traceback."""


class UserError(Exception):
    """A mistake the user can fix (bad config, bad audio file, missing model or device).

    The message is one line that names the file (or device) and the fix. The command line prints it
    as ``error: <message>`` and exits with status 2.
    """

    exit_code = 2

    def __init__(self, message: str = ""):
        super().__init__(one_line(str(message)))


MAX_MESSAGE_CHARS = 600  # an error is read on a console or in `systemctl status`: one line, not a dump


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` with its white space collapsed to single spaces and cut to ``limit`` characters (the cut
    marked with "…"), so that no input, however large, makes an error message large."""
    text = " ".join(text[: limit * 4].split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def yaml_problem(exc) -> tuple:
    """Where and what a PyYAML error is, for one line: (line or None, text). The line is where the parser
    gave up, which is often the line after the mistake (an unclosed ``[`` or quote shows up on the next
    key), so the text also names the line where the construct it was reading began, when that differs."""
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None and start.line + 1 != line:
        what = f"{what} ({context} that began at line {start.line + 1})"
    return line, what
