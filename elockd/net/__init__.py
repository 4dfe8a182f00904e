"""Trio I/O: listeners, the connection loop, transports, the HTTP port."""
