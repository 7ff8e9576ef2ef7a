"""Small lifecycle deadlines for fault tests, so each scenario runs in seconds, and the worker and
router options that use them."""

from __future__ import annotations

HEARTBEAT_S, HEARTBEAT_MISSES = 0.2, 5
PEER_SILENCE_S = HEARTBEAT_S * HEARTBEAT_MISSES  # a silent peer is declared lost after this
TRANSFER_FLOOR_S = 6.0  # > PEER_SILENCE_S + SLACK_S: a lost peer is seen before the transfer times out
KV_WAIT_S = 10.0
PREALLOC_S = 5.0
PREFILL_STALL_S = 5.0
LOOP_STALL_S = 5.0  # a loop that makes no progress for this long is wedged
BOOTSTRAP_S = 8.0
TOMBSTONE_S = 40.0
SLACK_S = 3.0  # on top of a bound, for two busy shared cores

DEADLINES = [
    "--heartbeat-interval-s", str(HEARTBEAT_S), "--heartbeat-misses", str(HEARTBEAT_MISSES),
    "--transfer-floor-s", str(TRANSFER_FLOOR_S), "--kv-wait-s", str(KV_WAIT_S),
    "--prealloc-s", str(PREALLOC_S), "--bootstrap-s", str(BOOTSTRAP_S), "--queue-s", "8",
    "--pending-registration-s", "8", "--prefill-stall-s", str(PREFILL_STALL_S), "--decode-stall-s", "5",
    "--write-drain-s", "3", "--quarantine-resend-s", "0.5", "--register-resend-s", "1",
    "--tombstone-s", str(TOMBSTONE_S), "--loop-stall-s", str(LOOP_STALL_S),
    "--reclaim-s", "15",  # under the tombstone, as every deadline must be
]
STALL = ["--inject-faults", "stall_writes"]  # every KV write stays pending until cancelled or reset
# a router that shows a failure instead of surviving it (its retries and decode-alone fallback are
# tests/test_router_retry.py's and test_router_split.py's): the fault tests are about what it tells
SHOW_FAILURES = ["--max-retries", "0", "--no-pd-fallback"]
