"""The decode role in process, at an edge its table cannot see: a fence (``links.close``) that
raises. The role is built as the simulator builds it (``Seams``: no threads, the in-process fake
transfer, the engine's fake forward pass, its receiving links from the test's factory) and driven
by calling it as the engine loop does: a request arrives, its prefill's info comes, the prefill is
declared lost.
"""

from __future__ import annotations

from splitserve.config import EngineConfig, ServerConfig
from splitserve.disagg.decode_role import DecodeRole
from splitserve.disagg.lifecycle import Deadlines, Peer, PeerInfo, PeerLost, Reason
from splitserve.disagg.seams import Seams
from splitserve.disagg.transfer.links import ReceiveLinks
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.engine import LLMEngine
from splitserve.engine.io import Bootstrap, GenerateRequest, SamplingParams
from splitserve.sim.model import fake_parts

PAGE, PAGES = 16, 16


class BrokenFence(ReceiveLinks):
    """Receiving links whose ``close`` raises while ``broken``."""

    broken = True

    def close(self, writer) -> bool:
        if self.broken:
            raise RuntimeError("injected: the fence is broken")
        return super().close(writer)


def decode_role() -> tuple[DecodeRole, list[BrokenFence]]:
    made: list[BrokenFence] = []

    def links(*args, **kw) -> BrokenFence:
        made.append(BrokenFence(*args, **kw))
        return made[-1]

    server = ServerConfig(role="decode", transfer_backend="fake", port=18000)
    role = DecodeRole(server, Deadlines().validate(), seams=Seams(links=links, io_probe=lambda: None, threads=False))
    config = EngineConfig(model="sim", page_size=PAGE, max_total_tokens=PAGE * PAGES)
    loop = AsyncEngine(config, role)
    loop.engine = LLMEngine(config, fake_parts())
    role.start(loop)
    return role, made


def test_a_fence_that_raises_keeps_the_pages_quarantined_until_one_goes_through():
    """A fence that raises leaves no page of the lost prefill's rooms unfenced, where a late write
    could still land: they stay quarantined (counted, the client answered at once), the fence is
    tried again at every tick, and the pages go back only once it goes through."""
    role, made = decode_role()
    allocator = role.engine.allocator
    peer = Peer("127.0.0.1:9", "prefill0", 1)
    req = GenerateRequest("r1", tuple(range(40, 80)), SamplingParams(max_tokens=4),
                          bootstrap=Bootstrap("127.0.0.1", 9, 7))
    role.admit(req)
    role.on_event(PeerInfo(7, peer))  # registered: prefill may write its 3 pages from now on
    assert allocator.num_free == PAGES - 3

    out = role.on_event(PeerLost(peer, "injected"))
    assert [o.reason for o in out if o.finished] == [Reason.PEER_LOST]  # the client is answered at once
    assert allocator.num_free == PAGES - 3 and role.pages_quarantined == 3  # were freed unfenced
    role.tick(role.clock())
    assert allocator.num_free == PAGES - 3 and role.notices["fence_failed"] == 2

    made[0].broken = False
    role.tick(role.clock())
    assert allocator.num_free == PAGES and role.pages_quarantined == 0
    assert not role.rooms
