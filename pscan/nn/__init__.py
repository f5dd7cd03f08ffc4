"""Equinox layers and recurrent cells built on pscan."""

from .._cell import (
    AbstractCell as AbstractCell,
)
from .._cell import (
    AbstractLinearCell as AbstractLinearCell,
)
from ._elman import ElmanCell as ElmanCell
from ._lru import LRU as LRU
from ._min_rnn import MinGRU as MinGRU
from ._min_rnn import MinLSTM as MinLSTM
from ._recurrence import Recurrence as Recurrence
from ._recurrence import default_solver as default_solver
