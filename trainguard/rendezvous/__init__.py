"""A job's rendezvous: the store's endpoint, the token gate in front of it, the per-generation barrier and the groups it forms."""
