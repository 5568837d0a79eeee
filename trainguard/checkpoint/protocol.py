"""The wire protocol between a training process and its checkpoint writer (torch-free).

Framing (trusted local peers only): 4-byte big-endian length + pickle of a dict.

Client → writer:

* ``{"op": "plan", "plan_id", "items"}`` — the layout of this rank's shard file, sent once per
  state-dict structure (``SavePlan.writer_items``);
* ``{"op": "save", "id", "plan_id", "shm_path", "tmp_dir", "final_dir", "rank", "world_size",
  "bytes_data", "coordinator", "metadata", "manifest", "commit_timeout_s", "fsync"}``;
* ``{"op": "cancel", "id"}`` — abort a commit waiting for shards;
* ``{"op": "prune", "paths"}`` — retention: delete these checkpoint directories;
* ``{"op": "ping"}``.

Writer → client:

* ``{"op": "done", "id", "path", "bytes", "committed", "nonfinite"}`` — ``nonfinite``:
  ``[{"key", "offsets", "count"}]``, the tensors holding NaN/±Inf, found while writing: this
  rank's, or on the coordinator every rank's;
* ``{"op": "failed", "id", "error", "errno"}``;
* ``{"op": "pong", "pid"}``.
"""
from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_HDR = struct.Struct(">I")


def send_msg(sock: socket.socket, obj: Any) -> None:
    """Send one framed message (length + pickle)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HDR.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> Any | None:
    """Receive one framed message; None when the peer closed the connection."""
    try:
        hdr = _recv_exact(sock, _HDR.size)
        if hdr is None:
            return None
        body = _recv_exact(sock, _HDR.unpack(hdr)[0])
    except (ConnectionResetError, BrokenPipeError):
        return None
    if body is None:
        return None
    return pickle.loads(body)
