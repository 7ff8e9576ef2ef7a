"""NIXL backend: one-sided UCX WRITEs of the KV pool, with NIXL notifications.

Setup: one ``nixl_agent`` per worker with the UCX backend; the whole pool tensor is registered
once (``DRAM`` for CPU memory, ``VRAM`` for a CUDA tensor). :meth:`NixlBackend.metadata` carries
the agent's NIXL metadata (UCX worker address and the registration's remote keys) plus the pool's
base address, so a writer can address any byte of the peer's pool by offset.

A write builds two Nx3 descriptor lists (address, length, device id) from the spans, one row per
span (``page_spans`` has already merged runs of pages contiguous on both sides), and hands them to
``initialize_xfer`` / ``transfer`` with the notification; :meth:`~NixlBackend.poll` maps
``check_xfer_state`` to PENDING/DONE/FAILED. Every NIXL call sits behind a try: a NIXL error
becomes FAILED with its reason, never an exception out of ``write`` or ``poll``. An empty span list
sends the notification alone (``send_notif``). What this relies on of NIXL (notification order,
releases that do not stop posted bytes, the progress thread kept off, the import names):
``docs/protocol.md``, *Transfer backends*.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .base import DONE, Handle, Span, TransferBackend, TransferState, encode_metadata, failed, refused

log = logging.getLogger(__name__)


def _import_nixl_api() -> Any:
    errors = []
    for module in ("nixl._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            errors.append(f"{module}: {e}")
    raise ModuleNotFoundError("NIXL is not installed (pip install nixl-cu12): " + "; ".join(errors), name="nixl")


_api = _import_nixl_api()


@dataclass(eq=False)
class NixlHandle(Handle):
    xfer: Optional[Any] = None  # nixl_xfer_handle


@dataclass(frozen=True)
class _Peer:
    metadata: bytes
    base: int
    nbytes: int
    dev: int


SHARED_MEMORY_TLS = ("sm", "cma", "posix", "sysv", "xpmem", "knem", "all")


def keep_ucx_off_shared_memory() -> None:
    """Before the first NIXL agent of a process that receives: UCX without its shared-memory
    transports, which closing a link cannot fence (module docstring). An operator's own
    ``UCX_TLS`` is kept, with a warning if it lets them in."""
    tls = os.environ.get("UCX_TLS")
    if tls is None:
        os.environ["UCX_TLS"] = "^sm"
        return
    names = {t.strip() for t in tls.lstrip("^").split(",")}
    excluded = tls.startswith("^")
    unfenced = ("sm" not in names and "cma" not in names) if excluded else bool(names & set(SHARED_MEMORY_TLS))
    if unfenced:
        log.warning("UCX_TLS=%s lets same-host writers use shared memory, which closing a receiving link does "
                    "not fence: a frozen writer declared lost could still write into reused pages "
                    "(unset UCX_TLS, or exclude sm)", tls)


def _reason(prefix: str, e: BaseException) -> str:
    return f"{prefix}: {type(e).__name__}: {e}"


class NixlBackend(TransferBackend):
    name = "nixl"

    @classmethod
    def prepare_receiver(cls) -> None:
        keep_ucx_off_shared_memory()

    def __init__(
        self,
        agent_name: str,
        buffer: torch.Tensor,
        *,
        nixl_backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
        progress_thread: bool = False,
        **opts: Any,
    ):
        super().__init__(agent_name, buffer)
        self._mem = "VRAM" if buffer.is_cuda else "DRAM"
        self._dev = (buffer.device.index or 0) if buffer.is_cuda else 0
        self._base = buffer.data_ptr()
        config = _api.nixl_agent_config(
            enable_prog_thread=progress_thread, backends=list(nixl_backends), num_threads=num_threads
        )
        self._agent = _api.nixl_agent(agent_name, config)
        missing = [b for b in nixl_backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(f"NIXL backend(s) {missing} unavailable; plugins here: {self._agent.get_plugin_list()}")
        self._reg = self._agent.register_memory([(self._base, self.nbytes, self._dev, "")], self._mem)
        self._peers: dict[str, _Peer] = {}
        self._live: dict[int, NixlHandle] = {}
        self._zombies: list[Any] = []  # xfer handles NIXL refused to release yet
        self._closed = False

    def metadata(self) -> bytes:
        return encode_metadata(
            self.name, self.agent_name, self.nbytes,
            base=self._base, dev=self._dev, mem=self._mem, nixl=self._agent.get_agent_metadata(),
        )

    def add_peer(self, peer_name: str, metadata: bytes) -> None:
        known = self._peers.get(peer_name)
        md = self._check_new_peer(peer_name, metadata, known.metadata if known is not None else None)
        if md is None:
            return
        if md.get("mem") != self._mem:
            raise ValueError(f"peer {peer_name!r}: pool in {md.get('mem')!r} memory, ours in {self._mem!r}")
        try:
            loaded = self._agent.add_remote_agent(md["nixl"])
        except Exception as e:
            raise RuntimeError(_reason(f"NIXL could not load the metadata of peer {peer_name!r}", e)) from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != peer_name:
            self._agent.remove_remote_agent(loaded)
            raise ValueError(f"peer {peer_name!r}: its NIXL metadata names agent {loaded!r}")
        self._peers[peer_name] = _Peer(metadata, int(md["base"]), md["nbytes"], int(md["dev"]))

    def remove_peer(self, peer_name: str) -> None:
        if self._peers.pop(peer_name, None) is None:
            return
        for h in list(self._live.values()):
            if h.peer == peer_name:
                if h.state.pending:
                    h.state = failed("peer_removed")
                self._drop_xfer(h)
        try:
            self._agent.remove_remote_agent(peer_name)
        except Exception as e:
            log.warning("NIXL could not forget peer %r: %s", peer_name, e)

    def write(self, peer_name: str, spans: Sequence[Span], notif: bytes) -> NixlHandle:
        self._retry_zombies()
        h = NixlHandle(peer_name, sum(s.nbytes for s in spans), len(spans))
        peer = self._peers.get(peer_name)
        if (reason := self._refusal(peer_name, spans, peer.nbytes if peer is not None else None)) is not None:
            h.state = refused(reason)
        elif not spans and not notif:
            h.state = DONE
        elif not spans:  # a notification alone carries no KV bytes
            try:
                self._agent.send_notif(peer_name, bytes(notif))
                h.state = DONE
            except Exception as e:
                h.state = refused(_reason("transfer_error", e))
        else:
            h.state = self._post(h, peer, spans, bytes(notif))
        if h.state.failed:
            log.debug("write to %r failed at once: %s", peer_name, h.state.reason)
        self._live[h.id] = h
        return h

    def poll(self, handle: Handle) -> TransferState:
        self._check_handle(handle, NixlHandle)
        if not handle.state.pending or handle.xfer is None:
            return handle.state
        try:
            status = self._agent.check_xfer_state(handle.xfer)
        except Exception as e:
            handle.state = failed(_reason("transfer_error", e))
            return handle.state
        if status == "DONE":
            handle.state = DONE
        elif status == "ERR":
            handle.state = failed("transfer_error: NIXL reported ERR")
        return handle.state

    def release(self, handle: Handle) -> None:
        self._check_handle(handle, NixlHandle)
        if handle.state.pending:
            handle.state = failed("released")
        handle.released = True
        self._drop_xfer(handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        if self._closed:
            return []
        try:
            new = self._agent.get_new_notifs()
        except Exception as e:
            log.warning("NIXL get_new_notifs failed: %s", e)
            return []
        return [(peer, msg) for peer, msgs in new.items() for msg in msgs]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in list(self._live.values()):
            self.release(h)
        for peer in list(self._peers):
            self.remove_peer(peer)
        self._retry_zombies()
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as e:
            log.warning("NIXL could not deregister the KV pool of %r: %s", self.agent_name, e)
        self._zombies.clear()
        del self._agent  # the C++ agent is destroyed with its last reference

    # -- internals ----------------------------------------------------------------------------

    def _post(self, h: NixlHandle, peer: _Peer, spans: Sequence[Span], notif: bytes) -> TransferState:
        rows = np.array([(s.local_offset, s.remote_offset, s.nbytes) for s in spans], dtype=np.uint64)
        local = np.empty((len(spans), 3), dtype=np.uint64)
        remote = np.empty((len(spans), 3), dtype=np.uint64)
        local[:, 0] = rows[:, 0] + np.uint64(self._base)
        remote[:, 0] = rows[:, 1] + np.uint64(peer.base)
        local[:, 1] = remote[:, 1] = rows[:, 2]
        local[:, 2], remote[:, 2] = self._dev, peer.dev
        try:
            h.xfer = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local, self._mem),
                self._agent.get_xfer_descs(remote, self._mem),
                h.peer,
                notif,
            )
        except Exception as e:  # nothing was posted
            return refused(_reason("transfer_error", e))
        try:
            status = self._agent.transfer(h.xfer)
        except Exception as e:  # posted in part, perhaps
            return failed(_reason("transfer_error", e))
        if status == "DONE":
            return DONE
        if status == "ERR":
            return failed("transfer_error: NIXL could not post the write")
        return h.state

    def _drop_xfer(self, h: NixlHandle) -> None:
        self._live.pop(h.id, None)
        xfer, h.xfer = h.xfer, None
        if xfer is None:
            return
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as e:  # NIXL could not cancel it yet: keep it and retry later
            log.warning("NIXL could not release a transfer to %r yet: %s", h.peer, e)
            self._zombies.append(xfer)

    def _retry_zombies(self) -> None:
        still = []
        for xfer in self._zombies:
            try:
                self._agent.release_xfer_handle(xfer)
            except Exception:
                still.append(xfer)
        self._zombies = still
