"""The etcd v3 JSON-gateway client: knows etcd, nothing of locks."""
