"""The request layer, sans-IO: bytes in, replies out; no trio, no sockets."""
