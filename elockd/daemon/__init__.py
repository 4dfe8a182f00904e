"""The elockd process: flags, configuration, start-up, logs, the server's wiring."""
