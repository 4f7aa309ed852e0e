"""``t2i``, the platform's command line: an HTTP client of the gateway (docs/cli.md).

It imports nothing of the services: it sees the platform exactly as a tenant or operator does,
through the public API, so it works against any deployment it can reach.
"""
