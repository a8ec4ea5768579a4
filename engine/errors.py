"""Errors that reach the user as one line, without a traceback."""

# what a rank's error says when another rank went away first: a consequence, never the root cause of a failed run
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "shared-memory peer lost")


class UserError(Exception):
    """A problem with the user's input (a plan, a request, a model folder).

    The message must say what is wrong and how to fix it; the CLI prints it as one line. `param` names the request
    field it is about, where there is one (the server's errors carry it).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
