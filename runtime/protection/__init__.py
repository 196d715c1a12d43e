"""Protection: the local snapshot (D2H), the replicas (H2H), the wire format, the transports."""
