"""Prompt data for RL: `Example` records from the built-in task or from user datasets."""

from tlt.data.example import Example, task_examples

__all__ = ["Example", "task_examples"]
