"""Configuration: frozen dataclasses whose field defaults are the CLI defaults (``cli.py`` builds
its options from them, so ``--help`` and the code never disagree)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import ClassVar, Optional


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    """smollm2 (the demo model, SmolLM2-135M-Instruct), tiny (random, for tests), a .gguf file (or a
    folder holding one: converted once into the model cache), or a Hugging Face checkpoint folder."""
    dtype: str = "auto"
    """float32, bfloat16, float16, or auto: on CPU bfloat16 where the CPU has native bf16
    (AVX512-BF16/AMX), else float32, and float32 for the tiny test models; on GPU the checkpoint's
    dtype. The choice is logged at start; an explicit CPU dtype slower than float32 there (bfloat16
    without native bf16, float16) is warned about."""
    quantization: str = "auto"
    """Weights' types: auto keeps a GGUF file's Q8_0, Q4_0, Q4_1 and Q4_K tensors as they are (the
    matmuls run on them; other quantized types and float checkpoints are expanded to --dtype); none
    expands everything; int8 (Q8_0) and int4 (Q4_1 projections, Q8_0 embedding and head) quantize
    at load what is not already so, in groups of 32. Needs the compiled CPU kernels (without them
    auto expands everything). Prefill and decode workers must agree (their handshake compares it)."""
    device: str = "cpu"
    """Where the model runs: cpu (tested), or cuda (optional, untested here)."""
    page_size: int = 16
    """Tokens per KV page."""
    max_total_tokens: int = 65536
    """KV pool size in tokens (rounded up to whole pages)."""
    kv_cache_dtype: str = "auto"
    """What the KV pages hold: auto (the model's compute dtype) or int8 (8-bit keys and values, a
    float32 scale per token and KV head inside the page: about half the bytes per token, so the
    same memory holds about twice the --max-total-tokens, and half the bytes cross from prefill to
    decode; the logits move by its rounding: bench/accuracy.py measures it). Prefill and decode
    workers must agree (their handshake and fingerprint compare it)."""
    max_running_requests: int = 64
    """Cap on requests in the running batch."""
    max_waiting_requests: int = 256
    """Waiting-queue length beyond which new requests get HTTP 429."""
    max_batch_tokens: int = 2048
    """Token budget of one engine step (prefill chunks plus decode tokens)."""
    prompt_chunk_cost: float = 1.0
    """While sequences decode, a step's prompt chunks may cost about this many decode-only steps
    (measured as the worker runs), so a step with a prompt chunk takes about 1 + this times a
    decode step and every stream keeps its pace while prompts arrive; smaller: steadier tokens,
    slower prompts. 0: no such limit (prompt chunks up to --max-batch-tokens)."""
    chunked_prefill: bool = True
    """Split long prompts into chunks under the step budget; off: a prompt runs in one step."""
    prefix_cache: bool = True
    """Keep the KV of full pages for reuse by later requests with the same prefix (evicted least
    recently used when pages run short); --no-prefix-cache turns it off."""
    seed: int = 0
    """Seed for requests that name none is drawn from this worker's RNG seeded with this."""
    chat_template: Optional[str] = None
    """A Jinja chat template file to use instead of the model's own (e.g. one that renders tools:
    a request with tools is refused when the template in use ignores them; docs/tools.md). Prefill
    and decode workers must use the same one (their handshake compares it)."""


