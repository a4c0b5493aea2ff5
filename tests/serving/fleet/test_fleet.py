"""Fleet's bookkeeping of deaths and restarts, over stand-in processes (no worker runs here)."""

from engine.role import Role
from serving.fleet.fleet import Fleet
from serving.messages import PeerDead


class Proc:
    """A worker's handle: alive until it dies; rerun() starts it again, which may fail."""

    def __init__(self, pid: int):
        self.pid, self.alive, self.restarts, self.exitcode = pid, True, 0, None

    def is_alive(self) -> bool:
        return self.alive

    def die(self) -> None:
        self.alive, self.exitcode = False, 1

    def rerun(self) -> None:
        self.restarts += 1
        self.alive, self.exitcode = True, None


class Launcher:
    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts

    def restart(self, name, proc) -> bool:
        if proc.restarts >= self.max_restarts:
            return False
        proc.rerun()
        return True


def _fleet(max_restarts: int):
    procs = {"prefill-0": Proc(100), "decode-0": Proc(200)}
    roles = {"prefill-0": Role.PREFILL, "decode-0": Role.DECODE}
    fleet = Fleet(None, procs, roles, "", Launcher(max_restarts), start_timeout_s=300.0)
    sent = []
    fleet.send = lambda name, msg: sent.append((name, msg)) or True
    return fleet, procs, sent


def test_a_restarted_worker_that_dies_before_it_is_back_is_a_death_and_its_peers_stop_waiting():
    """It was missed: a restarting worker was skipped as dead, so a restart that failed (Ray's run()
    sent while the actor was still restarting; a worker that crashes as it starts) left the decode
    worker holding its requests for the whole of start_timeout_s."""
    fleet, procs, sent = _fleet(max_restarts=1)
    procs["prefill-0"].die()
    assert fleet.deaths() == [("prefill-0", 1)]
    assert fleet.restarting == {"prefill-0"} and procs["prefill-0"].restarts == 1
    assert sent == [("decode-0", PeerDead("prefill-0", 300.0, 100))]  # wait for it
    assert fleet.deaths() == []  # restarting, not yet back: nothing new
    procs["prefill-0"].die()  # the restart failed: no restart left
    assert fleet.deaths() == [("prefill-0", 1)]
    assert fleet.restarting == set() and fleet.dead == {"prefill-0"}
    assert sent[1:] == [("decode-0", PeerDead("prefill-0", 0.0, 100))]  # not coming back: stop waiting
    assert fleet.deaths() == []  # dead for good: told once


def test_a_worker_restarted_twice_is_waited_for_twice():
    fleet, procs, sent = _fleet(max_restarts=2)
    procs["prefill-0"].die()
    fleet.deaths()
    procs["prefill-0"].die()  # died again while restarting; one restart left
    assert fleet.deaths() == [("prefill-0", 1)]
    assert fleet.restarting == {"prefill-0"} and procs["prefill-0"].restarts == 2
    assert [m.back_within_s for _, m in sent] == [300.0, 300.0]


def test_a_dead_decode_worker_is_not_announced_to_anyone():
    fleet, procs, sent = _fleet(max_restarts=0)
    procs["decode-0"].die()
    assert fleet.deaths() == [("decode-0", 1)] and sent == [] and fleet.restarting == set()


def test_a_prefill_worker_that_connects_after_every_decode_worker_listens_still_gets_its_connect(tmp_path):
    """Seen in CI (the netns NIC-cut test): a prefill worker started seconds after its decode peer had not
    yet connected to the runtime's socket when the decode worker said Listening; its Connect went nowhere
    (ROUTER_MANDATORY) and both waited 300 s for each other. A prefill worker's own Listening is now what
    its Connect answers, whichever comes first."""
    import time

    import zmq

    from serving.control import driver_socket
    from serving.messages import Connect, Listening, worker_codec
    from transfer import auth
    from transfer.config import TransferConfig

    keys = auth.keyring(["driver", "decode-0", "prefill-0"])
    sock = driver_socket(keys, str(tmp_path), TransferConfig())
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    roles = {"prefill-0": Role.PREFILL, "decode-0": Role.DECODE}
    fleet = Fleet(sock, {}, roles, str(tmp_path))
    codec, sockets = worker_codec(), {}

    def worker(name: str):
        w = zmq.Context.instance().socket(zmq.DEALER)
        w.setsockopt(zmq.LINGER, 0)
        w.setsockopt(zmq.IDENTITY, name.encode())
        auth.connect_as(w, keys[name], "driver")
        w.connect(address)
        sockets[name] = w
        return w

    def until(done) -> None:
        give_up = time.monotonic() + 30
        while not done() and time.monotonic() < give_up:
            sock.poll(50)
            fleet.receive()
        assert done()

    try:
        worker("decode-0").send(codec.encode(Listening("decode-0", {"prefill-0": "tcp://127.0.0.1:1"})))
        until(lambda: "decode-0" in fleet.listening)  # every decode worker listens; prefill-0 is not here
        prefill = worker("prefill-0")
        prefill.send(codec.encode(Listening("prefill-0", {})))
        until(lambda: prefill.poll(0))
        assert codec.decode(prefill.recv()) == Connect({"decode-0": "tcp://127.0.0.1:1"})
    finally:
        for w in sockets.values():
            w.close()
        sock.close()
