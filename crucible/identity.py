"""Who may open a stage boundary: HELLOs bound to the registration that holds the slot.

The shared token only says "a member of this job". Without more, any token
holder could open ``Pipe`` on a worker with a HELLO naming that worker's
predecessor, at the current epoch (both are in ``crucible status``), and feed
it activations. So each registration gets a secret of its own:

* ``Register`` issues a fresh random ``secret`` (``RegisterReply.secret``); the
  coordinator keeps it with the worker's record (in ``coordinator.state.json``,
  mode 0600, so a restarted coordinator knows it too). A rejoin (the same
  process taking its slot again) presents it and keeps it
  (``coordinator/membership.py``, "Identity").
* A worker opening the stream to its successor signs its HELLO:
  ``auth = HMAC-SHA256(secret, "crucible-hello|epoch|replica|src|dst")``, where
  ``epoch`` is its replica's route epoch. Every change of a replica's members
  changes that epoch, so a tag is good for one boundary of one route only.
* The receiver learns the tag to expect from the coordinator, over its own
  route push (``RouteUpdate.upstream_tag``, computed for it alone from its
  predecessor's secret), and refuses a HELLO without it with
  PERMISSION_DENIED. The receiver never learns the sender's secret.
* ``WatchRoutes`` (which carries a worker's expected tag) needs the worker's
  own secret: knowing a worker id (printed by ``status``) is not enough. So
  does every ``Heartbeat`` (a leave gives the slot up, "done" ends the
  worker, a pulse keeps it alive: none may be forged with the token alone).

A stale worker (declared dead, its slot taken by a replacement) has the old
registration's secret: its HELLOs fail even at the current epoch. No torch,
no I/O here.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SECRET_BYTES = 32


def new_secret() -> str:
    """A registration's secret, hex (it is stored in JSON)."""
    return secrets.token_hex(SECRET_BYTES)


def hello_tag(secret: str | bytes, epoch: int, replica: int, src: int, dst: int) -> bytes:
    key = bytes.fromhex(secret) if isinstance(secret, str) else secret
    msg = f"crucible-hello|{int(epoch)}|{int(replica)}|{int(src)}|{int(dst)}".encode()
    return hmac.new(key, msg, hashlib.sha256).digest()


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison; an empty tag never matches."""
    return bool(a) and bool(b) and hmac.compare_digest(a, b)