@dataclass(frozen=True)
class FrontConfig:
    """What a worker and the router share: the HTTP front end, its limits and its keys. Each app's
    config adds its own fields and, where its default differs, its own (``max_connections``)."""

    host: str = "127.0.0.1"
    """Address the HTTP API listens on."""
    port: int = 8000
    """Port of the HTTP API (OpenAI-compatible)."""
    ssl_certfile: Optional[str] = None
    """Serve HTTPS with this certificate (PEM; with --ssl-keyfile)."""
    ssl_keyfile: Optional[str] = None
    """The private key of --ssl-certfile (PEM)."""
    ssl_ca_certs: Optional[str] = None
    """With TLS: require every client to present a certificate signed by these CAs (PEM)."""
    max_body_bytes: int = 8 << 20
    """Largest request body accepted (413 past it). 8 MiB holds the longest legal prompt of a
    128k-token context at 64 bytes of JSON per token (docs/security.md has the measurement)."""
    max_connections: int = 1024
    """Client connections held open at once; the newest past it gets 503 at once and is closed."""
    client_header_timeout_s: float = 60.0
    """A client connection that has not sent a whole request head this long after connecting (or
    after its previous answer, when kept alive) is closed."""
    client_body_timeout_s: float = 30.0
    """The whole request body must arrive within this many seconds, else 408 (the request goes no
    further: the router asks no worker)."""
    client_write_timeout_s: float = 30.0
    """A write to the client that cannot complete this long (the client stopped reading) ends the
    request: the connection is dropped and the request aborted (a worker frees its pages, the
    router closes both workers' legs)."""
    api_key: Optional[str] = field(default=None, repr=False)
    """The clients' key (`Authorization: Bearer KEY`): generation and the model list (a worker
    behind the router takes the router's --worker-api-key instead). Any key closes every route but
    /health to callers without one (docs/security.md: which key opens which route). Also from
    --api-key-file or $SPLITSERVE_API_KEY; a key on the command line is visible to other users in
    `ps`: prefer the file or the environment (so for every key)."""
    api_key_file: Optional[str] = None
    """A file whose first line is the clients' key (chmod 600; so for every key file)."""
    admin_api_key: Optional[str] = field(default=None, repr=False)
    """The operators' key: /flush_cache, /debug/*, the router's /workers, and what /metrics and the
    router's /health show in detail. Also from --admin-api-key-file or $SPLITSERVE_ADMIN_API_KEY."""
    admin_api_key_file: Optional[str] = None
    """A file whose first line is the operators' key."""
    metrics_api_key: Optional[str] = field(default=None, repr=False)
    """A scraper's key: /metrics, and a worker's /get_server_info or the router's /health details,
    only. Also from --metrics-api-key-file or $SPLITSERVE_METRICS_API_KEY."""
    metrics_api_key_file: Optional[str] = None
    """A file whose first line is the scraper's key."""
    protect_metrics: bool = True
    """With any key, /metrics needs one that opens it (the metrics or admin key; without either, the
    clients' key); --no-protect-metrics leaves it open to anyone, and its prefix-cache counters then
    tell anyone whether a prompt was served before (docs/security.md)."""


@dataclass(frozen=True)
class DiscoveryConfig:
    """How a worker and the router reach the store ``--discovery`` names: TLS and credentials. Each
    app's config holds one (``discovery_access``); its options are named with :attr:`FLAGS` before
    each field (``--discovery-ca-certs``: ``cli.py``)."""

    FLAGS: ClassVar[str] = "discovery_"
    ca_certs: Optional[str] = None
    """CA certificates (PEM) etcd's certificate must be signed by (TLS to etcd; etcds:// also turns it on)."""
    certfile: Optional[str] = None
    """A client certificate (PEM) for an etcd that requires one (with --discovery-keyfile)."""
    keyfile: Optional[str] = None
    """The private key of --discovery-certfile."""
    user: Optional[str] = None
    """An etcd user (etcd's auth; with --discovery-password-file)."""
    password_file: Optional[str] = None
    """A file whose first line is --discovery-user's password (chmod 600)."""


