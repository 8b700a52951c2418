"""`resolve_groups`: every rule of its docstring (pure, no model)."""

import pytest

from strata_jax.errors import StrataError
from strata_jax.pipeline.groups import resolve_groups


def test_single_slot_is_solo():
    r = resolve_groups(1, 4)
    assert (r.mode, r.n_groups, r.slots_per_group) == ("solo", 1, 1)
    r = resolve_groups(1, 2, batch_mtp=True, piped_mtp=2)
    assert r.mode == "solo" and "solo path" in r.message and "--batch_mtp" in r.message


def test_auto_one_group_per_stage_on_split():
    r = resolve_groups(8, 4)
    assert (r.mode, r.n_groups, r.slots_per_group) == ("pipelined", 4, 2)
    assert "one group per stage" in r.message
    r = resolve_groups(4, 4)
    assert (r.n_groups, r.slots_per_group) == (4, 1)


def test_auto_unsplit_is_one_group():
    r = resolve_groups(4, 1)
    assert (r.mode, r.n_groups, r.slots_per_group) == ("serial", 1, 4)


def test_auto_with_indivisible_counts():
    assert resolve_groups(6, 4).n_groups == 3       # largest divisor of 6 not above 4
    assert resolve_groups(2, 4).n_groups == 2       # fewer slots than stages: one slot per group
    assert resolve_groups(5, 2).n_groups == 1       # prime: serial
    assert resolve_groups(5, 2).mode == "serial"


def test_explicit_groups_must_divide():
    with pytest.raises(StrataError, match="does not divide"):
        resolve_groups(6, 2, 4, True)
    with pytest.raises(StrataError, match="1..4"):
        resolve_groups(4, 2, 5, True)
    with pytest.raises(StrataError, match="1..4"):
        resolve_groups(4, 2, 0, True)
    with pytest.raises(StrataError, match="expected 'auto'"):
        resolve_groups(4, 2, "many", True)
    r = resolve_groups(6, 2, "3", True)
    assert (r.mode, r.n_groups, r.slots_per_group) == ("pipelined", 3, 2)
    r = resolve_groups(4, 4, 1, True)
    assert (r.mode, r.n_groups) == ("serial", 1)


def test_pipelined_groups_need_split():
    with pytest.raises(StrataError, match="layer split"):
        resolve_groups(4, 1, 2, True)


def test_batch_mtp_without_groups_forces_one_group():
    r = resolve_groups(4, 2, "auto", False, batch_mtp=True)
    assert (r.mode, r.n_groups, r.slots_per_group) == ("batch_mtp", 1, 4)
    assert "serial windows" in r.message and "--batch_groups 2 would pipeline" in r.message
    r = resolve_groups(4, 1, "auto", False, batch_mtp=True)  # unsplit: nothing to override
    assert r.mode == "batch_mtp" and not r.notes


def test_explicit_groups_turn_batch_mtp_off():
    r = resolve_groups(4, 2, 2, True, batch_mtp=True)
    assert (r.mode, r.n_groups) == ("pipelined", 2)
    assert "--batch_mtp turned off" in r.message
    r = resolve_groups(4, 2, "auto", True, batch_mtp=True)  # an explicit auto is honoured too
    assert (r.mode, r.n_groups) == ("pipelined", 2) and "turned off" in r.message
    r = resolve_groups(4, 2, 1, True, batch_mtp=True)  # explicit 1 group keeps it
    assert (r.mode, r.n_groups) == ("batch_mtp", 1)


def test_piped_mtp_one_slot_per_group():
    r = resolve_groups(4, 4, piped_mtp=2)
    assert (r.mode, r.n_groups, r.slots_per_group, r.piped_mtp) == ("piped_mtp", 4, 1, 2)
    r = resolve_groups(2, 2, "auto", False, batch_mtp=True, piped_mtp=1)  # piped keeps the pipeline
    assert (r.mode, r.n_groups) == ("piped_mtp", 2) and "give way" in r.message
    r = resolve_groups(4, 2, 4, True, piped_mtp=1)  # explicit one slot per group, more groups than stages
    assert (r.mode, r.n_groups) == ("piped_mtp", 4)


def test_piped_mtp_left_off_with_reason():
    r = resolve_groups(8, 4, piped_mtp=1)  # auto: 4 groups of 2
    assert r.mode == "pipelined" and r.piped_mtp == 0 and "one slot per group" in r.message
    r = resolve_groups(4, 1, piped_mtp=1)
    assert r.mode == "serial" and "needs a layer split" in r.message
    r = resolve_groups(4, 2, 1, True, piped_mtp=1)
    assert r.mode == "serial" and "--batch_groups 1 gives serial" in r.message
    r = resolve_groups(8, 4, "auto", False, batch_mtp=True, piped_mtp=1)  # falls back to batch MTP
    assert r.mode == "batch_mtp" and "--piped_mtp 1 left off" in r.message


def test_piped_mtp_out_of_range_refused():
    with pytest.raises(StrataError, match="0..7"):
        resolve_groups(2, 2, piped_mtp=8)
    with pytest.raises(StrataError, match="0..7"):
        resolve_groups(2, 2, piped_mtp=-1)


def test_bad_counts_refused():
    with pytest.raises(StrataError):
        resolve_groups(0, 1)
    with pytest.raises(StrataError):
        resolve_groups(2, 0)
