"""Helpers the tests share: servers, clients, etcd clusters, network labs, checkers."""
