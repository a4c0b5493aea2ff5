import os

# keep NIXL/UCX traffic on loopback, and UCX away from InfiniBand (it crashes this VM's processes at exit)
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")
