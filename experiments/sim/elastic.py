"""Elastic roles in the simulation (experiments/sim/simulate.py): the real deployment's Planner on the
simulated clock moves instances between prefill and decode, as the real driver does.
"""

from __future__ import annotations

from engine.role import Role


def hand_back(sim, inst, now) -> None:
    """A decode instance leaves its role: every request it has or expects is fetched again (prompt
    and outputs so far) for another decode instance, as the real runtime resumes them."""
    name = sim.names[id(inst)]
    mine = inst.running + inst.waiting + inst.recompute + sim.inbox[id(inst)]
    inst.running, inst.waiting, inst.recompute, sim.inbox[id(inst)] = [], [], [], []
    inst.kv_used = 0.0
    inst.handed_back += len(mine)
    for r in mine:
        sim.refetch(r, name, now)


def plan(sim, now) -> None:
    """The planner's next move, if any: its instance leaves its role (at its next step boundary)."""
    roles = {sim.names[id(i)]: (Role.PREFILL if i in sim.front else Role.DECODE) for i in sim.instances}
    move = sim.planner.decide(roles, sim.policy, busy=bool(sim.leaving))
    if move is None or move[0] not in sim.by_name:
        return
    name, role = move
    inst = sim.by_name[name]
    if sum(1 for r in roles.values() if r == roles[name]) < 2:
        return  # the last of its role stays (as the real fleet refuses)
    sim.leaving[id(inst)] = Role.parse(role)
    sim.policy.leave(name)
    sim.moves.append({"worker": name, "from": roles[name], "to": role, "at": now, "why": sim.planner.why})
    sim.kick(inst, now)  # an idle one moves now; a busy one at its next step boundary


def serve(sim, inst, role, now) -> None:
    """inst serves role from now on."""
    del sim.leaving[id(inst)]
    (sim.back if role.receives_kv else sim.front).append(inst)
    for key, value in inst.role_settings.get(role, {}).items():
        setattr(inst, key, value)
    if inst.cache is not None:  # as the engine's set_role: only a decode role keeps out of the pool
        inst.cache.share = role.prefills
    sim.inbox.setdefault(id(inst), [])
    sim.homed.setdefault(id(inst), 0)
    sim.policy.join(sim.names[id(inst)], role)
    for move in sim.moves:
        if move["worker"] == sim.names[id(inst)] and "seconds" not in move:
            move["seconds"] = now - move["at"]
