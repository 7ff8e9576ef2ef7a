"""Worker identity and discovery: who a worker is, and how a router finds the workers it serves with.

- ``record.py``: a worker's identity (id and incarnation) and its discovery record (role, URL,
  bootstrap port, model fingerprint, protocol version, transfer backend), validated like any
  network input wherever it is read (an etcd record, ``POST /workers``, a worker's ``/health``).
- ``signing.py``: a record sealed with a key derived from the cluster secret, so that a router
  uses only records a cluster member wrote.
- ``proof.py``: a worker's answer to a router's nonce, which proves it holds a key of the cluster
  before the router trusts it with its worker key or a client's prompt.
- ``backends.py``: the discovery stores by ``--discovery``'s scheme, and what one provides: a
  worker's registrar and a router's watcher, handed sealed values and a seal's ``open``.
- ``etcd.py``: registration under an etcd lease (a worker) and a watch of the prefix (a router).
"""
