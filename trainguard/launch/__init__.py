"""One node's launcher: arguments, config, pool of ranks and spares, lease, run loop, fork server, rendezvous."""
