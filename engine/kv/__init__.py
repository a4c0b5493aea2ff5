"""The KV cache below the model: device pages and the prefix cache (cache), the tiers below them (tiers:
host pool, files, the shared pool), a page's slot format (pages), files (disk) and the pool (pool)."""
