"""The owner's side (prefill): the exporter (tickets, leases, release), the notification tracker and the
handshake servicer. Never imports ``services.kv.reader``."""
