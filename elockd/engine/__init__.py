"""The lock engine: pure rules, no trio, no I/O; time is passed in."""
