"""Who may talk to whom: per-deployment CURVE keys, and one ZAP authenticator per process.

Each deployment makes a keyring: a CURVE key pair per member (the driver and every worker) and a
directory of their public keys. A member gets its own secret key and the directory, never another's
secret. Every socket that binds is a CURVE server whose ZAP domain names the members allowed to connect
to it; a client proves its key in the handshake and is refused (logged, counted) otherwise. The same
holds on `ipc://` and `tcp://`, so a process on this host that can open the socket file, or a host that
can reach the port, gets nothing without the deployment's keys. Accepted peers carry their member name
as the ZMQ `User-Id` of every frame they send, so a ROUTER can bind a message to its sender.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Credentials:
    """One member's keys: its own pair (z85) and every member's public key by name."""

    name: str
    public: bytes
    secret: bytes = field(repr=False)
    directory: dict[str, bytes] = field(default_factory=dict)

    def public_of(self, name: str) -> bytes:
        if name not in self.directory:
            raise ValueError(
                f"{name!r} is not a member of this deployment; members: {sorted(self.directory)}"
            )
        return self.directory[name]


def keyring(names: list[str]) -> dict[str, Credentials]:
    """Fresh credentials for each member (a new deployment secret)."""
    pairs = {n: zmq.curve_keypair() for n in names}
    directory = {n: pub for n, (pub, _) in pairs.items()}
    return {n: Credentials(n, pub, sec, directory) for n, (pub, sec) in pairs.items()}


class _Allow:
    """The ZAP callback of one domain: only these members' keys."""

    def __init__(self, allowed: dict[bytes, str]):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        refused[domain] = refused.get(domain, 0) + 1
        log.warning("refused a peer without this deployment's key on %s", domain)
        return False


class _Authenticator(ThreadAuthenticator):
    def __init__(self, context: zmq.Context):
        super().__init__(context, log=logging.getLogger("transfer.auth.zap"))
        self.names: dict[bytes, str] = {}  # z85 public key -> member name

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.names.get(zmq.utils.z85.encode(client_public_key), "")


refused: dict[str, int] = {}  # ZAP domain -> handshakes refused in this process
_auth: _Authenticator | None = None
_lock = threading.Lock()


def _authenticator(ctx: zmq.Context) -> _Authenticator:
    global _auth
    with _lock:
        if _auth is None or _auth.context is not ctx:
            _auth = _Authenticator(ctx)
            _auth.start()
        return _auth


def serve(sock: zmq.Socket, creds: Credentials, domain: str, allowed: list[str]) -> None:
    """Make sock (before bind) a CURVE server that accepts only the named members, under ZAP domain."""
    auth = _authenticator(sock.context)
    keys = {creds.public_of(n): n for n in allowed}
    auth.names.update(keys)
    auth.configure_curve_callback(domain, _Allow(keys))
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP answer for the domain: refuse, never allow
    sock.zap_domain = domain.encode()
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = creds.public, creds.secret


def connect_as(sock: zmq.Socket, creds: Credentials, server: str) -> None:
    """Make sock (before connect) a CURVE client of the named member."""
    sock.curve_publickey, sock.curve_secretkey = creds.public, creds.secret
    sock.curve_serverkey = creds.public_of(server)


def sender(frame: zmq.Frame) -> str:
    """The authenticated member that sent a received frame ('' if none)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return ""
