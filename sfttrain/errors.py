"""The mistakes a user must fix, and a stop to resume from, each kind with its exit code (README's
Troubleshooting table says what each means to a user); anything else is a bug (exit code 1). Imports
nothing, so that the entry point can classify errors before torch loads.
"""


# how the optional GPU packages install into this checkout (sfttrain is not on PyPI; flash-attn's build imports torch)
GPU_INSTALL = "pip install -e '.[gpu]' --no-build-isolation"


class UserError(Exception):
    """A mistake the user must fix (or a stop to resume from); the message says what to do."""
    exit_code = 2
    kind = "error"
    every_rank = False  # raised by every rank at the same point (not only by those that found it)


class ConfigError(UserError, ValueError):
    kind = "config error"


class DataError(ConfigError):
    exit_code = 3
    kind = "data error"


class NonFiniteLossError(UserError, RuntimeError):
    exit_code = 4
    kind = "training stopped"


class DependencyError(ConfigError):
    exit_code = 5
    kind = "missing dependency"


class CheckpointError(UserError, RuntimeError):
    exit_code = 6
    kind = "checkpoint not saved"


class ExportError(UserError, RuntimeError):
    exit_code = 7
    kind = "export failed"


class StoppedBySignal(UserError, RuntimeError):
    exit_code = 8
    kind = "stopped"
    every_rank = True


class OutOfMemory(UserError, RuntimeError):
    exit_code = 9
    kind = "out of memory"

