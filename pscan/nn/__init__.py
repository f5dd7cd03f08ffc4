"""Equinox layers and recurrent cells built on pscan."""

from .._cell import (
    AbstractCell as AbstractCell,
    AbstractLinearCell as AbstractLinearCell,
)
from ._elman import ElmanCell as ElmanCell
from ._lru import LRU as LRU
from ._min_rnn import MinGRU as MinGRU, MinLSTM as MinLSTM
from ._recurrence import (
    Bidirectional as Bidirectional,
    Recurrence as Recurrence,
    default_solver as default_solver,
)
