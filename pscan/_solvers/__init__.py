from ._base import (
    AbstractSolver as AbstractSolver,
    Problem as Problem,
    check_positive_int as check_positive_int,
)
from ._newton import Newton as Newton
from ._picard import Picard as Picard
from ._sequential import Sequential as Sequential
from ._shooting import AbstractShootingSolver as AbstractShootingSolver
