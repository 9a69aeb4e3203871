"""Errors a user can act on.

Every mistake a user can make (a bad config value, a missing file, a corrupt image)
is raised as a :class:`PetError` subclass whose message names the culprit and what to
do. The command-line tools print that message as one line and exit non-zero instead of
showing a traceback.
"""


class PetError(Exception):
    """Base class of user-facing errors: the message alone tells the user what to fix."""


class ConfigError(PetError, ValueError):
    """A config file, key or value is wrong."""


class DataError(PetError):
    """A dataset, annotation file or image is missing or malformed."""


class TrainingError(PetError):
    """Training cannot go on (for example a non-finite loss)."""


class TrainingInterrupted(PetError):
    """Training was stopped on request (SIGTERM / SIGINT) after saving a checkpoint."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