@dataclass(frozen=True)
class ServerConfig(FrontConfig):
    """A worker: its HTTP front end (:class:`FrontConfig`), its role and what the role needs."""

    role: str = "colocated"
    """colocated (prefill and decode in one worker), prefill, or decode (disaggregated: run behind the router)."""
    served_model_name: Optional[str] = None
    """Name clients use in `model`; defaults to the checkpoint folder's basename."""
    drain_timeout_s: float = 30.0
    """On SIGTERM (and a role switch, POST /role), how long in-flight requests may take before they
    are ended with an error."""
    loop_stall_s: float = 30.0
    """The engine loop must move at least this often: begin an iteration, or finish a decoder layer
    of a forward pass (so a long step is not a wedge; the bound must exceed the slowest layer, not
    the slowest step). Past it the worker is wedged: /health answers 503 (the router takes it out of rotation),
    the requests it holds are answered 503 (loop_stalled), and a prefill/decode worker stops
    answering its peers' heartbeats, so that they declare it lost and free what they hold for it."""
    bootstrap_port: int = 8998
    """Prefill role: the port of the bootstrap (control) endpoint decode workers connect to. A decode
    worker that may become a prefill (POST /role) takes it too, and binds it when it does."""
    max_control_sessions: int = 256
    """Prefill role: decode sessions registered at once (each holds a transfer connection); a new
    one past it is refused until one ends (docs/security.md)."""
    max_control_sessions_per_address: int = 32
    """Prefill role: registered decode sessions at once from one source IP address."""
    control_session_rate: float = 20.0
    """Prefill role: new decode sessions accepted a second, on average (bursts of twice as many);
    more are refused, to be registered again a second later."""
    advertise_host: Optional[str] = None
    """The host peers and the router should use to reach this worker (default: --host); on
    Kubernetes the pod's IP (status.podIP)."""
    worker_id: Optional[str] = None
    """This worker's id, stable across its restarts (reported on /health and /get_server_info with
    the incarnation drawn at each start; the router tracks workers by them); default
    ROLE@ADVERTISE_HOST:PORT."""
    role_file: Optional[str] = None
    """A file the worker writes its role to (one word and a newline, replaced whole), at start and
    at each role switch (POST /role) before it is answered: whoever starts it again reads it, so a
    worker switched and then killed comes back switched (`splitserve launch` gives each worker one)."""
    discovery: Optional[str] = None
    """Prefill and decode roles: register in etcd, etcd://HOST:PORT/PREFIX (etcds:// for TLS), under
    a lease kept alive while the worker runs; routers with the same --discovery find it there. Its
    record names http://ADVERTISE_HOST:PORT (--advertise-host) and, for a prefill, its bootstrap port.
    At most 1024 characters, its host a DNS name (at most 253) or an IP address; empty is refused."""
    discovery_ttl_s: float = 10.0
    """The lease of the discovery record: a worker that stops refreshing it (crashed, partitioned)
    leaves every router's rotation this long after its last refresh (long enough that a live worker's
    keepalive thread, unscheduled for seconds on a busy machine, does not drop out)."""
    discovery_grace_s: float = 5.0
    """On SIGTERM the lease is revoked first (routers stop sending new requests), then the worker
    goes on serving, and taking what was already routed to it, this long before it drains."""
    discovery_access: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    """How the store of --discovery is reached: its --discovery-* options (DiscoveryConfig)."""
    cluster_secret_file: Optional[str] = None
    """Prefill and decode roles: a file holding a secret shared by the cluster's workers (at least
    32 random bytes as hex or base64, e.g. `head -c 32 /dev/urandom | base64`; chmod 600: a file
    other users can read is refused). Every control connection (and the tcp
    transfer backend) is then authenticated and encrypted with CURVE keys derived from it; a peer
    without it is refused. A prefill or decode worker without it refuses to start unless
    --insecure-control-plane is given (then it warns at start)."""
    insecure_control_plane: bool = False
    """Prefill and decode roles: run without --cluster-secret-file, the control plane and the tcp
    transfer open to anyone who reaches their ports (only on a network no one else can reach;
    docs/security.md)."""
    allowed_prefill: Optional[str] = None
    """Decode role (and a prefill that may become one: POST /role): the prefills whose bootstrap
    address a request may name, comma-separated
    HOST:PORT (their bootstrap port; the host as the router names it, the host of the prefill's
    URL), HOST (any port there) or NETWORK/BITS (any address in it). Decode dials that address and hands it its KV pool's link, so a
    decode without the router's key (--worker-api-key) needs this list; with the key, only the
    router may name an address, and this list, if given, must hold it too."""
    kv_failure_policy: str = "recompute"
    """Decode role: what a request whose KV will not come (its prefill lost or failed, a transfer
    or bootstrap timeout), before its first token, becomes: recompute (decode computes the prompt
    itself into pages no late write can reach, and answers as if the KV had come) or fail (it
    fails with its reason). docs/lifecycle.md, "The fallback"."""
    transfer_backend: str = "nixl"
    """How KV pages cross between workers: nixl (UCX; shared memory, TCP, RDMA) or tcp (built in)."""
    cpus: Optional[str] = None
    """CPUs the worker runs on, a list like 0-3,6 (as `taskset -c`), applied at start; unset: the
    CPUs this process is allowed now (its affinity). `splitserve launch` gives each worker its own."""
    threads: Optional[int] = None
    """torch intra-op threads; unset: one per physical core among the CPUs it runs on (SMT siblings count once)."""
    worker_api_key: Optional[str] = field(default=None, repr=False)
    """The router's key (its --worker-api-key): opens every route, and only its holder may send the
    bootstrap fields of a split request. Also from --worker-api-key-file or $SPLITSERVE_WORKER_API_KEY."""
    worker_api_key_file: Optional[str] = None
    """A file whose first line is the router's key."""
    inject_faults: str = ""
    """Testing only, off when empty: comma-separated stall_writes, stall_writes_after=N (each room's first N
    writes land, the rest stall), fail_writes, notify_drop=P, control_drop=P,
    control_delay=P, control_delay_s=S, control_duplicate=P, seed=N, wedge_loop (the engine loop
    blocks for good once it holds a request, until shutdown), hang_transfer (the transfer thread
    blocks for good once a write is in flight), block_zmq_io (the ZMQ I/O thread blocks for good
    once a room arrives), kill_after_tokens=N / pause_after_tokens=N (the worker SIGKILLs /
    SIGSTOPs itself once it has streamed N tokens of one choice of some request)."""


