"""Transfer engines behind one interface: `nixl` (UCX, LIBFABRIC) and `local` (in-process copies)."""

from transfer.backends.base import Backend, TransferError, WriteOp

BACKENDS = ("nixl", "local")


def make_backend(kind: str, name: str, **kwargs) -> Backend:
    """A backend by config name: 'nixl' (kwargs: engine='UCX' | 'LIBFABRIC') or 'local'."""
    if kind == "nixl":
        from transfer.backends.nixl import NixlBackend

        return NixlBackend(name, **kwargs)
    if kind == "local":
        from transfer.backends.local import LocalBackend

        return LocalBackend(name)
    raise ValueError(f"transfer backend must be one of {BACKENDS}, got {kind!r}")


__all__ = ["BACKENDS", "Backend", "TransferError", "WriteOp", "make_backend"]
