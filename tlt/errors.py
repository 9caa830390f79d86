"""Errors tlt raises for bad input: each message names the file, field or value and what was expected."""


class TltError(Exception):
    """Base of every error tlt raises on purpose."""


class ConfigError(TltError, ValueError):
    """A configuration (config.json, a YAML file, a dataclass field) is missing a field or has a bad value."""


class CheckpointError(TltError, OSError):
    """A checkpoint folder is missing, incomplete or corrupt."""


class StaleWeightsError(TltError, RuntimeError):
    """A rollout was asked for a policy version the engine does not hold."""


class TrainingError(TltError, RuntimeError):
    """Training cannot go on (a non-finite loss, a diverged update); the last good checkpoint is kept."""