def field_help(cls) -> dict[str, str]:
    """Attribute docstrings of a config dataclass and of the dataclasses it builds on, for argparse
    help (parsed from the source; a class's own docstring of a field wins over its base's)."""
    import ast
    import inspect
    import textwrap

    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                helps[node.target.id] = str(nxt.value.value)
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in helps.items() if k in names}


@dataclass(frozen=True)
class WorkerAddress:
    url: str
    """The worker's HTTP base URL, e.g. http://127.0.0.1:30001."""
    bootstrap_port: Optional[int] = None
    """Prefill workers only: the port of their bootstrap (control) endpoint."""
    id: Optional[str] = None
    """The worker id it must answer with (``id=ID`` after its URL); unset: the first it answers with."""


@dataclass(frozen=True)
class RouterConfig(FrontConfig):
    """The router: its HTTP front end (:class:`FrontConfig`), its policy, its workers."""

    max_connections: int = 4096
    policy: str = "round_robin"
    """How a worker is picked per request: round_robin, random, least_load, or cache_aware (the
    worker likely to hold the prompt's prefix in its KV cache, unless the load is out of balance;
    docs/router.md)."""
    cache_block_chars: int = 64
    """cache_aware: the prompt is matched in blocks of this many characters."""
    cache_threshold: float = 0.3
    """cache_aware: route to the best match only if it covers at least this share of the prompt."""
    cache_balance_abs: int = 4
    """cache_aware: load wins when the busiest worker has more than this many requests in flight
    more than the least busy..."""
    cache_balance_rel: float = 1.5
    """cache_aware: ...and more than this many times as many."""
    cache_index_blocks: int = 100000
    """cache_aware: blocks remembered per worker (least recently used dropped)."""
    health_interval_s: float = 2.0
    """Seconds between health checks of each worker."""
    health_failures: int = 2
    """Consecutive failed health checks that take a worker out of rotation (one success brings it back)."""
    request_timeout_s: float = 600.0
    """Upper bound on one request through the router, end to end."""
    worker_connect_timeout_s: float = 10.0
    """Bound on opening a connection to a worker (504 when it passes)."""
    worker_header_timeout_s: float = 30.0
    """Streaming requests: a worker answers its status as soon as it accepts or refuses one; a leg
    whose response headers have not come this long after it was sent fails with 504 (without
    streaming the headers come with the whole answer: request_timeout_s bounds them)."""
    pd_threshold_tokens: int = 160
    """A request whose prompt's uncached part is estimated at this many tokens or more is split
    (a prefill and a decode worker); a shorter one goes to a decode worker alone, which computes
    its prompt itself; 0 splits every request (docs/router.md, per request)."""
    pd_fallback: bool = True
    """A split request whose prefill leg failed before prefill accepted it, with no retry left, goes
    to its decode worker alone (--no-pd-fallback: the failure is the answer)."""
    pd_chars_per_token: float = 3.5
    """The router has no tokenizer: a text prompt's tokens are estimated as its characters divided
    by this (SmolLM2's tokenizer: 3.4 on English docs, 3.8 on Python; token ids count exactly)."""
    max_retries: int = 2
    """A leg that fails before anything reached the client (connection refused or broken, 503,
    429) is tried again on another worker of its role, with a new bootstrap room, at most this
    many times per request (0: never; docs/router.md)."""
    retry_budget_ratio: float = 0.2
    """Retries over the last --retry-budget-window-s may number at most this share of the requests
    received then..."""
    retry_budget_min: int = 10
    """...plus this many (so that a quiet router may still retry)."""
    retry_budget_window_s: float = 10.0
    """The window of the retry budget, in seconds."""
    max_migrations: int = 2
    """A decode worker lost after the client's answer began (its connection broken, its stream
    silent for --stream-stall-s, or ended by an error that says the worker failed) is continued on
    another decode worker, from the token ids the client has (a whole answer is sent there again), at
    most this many times per request, not charged to the retry budget (0: never; decode workers
    of an older version, which refuse ``stream_ids``, need it: docs/router.md)."""
    stream_stall_s: float = 30.0
    """A decode stream that says nothing (not even a keep-alive comment) this long after the client's
    answer began is given up as lost."""
    worker_ca_certs: Optional[str] = None
    """CA certificates (PEM) that https:// workers' certificates must be signed by, in place of the
    system's (only these are trusted; unset: the system's); their host names are checked too."""
    worker_ssl_certfile: Optional[str] = None
    """The router's client certificate for workers that require one (their --ssl-ca-certs)."""
    worker_ssl_keyfile: Optional[str] = None
    """The private key of --worker-ssl-certfile."""
    worker_api_key: Optional[str] = field(default=None, repr=False)
    """The key the router sends to its workers (their --worker-api-key), never a client's; also from
    --worker-api-key-file or $SPLITSERVE_WORKER_API_KEY."""
    worker_api_key_file: Optional[str] = None
    """A file whose first line is the workers' key."""
    discovery: Optional[str] = None
    """Find workers in etcd, etcd://HOST:PORT/PREFIX (etcds:// for TLS): the prefix is watched,
    workers registered there are added and those whose record goes are drained and removed; while
    etcd is unreachable the workers known are kept (docs/deploy.md). Beside or instead of
    --prefill/--decode. At most 1024 characters, its host a DNS name (at most 253) or an IP
    address; empty is refused."""
    discovery_access: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    """How the store of --discovery is reached: its --discovery-* options (DiscoveryConfig)."""
    cluster_secret_file: Optional[str] = None
    """The workers' cluster secret (their --cluster-secret-file): the router then uses only discovery
    records sealed with it, and trusts a worker (its worker key, a client's prompt) only once it
    answered a nonce under it or under --worker-api-key (docs/security.md)."""
    prefill: tuple[WorkerAddress, ...] = ()
    decode: tuple[WorkerAddress, ...] = ()

DEFAULT_BOOTSTRAP_PORT = 8998
