"""pscan: long recurrences in JAX, in parallel and exactly differentiable."""

from ._linear import linear_recurrence as linear_recurrence


__version__ = "0.1.0"
