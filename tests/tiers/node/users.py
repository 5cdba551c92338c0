"""Engines of two users sharing a pool (``node_shared_group``): the users and their group (the ``shared_path``
fixture, in conftest.py, is a ``node_path`` both may use)."""

from __future__ import annotations

import sys

GROUP = 0  # root's group: both users below are put in it, as an operator puts engines' users in one group
USERS = (65533, 65534)


def as_user(uid: int) -> list[str]:
    """The command line start of a Python run as ``uid`` in ``GROUP`` (the script follows ``-c``)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={GROUP}", "--clear-groups", sys.executable, "-c"]
