"""The background checkpoint writer: a separate process (never a thread of the training process)
that turns a rank's staged state into its DCP shard file, checksums it, counts NaN/±Inf values
in it, fsyncs it and — on the coordinator (rank 0) — commits the checkpoint directory.

No module of the writer imports torch: a writer starts in ≈ 50 ms and costs ≈ 16 MB of unique
memory when started alone (≈ 4 MB when forked by a node writer).

Two ways to run it:

* **Per rank, started by the Checkpointer** (default): ``spawn_writer()`` starts
  ``python -m trainguard.checkpoint.writer --fd N`` on one end of a socket pair. It serves that
  one training process and exits when the connection closes — after finishing (and committing)
  the save it is working on, so a save that was fully staged survives the death of its rank.
* **One per node, held by the launcher**: ``NodeWriter(socket_path).start()``
  (``node_writer``), found by the ranks through ``TG_CKPT_WRITER=<socket_path>``;
  ``python -m trainguard.checkpoint.writer --listen PATH`` runs it alone.

The parts: ``protocol`` (messages and framing), ``serve`` (one connection: shard write and
commit), ``node_writer`` (the daemon), ``client`` (the rank's side). This module is the
command line of the writer process and keeps the names it always exported.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket

from trainguard.checkpoint.client import connect_writer, spawn_writer
from trainguard.checkpoint.node_writer import NodeWriter, listen
from trainguard.checkpoint.protocol import recv_msg, send_msg
from trainguard.checkpoint.serve import CHUNK, SaveAborted, WriterConnection, serve_connection

__all__ = ["CHUNK", "NodeWriter", "SaveAborted", "WriterConnection", "connect_writer", "main",
           "recv_msg", "send_msg", "serve_connection", "spawn_writer"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="trainguard checkpoint writer")
    p.add_argument("--fd", type=int, help="serve the socket inherited on this descriptor")
    p.add_argument("--listen", help="run a node writer on this Unix socket path")
    p.add_argument("--nice", type=int, default=0)
    p.add_argument("--until-stdin-closes", action="store_true",
                   help="with --listen: finish the saves in flight and exit at end of file on "
                        "stdin (NodeWriter passes a pipe)")
    a = p.parse_args(argv)
    if a.nice:
        try:
            os.nice(a.nice)
        except OSError:
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal must not cut a commit
    if a.fd is not None:
        serve_connection(socket.socket(fileno=a.fd))
    elif a.listen:
        listen(a.listen, a.until_stdin_closes)
    else:
        p.error("give --fd or --listen")


if __name__ == "__main__":
    main()
