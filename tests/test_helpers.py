"""The shared test helpers themselves: a comparison that can fail."""

import numpy as np

from .helpers import tree_allclose


def test_tree_allclose_is_strict():
    x = {"a": np.ones(3), "b": (np.zeros(2), np.ones(1))}
    assert tree_allclose(x, {"a": np.ones(3), "b": (np.zeros(2), np.ones(1))})
    # a different value
    assert not tree_allclose(x, {"a": np.ones(3), "b": (np.ones(2), np.ones(1))})
    # a missing leaf
    assert not tree_allclose(x, {"a": np.ones(3), "b": (np.zeros(2),)})
    # another structure with the same leaves
    assert not tree_allclose(x, [np.ones(3), np.zeros(2), np.ones(1)])
    # a shape that only broadcasts
    assert not tree_allclose(np.ones(3), np.ones(1))
    assert not tree_allclose(np.ones((3, 1)), np.ones((3, 3)))
