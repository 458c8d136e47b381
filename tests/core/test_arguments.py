"""Argument checks: what they accept, and errors that name the argument."""

import pytest
import torch

from toma.core.arguments import check_dimension, check_index, check_size, check_tensor_dimension
from toma.sizing.defaults import DEFAULT_POLICY
from toma.sizing.policies import Halving, ShrinkByFactor, check_policy


def test_check_size_accepts_int_likes():
    assert check_size(8, "n") == 8
    assert check_size(torch.tensor(8), "n") == 8


@pytest.mark.parametrize(
    "value, error, text",
    [
        (None, TypeError, "required"),
        (0, ValueError, "positive"),
        (-2, ValueError, "positive"),
        (True, TypeError, "bool"),
        (2.5, TypeError, "float"),
        ("8", TypeError, "str"),
    ],
)
def test_check_size_refuses(value, error, text):
    with pytest.raises(error, match=f"my_size.*{text}"):
        check_size(value, "my_size")


def test_check_index():
    assert check_index(-3, "start") == -3
    with pytest.raises(TypeError, match="start"):
        check_index(False, "start")
    with pytest.raises(TypeError, match="end"):
        check_index(1.0, "end")


def test_check_dimension_defaults_to_zero():
    assert check_dimension(None, "dimension") == 0
    assert check_dimension(-1, "dimension") == -1


def test_check_tensor_dimension_normalises_negative_dimensions():
    assert check_tensor_dimension(torch.zeros(2, 3, 4), -1, "tensor", "dimension") == 2
    with pytest.raises(ValueError, match="dim=3 is out of range.*3 dimensions"):
        check_tensor_dimension(torch.zeros(2, 3, 4), 3, "tensor", "dim")
    with pytest.raises(TypeError, match="my_tensor must be a torch.Tensor"):
        check_tensor_dimension([[1]], 0, "my_tensor", "dimension")


def test_check_policy():
    assert check_policy(None, "policy") is None, "None: the default, read at call time"
    assert isinstance(DEFAULT_POLICY, Halving)
    gentle = ShrinkByFactor(0.8)
    assert check_policy(gentle, "policy") is gentle
    with pytest.raises(TypeError, match="toma_policy"):
        check_policy(lambda size: size // 2, "toma_policy")


def test_a_policy_class_instead_of_an_instance_is_refused_where_it_is_given():
    """`policy=Halving` would fail only at the first out-of-memory error (its shrink unbound)."""
    import toma

    with pytest.raises(TypeError, match=r"policy must be a sizing policy instance such as Halving\(\)"):
        check_policy(Halving, "policy")
    with pytest.raises(TypeError, match="policy must be a sizing policy instance"):
        toma.toma.batch(initial_batchsize=8, policy=Halving)


@pytest.mark.parametrize("value", ["yes", 1, 0.0, [None]])
def test_distributed_that_is_no_flag_and_no_process_group_is_refused_where_it_is_given(value):
    """Outside a process group such a value was taken for none; inside one, for a group, failing in a collective."""
    import toma

    data = torch.randn(3, 2)
    for call, name in (
        (lambda: toma.toma.map(lambda rows: rows, data, distributed=value), "distributed"),
        (lambda: toma.toma.batch(initial_batchsize=4, distributed=value), "distributed"),
        (lambda: toma.explicit.batch(lambda size: size, 4, toma_distributed=value), "toma_distributed"),
    ):
        with pytest.raises(TypeError, match=f"^{name} must be False, True .* or a torch.distributed process group"):
            call()
    for accepted in (False, True, None):  # outside a process group: nothing to agree on
        assert toma.explicit.batch(lambda size: size, 4, toma_distributed=accepted) == 4


@pytest.mark.parametrize("context", [["a"], {"run": 1}])
def test_an_unhashable_context_is_refused_where_it_is_given(context):
    import toma

    with pytest.raises(TypeError, match="^context must be hashable"):
        toma.toma.batch(initial_batchsize=4, context=context)
    with pytest.raises(TypeError, match="^toma_context must be hashable"):
        toma.explicit.batch(lambda size: size, 4, toma_context=context)
    decorated = toma.toma.batch(initial_batchsize=4)(lambda size: size)
    with pytest.raises(TypeError, match="^toma_context must be hashable"):
        decorated(toma_context=context)
    assert toma.explicit.batch(lambda size: size, 4, toma_context=("a", 1)) == 4
