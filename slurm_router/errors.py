"""The project's error types: a user's mistake; a scheduler that does not answer. A leaf: imports nothing."""


class UserError(Exception):
    """A mistake in the user's config or files: reported as one line, exit code 2, no traceback."""


class SchedulerUnavailable(Exception):
    """The scheduler did not answer, however long it was given (a Slurm controller down or overloaded): one line
    naming the command and what to do, exit 75 (EX_TEMPFAIL: try again later); the user did nothing wrong."""

    def __init__(self, what: str, todo: str | None = None, back: str = "the scheduler answers again"):
        """back: how the user sees the scheduler is back (its backend's words); todo: what to do then."""
        todo = todo or f"try again once {back}"
        super().__init__(f"{what}; {todo}")
        self.what, self.back = what, back
