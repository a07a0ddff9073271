"""plan_units: which subtrees become units under a WrapPolicy, and which unit owns each parameter."""

from __future__ import annotations

import pytest
from torch import nn

from zero_core.config import WrapPolicy
from zero_core.unit import check_wrap_classes_present, plan_units


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.inner = Inner()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.outer = nn.ModuleList([Outer(), Outer()])
        self.head = nn.Linear(4, 2)


def _names(plans: list) -> list[str]:
    return [plan.name for plan in plans]


def test_nested_units_in_pre_order_with_their_parents() -> None:
    plans = plan_units(Net(), WrapPolicy(module_classes=(Outer, Inner)), bucket_numel=10**9)
    assert _names(plans) == ["", "outer.0", "outer.0.inner", "outer.1", "outer.1.inner"]
    assert [plan.parent for plan in plans] == [None, 0, 1, 0, 3]
    assert [plan.index for plan in plans] == [0, 1, 2, 3, 4]


def test_a_nested_unit_takes_its_parameters_out_of_the_enclosing_one() -> None:
    plans = plan_units(Net(), WrapPolicy(module_classes=(Outer, Inner)), bucket_numel=10**9)
    fqns = [[names[0] for names in plan.param_fqns] for plan in plans]
    assert fqns[0] == ["stem.weight", "stem.bias", "head.weight", "head.bias"]  # registration order
    assert fqns[1] == ["outer.0.norm.weight", "outer.0.norm.bias"]
    assert fqns[2] == ["outer.0.inner.proj.weight", "outer.0.inner.proj.bias"]
    assert [len(plan.params) for plan in plans] == [len(plan.param_fqns) for plan in plans] == [4, 2, 2, 2, 2]


def test_each_unit_lists_the_modules_it_is_the_nearest_unit_of() -> None:
    model = Net()
    plans = plan_units(model, WrapPolicy(module_classes=(Outer,)), bucket_numel=10**9)
    assert plans[0].modules == [model, model.stem, model.outer, model.head]
    outer = model.outer[1]
    assert plans[2].modules == [outer, outer.norm, outer.inner, outer.inner.proj]


def test_a_module_registered_twice_is_one_unit() -> None:
    model = Net()
    model.alias = model.outer[0]  # the same block under a second name
    plans = plan_units(model, WrapPolicy(module_classes=(Outer,)), bucket_numel=10**9)
    assert _names(plans) == ["", "outer.0", "outer.1"]
    assert plans[1].param_fqns[0] == ("outer.0.norm.weight", "alias.norm.weight")


def test_a_parameter_shared_by_a_unit_and_the_root_belongs_to_the_root() -> None:
    model = Net()
    model.outer[0].inner.proj.weight = model.stem.weight
    plans = plan_units(model, WrapPolicy(module_classes=(Outer, Inner)), bucket_numel=10**9)
    assert ("stem.weight", "outer.0.inner.proj.weight") in plans[0].param_fqns
    assert all(names[0] != "outer.0.inner.proj.weight" for plan in plans for names in plan.param_fqns)


def test_every_parameter_is_owned_once() -> None:
    model = Net()
    model.outer[1].inner.proj.bias = model.outer[0].inner.proj.bias  # shared by two nested units
    plans = plan_units(model, WrapPolicy(module_classes=(Inner,)), bucket_numel=10**9)
    owned = [id(p) for plan in plans for p in plan.params]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())
    assert ("outer.0.inner.proj.bias", "outer.1.inner.proj.bias") in plans[0].param_fqns  # their common ancestor


def test_the_size_policy_claims_the_smallest_subtrees_that_reach_the_threshold() -> None:
    model = Net()  # Linear(4, 4): 20 parameters; LayerNorm(4): 8; each Outer: 28
    plans = plan_units(model, WrapPolicy(min_unit_numel=20), bucket_numel=10**9)
    assert _names(plans) == ["", "stem", "outer.0.inner.proj", "outer.1.inner.proj"]
    # The norms (8 each) never reach 20 alone; the Outer blocks' unclaimed 8 neither: they stay in the root.
    assert [names[0] for names in plans[0].param_fqns][:2] == ["outer.0.norm.weight", "outer.0.norm.bias"]
    plans = plan_units(model, WrapPolicy(min_unit_numel=16), bucket_numel=10**9)
    assert _names(plans) == ["", "stem", "outer", "outer.0.inner.proj", "outer.1.inner.proj"]


def test_the_bucket_size_is_the_threshold_without_one() -> None:
    model = Net()
    assert _names(plan_units(model, WrapPolicy(), bucket_numel=20)) == _names(
        plan_units(model, WrapPolicy(min_unit_numel=20), bucket_numel=10**9)
    )
    assert _names(plan_units(model, WrapPolicy(), bucket_numel=10**9)) == [""]


def test_bad_policies_are_refused_with_what_to_do() -> None:
    with pytest.raises(
        ValueError, match=r"must be a tuple of nn.Module subclasses, for example \(MyTransformerBlock,\)"
    ):
        WrapPolicy(module_classes=[Outer])
    with pytest.raises(ValueError, match="must be a tuple of nn.Module subclasses"):
        WrapPolicy(module_classes=(int,))
    with pytest.raises(ValueError, match="min_unit_numel must be a positive number of parameters"):
        WrapPolicy(min_unit_numel=0)


def test_a_wrap_class_the_model_lacks_is_refused_naming_the_classes_it_has() -> None:
    """Otherwise the model's blocks silently stay in the root unit (stage 3 gathers everything at once)."""
    with pytest.raises(ValueError, match=r"no module of the model is a torch.nn.modules.transformer.Transformer"):
        check_wrap_classes_present(Net(), WrapPolicy(module_classes=(Outer, nn.TransformerEncoderLayer)))
    with pytest.raises(ValueError, match=r"module classes: \['Inner', 'LayerNorm', 'Linear', 'ModuleList', 'Outer'\]"):
        check_wrap_classes_present(Net(), WrapPolicy(module_classes=(Net,)))  # only the model itself is one
    check_wrap_classes_present(Net(), WrapPolicy(module_classes=(Outer, nn.Linear)))
    check_wrap_classes_present(Net(), WrapPolicy(module_classes=(nn.Module,)))  # a base class matches its subclasses
    check_wrap_classes_present(Net(), WrapPolicy())  # the size policy names no class


def test_fsdps_transformer_wrap_policy_is_read_as_its_classes_and_other_callables_refused() -> None:
    """What an FSDP user passes as ``wrap_policy`` unchanged: its classes, or a refusal that says what to pass."""
    import functools

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from zero_core.wrap_policy import as_wrap_policy

    fsdp_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    assert as_wrap_policy(fsdp_policy).module_classes == (nn.Linear,)
    with pytest.raises(ValueError, match="pass the module classes that become units instead"):
        as_wrap_policy(lambda module: True)
