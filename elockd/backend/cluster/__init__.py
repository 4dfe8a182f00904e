"""Several elockd nodes sharing one lock space kept in etcd (``elockd --etcd``)."""
