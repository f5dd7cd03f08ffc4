from ._base import (
    AbstractSolver as AbstractSolver,
    Problem as Problem,
    check_solver as check_solver,
)
from ._chunks import Chunks as Chunks
from ._elk import ELK as ELK
from ._jacobian import (
    AbstractJacobian as AbstractJacobian,
    DenseJacobian as DenseJacobian,
    DiagonalJacobian as DiagonalJacobian,
)
from ._newton import Newton as Newton
from ._picard import Picard as Picard
from ._sequential import Sequential as Sequential
from ._shooting import AbstractShootingSolver as AbstractShootingSolver
