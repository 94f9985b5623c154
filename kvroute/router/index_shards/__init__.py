"""The KV index in its own processes: K shard processes per router host, each owning a disjoint
set of workers (by a stable hash of the name), subscribing to their bridges and answering the
router's queries over Unix sockets in a private directory (`index.processes` in the config)."""
