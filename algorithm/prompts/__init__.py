"""Prompt optimisation (issue 29): the searches over prompt bundles and their evaluator and proposer protocols."""

from fulmen.algorithm.prompts import base, search
from fulmen.algorithm.prompts.base import *  # noqa: F403 - the package re-exports both modules' __all__
from fulmen.algorithm.prompts.search import *  # noqa: F403

__all__ = [*base.__all__, *search.__all__]
