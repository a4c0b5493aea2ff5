"""KV transfer between prefill and decode workers: the write plan (plan.py); messenger and backends next."""
