"""What the end-to-end suites need installed (`make test` installs it): missing, their modules fail to
import, so the suite goes red instead of skipping a whole module without a word."""


def nixl() -> None:
    """NIXL, either build (nixl-cu12 or nixl-cu13: transfer.backends.nixl takes both)."""
    from transfer.backends.nixl import NIXL_PACKAGES, _nixl

    try:
        _nixl()
    except ImportError as e:
        raise ImportError(f"{e} (one of {NIXL_PACKAGES}); `make test` installs it") from e
