from .base import AbstractSolver as AbstractSolver
from .newton import Newton as Newton
from .picard import Picard as Picard
from .sequential import Sequential as Sequential
