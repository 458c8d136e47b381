"""Sizing policies: the sequences they produce and the arguments they refuse."""

import pytest

from toma.sizing.defaults import DEFAULT_POLICY
from toma.sizing.policies import Halving, ShrinkByFactor, SizePolicy


def sequence(policy: SizePolicy, size: int):
    sizes = [size]
    while (size := policy.shrink(size)) is not None:
        sizes.append(size)
    return sizes


def test_halving_is_tomas_sequence():
    assert sequence(DEFAULT_POLICY, 512) == [512, 256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert sequence(Halving(), 100) == [100, 50, 25, 12, 6, 3, 1]


def test_gentler_factor():
    assert sequence(ShrinkByFactor(0.9), 256)[:4] == [256, 230, 207, 186]
    tail = sequence(ShrinkByFactor(0.9), 12)
    assert tail == [12, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1], "always shrinks by at least one"


def test_minimum_is_a_floor():
    assert sequence(Halving(minimum=48), 512) == [512, 256, 128, 64, 48]
    assert sequence(ShrinkByFactor(0.75, minimum=3), 3) == [3]


def test_huge_sizes_halve_exactly():
    assert ShrinkByFactor(0.5).shrink(2**60 + 1) == 2**59


@pytest.mark.parametrize("factor", [0, 1, 1.5, -0.5])
def test_factor_out_of_range(factor):
    with pytest.raises(ValueError, match="factor"):
        ShrinkByFactor(factor)


@pytest.mark.parametrize("factor", ["0.5", True, None])
def test_factor_wrong_type(factor):
    with pytest.raises(TypeError, match="factor"):
        ShrinkByFactor(factor)


@pytest.mark.parametrize("minimum, error", [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_minimum(minimum, error):
    with pytest.raises(error, match="minimum"):
        ShrinkByFactor(0.5, minimum)


def test_base_class_is_abstract():
    with pytest.raises(NotImplementedError):
        SizePolicy().shrink(4)
