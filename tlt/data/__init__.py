"""Prompt data for RL: `Example` records from the built-in task or from user datasets."""

from tlt.data.datasets import load_examples
from tlt.data.example import Example, task_examples

__all__ = ["Example", "load_examples", "task_examples"]
