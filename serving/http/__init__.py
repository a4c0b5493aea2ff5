"""The OpenAI-compatible HTTP front over a Runtime (server.serve): routes, request checking, errors,
response shapes, the sandboxes for untrusted work, bounded connections and Prometheus metrics."""
