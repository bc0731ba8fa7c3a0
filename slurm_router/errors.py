"""The project's error types for a user's mistake. A leaf: imports nothing of the project."""


class UserError(Exception):
    """A mistake in the user's config or files: reported as one line, exit code 2, no traceback."""
