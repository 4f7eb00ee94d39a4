"""Example environments for Loom (see README.md): ``loom_guess:Guess`` and ``loom_guess:ShellQuiz``."""

from loom_guess.envs import Guess, ShellQuiz

__all__ = ["Guess", "ShellQuiz"]
