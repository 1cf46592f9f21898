"""The mistakes a user must fix, and a stop to resume from, each with its exit code (`python -m sfttrain.run`
exits with it; under torchrun it is each rank's `exitcode` in the failure summary):

    2  config error: a key, value or file named in the config (ConfigError)
    3  data error: a data file or row (DataError)
    4  non-finite loss or grad norm; the update was not applied (NonFiniteLossError)
    5  missing dependency that the config asks for, e.g. wandb (DependencyError)
    6  a checkpoint could not be saved, or a filesystem fault between saves (CheckpointError)
    7  the Hugging Face export of a committed checkpoint failed (ExportError)
    8  stopped by SIGTERM or a first Ctrl-C after saving the step in flight; the same command resumes (StoppedBySignal)
    9  a rank, or a data worker, ran out of memory or /dev/shm (OutOfMemory)

Anything else is a bug in sfttrain and ends with its traceback (exit code 1).
This module imports nothing, so the entry point can classify errors before torch loads.
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

