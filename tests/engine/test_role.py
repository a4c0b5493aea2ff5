"""What differs between the roles is one Traits each (engine/role.py), and a bad role is named."""

import pytest

from engine.role import Role, Traits


def test_each_role_s_traits():
    prefill, decode, colocated = Role.PREFILL.traits, Role.DECODE.traits, Role.COLOCATED.traits
    assert prefill == Traits(prefills=True, samples=False, sends_kv=True, receives_kv=False,
                             restartable=True, switchable=True)  # fmt: skip
    assert decode == Traits(prefills=False, samples=True, sends_kv=False, receives_kv=True,
                            restartable=False, switchable=True)  # fmt: skip
    assert colocated == Traits(prefills=True, samples=True, sends_kv=False, receives_kv=False,
                               restartable=True, switchable=False)  # fmt: skip
    assert Role.PREFILL.other is Role.DECODE and Role.DECODE.other is Role.PREFILL
    with pytest.raises(ValueError, match="a colocated worker has no other role"):
        _ = Role.COLOCATED.other


@pytest.mark.parametrize("value", ["router", "", "PREFILL", None, 3])
def test_a_role_that_is_none_of_them_is_refused_naming_them(value):
    with pytest.raises(ValueError, match=r"role must be one of prefill, decode, colocated, got"):
        Role.parse(value)


def test_a_role_s_name_reads_and_writes_as_itself():
    assert Role.parse("decode") is Role.DECODE and Role.parse(Role.DECODE) is Role.DECODE
    assert f"{Role.PREFILL}_tp" == "prefill_tp" and {"decode": 1}[Role.DECODE] == 1


def test_a_switch_names_a_role_an_elastic_worker_can_take():
    from serving.messages import SwitchRole, worker_codec

    assert SwitchRole("decode").role is Role.DECODE
    with pytest.raises(ValueError, match="must be prefill or decode, got colocated"):
        SwitchRole("colocated")
    codec = worker_codec()
    assert codec.decode(codec.encode(SwitchRole(Role.PREFILL))).role is Role.PREFILL
