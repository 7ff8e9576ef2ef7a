"""Worker identity and discovery: who a worker is, and how a router finds the workers it serves with.

- ``record.py``: a worker's identity (id and incarnation) and its discovery record (role, URL,
  bootstrap port, model fingerprint, protocol version, transfer backend), validated like any
  network input wherever it is read (an etcd record, ``POST /workers``, a worker's ``/health``).
- ``etcd.py``: registration under an etcd lease (a worker) and a watch of the prefix (a router).
"""
