"""Where locks live: one interface (interface.py), in memory or in etcd (cluster/)."""
