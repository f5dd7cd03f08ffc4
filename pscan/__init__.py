"""pscan: long recurrences in JAX, in parallel and exactly differentiable."""

from . import nn as nn
from ._associative import associative_scan as associative_scan
from ._linear import linear_recurrence as linear_recurrence
from ._recurrence import recurrence as recurrence
from ._sharding import (
    sharded_linear_recurrence as sharded_linear_recurrence,
    sharded_recurrence as sharded_recurrence,
)
from ._solution import RESULTS as RESULTS, Solution as Solution
from ._solvers import (
    ELK as ELK,
    AbstractJacobian as AbstractJacobian,
    AbstractShootingSolver as AbstractShootingSolver,
    AbstractSolver as AbstractSolver,
    Chunks as Chunks,
    DenseJacobian as DenseJacobian,
    DiagonalJacobian as DiagonalJacobian,
    Newton as Newton,
    Picard as Picard,
    Problem as Problem,
    Sequential as Sequential,
)

__version__ = "0.1.0"
