"""Errors tlt raises for bad input: each message names the file, field or value and what was expected."""


class TltError(Exception):
    """Base of every error tlt raises on purpose."""


class ConfigError(TltError, ValueError):
    """A configuration (config.json, a YAML file, a dataclass field) is missing a field or has a bad value."""


class FieldError(ConfigError):
    """One field of a config has a bad value. `field` is its name within that config; `within(group)`
    names it from the config that holds it as a group (`arms` -> `tuner.arms`)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(f"field {field!r} {problem}")

    def within(self, group: str) -> "FieldError":
        return FieldError(f"{group}.{self.field}", self.problem)

    def __reduce__(self):  # pickled across processes with both arguments
        return FieldError, (self.field, self.problem)


class CheckpointError(TltError, OSError):
    """A checkpoint folder is missing, incomplete or corrupt."""


class StaleWeightsError(TltError, RuntimeError):
    """A rollout was asked for a policy version the engine does not hold."""


class TrainingError(TltError, RuntimeError):
    """Training cannot go on (a non-finite loss, a diverged update); the last good checkpoint is kept."""
