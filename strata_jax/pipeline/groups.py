"""How batch slots are grouped on the stages: one pure function, `resolve_groups`.

Rules (from Strata's ``batch_groups::resolve``, with piped MTP as in its pull request #2985):

* ``--batch 1`` is the solo path (proposals, if any, are the solo loop's).
* ``--batch_groups auto`` gives one group per stage on a layer split, one group unsplit. When the slot count is not
  a multiple of the stage count, auto takes the largest divisor of N not above the stage count.
* An explicit G must lie in 1..N and divide N; G > 1 needs a layer split (pipelining needs two stages).
* ``--batch_mtp`` (one proposal per slot, serial windows) without an explicit ``--batch_groups`` forces 1 group,
  and the message says why; an explicit G > 1 (or an explicit ``auto`` that resolves to G > 1) is honoured and turns
  ``--batch_mtp`` off, with a message.
* ``--piped_mtp N`` (N >= 1 proposals per group window, kept on the device; Strata PR #2985) needs pipelined groups
  of one slot each (as many slots as groups, G > 1). With ``--batch_groups`` not given, auto must give that (N slots = N
  stages); otherwise piped MTP is left off with a line saying why, and the other flags resolve as if it were not
  given. N outside 1..7 (a window holds at most 8 rows) is refused.

Modes: ``solo`` (one slot), ``serial`` (all slots in one window through every stage), ``pipelined`` (G groups, stage
k runs group g while stage k+1 runs group g-1), ``batch_mtp`` (serial windows of each slot's token + 1 proposal),
``piped_mtp`` (pipelined groups of one slot, each window its token + up to N proposals).
"""

from __future__ import annotations

import dataclasses

from strata_jax.errors import StrataError

