"""What the server tells operators: log records, their throttles, request traces.

Every I/O layer reports here (net/, handover/, the cluster backend); the request
layer never logs itself, it reports through hooks that the daemon wires to these.
The process's logging set-up stays in :mod:`elockd.daemon.logs`.
"""
