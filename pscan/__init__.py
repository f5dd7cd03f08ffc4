"""pscan: long recurrences in JAX, in parallel and exactly differentiable."""

from . import nn as nn
from ._linear import linear_recurrence as linear_recurrence
from ._recurrence import recurrence as recurrence
from ._sharding import (
    sharded_linear_recurrence as sharded_linear_recurrence,
)
from ._sharding import (
    sharded_recurrence as sharded_recurrence,
)
from ._solution import RESULTS as RESULTS
from ._solution import Solution as Solution
from ._solvers import (
    AbstractSolver as AbstractSolver,
)
from ._solvers import (
    Newton as Newton,
)
from ._solvers import (
    Picard as Picard,
)
from ._solvers import (
    Problem as Problem,
)
from ._solvers import (
    Sequential as Sequential,
)

__version__ = "0.1.0"
