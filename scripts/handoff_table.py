"""Print docs/handoff.md's table of exits: for each (state, exit) case of tests/transfer/test_handoff.py,
the moves the request made on each side after it reached that state (from the sides' own counters).

    python scripts/handoff_table.py            # about a minute on 2 cores
"""

import logging
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.transfer import test_handoff as cases  # noqa: E402


def _path(before: Counter, after: Counter) -> str:
    """The moves counted between before and after, in the order each was first made."""
    new = [move for move, n in after.items() if n > before.get(move, 0)]
    return ", ".join(f"{to} ({cause})" for _, to, cause in new) or "(nothing)"


def main() -> None:
    logging.disable(logging.WARNING)
    rows = []
    for state, exit in cases.CASES:
        pair = cases._Pair(f"table-{state}-{exit}")
        try:
            cases._drive(pair, state)
            dm0, pm0 = Counter(pair.dm.handoff.transitions), Counter(pair.pm.handoff.transitions)
            cases._exit(pair, exit)
            pair.heal()
            pair.until(pair.settled, f"{state} / {exit}")
            out = pair.decode.kept.get("r") if pair.decode_up else None
            end = out.finish_reason if out else "(decode gone)"
            end = "cancelled in the backlog" if pair.cancelled else end
            decode = _path(dm0, pair.dm.handoff.transitions) if pair.decode_up else "(gone)"
            prefill = _path(pm0, pair.pm.handoff.transitions) if pair.prefill_up else "(gone)"
            side = "decode" if isinstance(state, cases.DecodeState) else "prefill"
            rows.append(f"| {side} {state} | {exit} | {decode} | {prefill} | {end} |")
        finally:
            if pair.prefill_up:
                cases._close(pair.pm, pair.dm)
    print("| state | exit | decode side's moves after | prefill side's moves after | request |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
