"""Errors that reach the user as one line, never as a traceback."""


class UserError(Exception):
    """A mistake the user can fix (bad config, bad audio file, missing model or device).

    The message is one line that names the file (or device) and the fix. The command line prints it
    as ``error: <message>`` and exits with status 2.
    """

    exit_code = 2