MODES = ("solo", "serial", "pipelined", "batch_mtp", "piped_mtp")
MAX_WINDOW_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What `resolve_groups` decided.

    Attributes:
      n_groups: G (1 for solo, serial and batch_mtp).
      mode: one of `MODES`.
      slots_per_group: N // G.
      message: one log line saying what was resolved and why.
      piped_mtp: proposals per group window in ``piped_mtp`` mode (0 otherwise).
      notes: the reasons behind each flag that was turned off or overridden (also folded into ``message``).
    """

    n_groups: int
    mode: str
    slots_per_group: int
    message: str
    piped_mtp: int = 0
    notes: tuple = ()


def _auto_groups(n_slots: int, n_stages: int) -> int:
    if n_stages <= 1:
        return 1
    g = min(n_stages, n_slots)
    while n_slots % g:
        g -= 1
    return g


def resolve_groups(n_slots: int, n_stages: int, batch_groups="auto", batch_groups_given: bool = False,
                   batch_mtp: bool = False, piped_mtp: int = 0) -> Resolution:
    """Resolve ``--batch``, ``--batch_groups``, ``--batch_mtp`` and ``--piped_mtp`` into a group count and a mode.

    Args:
      n_slots: N, slots of state (``--batch``), >= 1.
      n_stages: stages of the layer split (1 unsplit), >= 1.
      batch_groups: ``"auto"`` or an int G (a numeric string is accepted).
      batch_groups_given: whether ``--batch_groups`` was given on the command line (an explicit ``auto`` counts).
      batch_mtp: ``--batch_mtp`` asked for.
      piped_mtp: ``--piped_mtp`` N (0 = off).

    Returns:
      `Resolution`.

    Raises:
      StrataError: N or stages < 1, G not "auto" / not an integer / outside 1..N / not dividing N, G > 1 without a
        layer split, piped_mtp outside 0..7.
    """
    n_slots, n_stages = int(n_slots), int(n_stages)
    if n_slots < 1:
        raise StrataError(f"--batch {n_slots}: needs at least 1 slot")
    if n_stages < 1:
        raise StrataError(f"{n_stages} stages: needs at least 1")
    piped_mtp = int(piped_mtp)
    if not 0 <= piped_mtp <= MAX_WINDOW_ROWS - 1:
        raise StrataError(f"--piped_mtp {piped_mtp}: must lie in 0..{MAX_WINDOW_ROWS - 1} "
                          f"(a window holds the slot's token + at most {MAX_WINDOW_ROWS - 1} proposals)")
    auto = isinstance(batch_groups, str) and batch_groups.strip().lower() == "auto"
    if not auto:
        try:
            g_req = int(batch_groups)
        except (TypeError, ValueError):
            raise StrataError(f"--batch_groups {batch_groups!r}: expected 'auto' or a number of groups") from None
        if not 1 <= g_req <= n_slots:
            raise StrataError(f"--batch_groups {g_req}: must lie in 1..{n_slots} (--batch {n_slots})")
        if n_slots % g_req:
            divs = [d for d in range(1, n_slots + 1) if n_slots % d == 0]
            raise StrataError(f"--batch_groups {g_req} does not divide --batch {n_slots} (possible: "
                              f"{', '.join(map(str, divs))})")
        if g_req > 1 and n_stages == 1:
            raise StrataError(f"--batch_groups {g_req}: pipelined groups need a layer split (--layer_split); "
                              f"without one use --batch_groups 1 or auto")
    notes: list[str] = []

    if n_slots == 1:
        for flag, on in (("--batch_mtp", batch_mtp), ("--piped_mtp", piped_mtp > 0)):
            if on:
                notes.append(f"{flag} is for batch slots; one slot runs the solo path (its proposals are --draft's)")
        msg = "--batch 1: the solo path" + ("; " + "; ".join(notes) if notes else "")
        return Resolution(1, "solo", 1, msg, 0, tuple(notes))

    g_auto = _auto_groups(n_slots, n_stages)
    g = g_auto if auto else g_req
    how = (f"auto ({'one group per stage' if g == n_stages else 'largest divisor of the slots not above the stages'}"
           f" on {n_stages} stages)" if auto and n_stages > 1 else ("auto (unsplit)" if auto else "explicit"))

    # ---- piped MTP: pipelined groups of one slot, proposals in each group's window
    if piped_mtp:
        why = ""
        if n_stages == 1:
            why = "it needs a layer split (pipelined groups)"
        elif g == 1:
            why = "it needs pipelined groups, and --batch_groups 1 gives serial windows"
        elif n_slots // g != 1:
            why = (f"it needs one slot per group, and {g} groups of {n_slots // g} slots were resolved "
                   f"(--batch {n_slots} on {n_stages} stages; --batch {g_auto if g_auto > 1 else n_stages} or "
                   f"--batch_groups {n_slots} would give one slot per group)")
        if not why:
            extra = "; --batch_mtp's serial windows give way to it" if batch_mtp else ""
            msg = (f"--batch {n_slots}, --batch_groups {how}: {g} pipelined groups of 1 slot, piped MTP with up to "
                   f"{piped_mtp} proposal(s) per group window{extra}")
            return Resolution(g, "piped_mtp", 1, msg, piped_mtp, tuple(notes))
        notes.append(f"--piped_mtp {piped_mtp} left off: {why}")

    # ---- batch MTP: serial windows of token + 1 proposal per slot
    if batch_mtp:
        if not batch_groups_given:
            if g_auto > 1:
                notes.append(f"--batch_mtp runs in serial windows, so auto gives 1 group of {n_slots} instead of "
                             f"{g_auto} pipelined groups (--batch_groups {g_auto} would pipeline them and turn "
                             f"--batch_mtp off)")
            msg = f"--batch {n_slots}: 1 group of {n_slots} slots, batch MTP (serial windows, 1 proposal per slot)"
            return Resolution(1, "batch_mtp", n_slots, _join(msg, notes), 0, tuple(notes))
        if g > 1:
            notes.append(f"--batch_mtp turned off: --batch_groups {'auto' if auto else g} pipelines {g} groups, and "
                         f"pipelined groups run no batch MTP (use --piped_mtp N with one slot per group)")
        else:
            msg = f"--batch {n_slots}: 1 group of {n_slots} slots, batch MTP (serial windows, 1 proposal per slot)"
            return Resolution(1, "batch_mtp", n_slots, _join(msg, notes), 0, tuple(notes))

    if g == 1:
        msg = f"--batch {n_slots}, --batch_groups {how}: 1 group of {n_slots} slots, serial windows"
        return Resolution(1, "serial", n_slots, _join(msg, notes), 0, tuple(notes))
    msg = (f"--batch {n_slots}, --batch_groups {how}: {g} pipelined groups of {n_slots // g} slot(s) on "
           f"{n_stages} stages")
    return Resolution(g, "pipelined", n_slots // g, _join(msg, notes), 0, tuple(notes))


def _join(msg: str, notes: list[str]) -> str:
    return msg + ("; " + "; ".join(notes) if notes else "")
