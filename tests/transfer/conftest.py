import os

import pytest

# keep NIXL/UCX traffic on loopback, and UCX away from InfiniBand (it crashes this VM's processes at exit)
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")


@pytest.fixture
def pair(request):
    """A prefill and a decode engine of tiny-random, and both messenger halves between them."""
    from engine import LLM
    from tests.transfer.messengers import PAGES, _close, _local_pair

    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
    pm, dm = _local_pair(prefill, decode, request.node.name)
    yield prefill, decode, pm, dm
    _close(pm, dm)
